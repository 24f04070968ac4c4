"""A treadle plugin, as a third party would write one: a Llama whose MLP gates with tanh-approximated
GELU (transformers' LlamaForCausalLM with hidden_act="gelu_pytorch_tanh").

Loaded by `TREADLE_PLUGINS=tests.support.plugin_gelu_llama`, or by importing it.
"""

import torch.nn.functional as F

from treadle.model.families.llama import LlamaModel
from treadle.model.families.registry import register_model

ARCHITECTURE = "gelu_llama"


class GeluLlamaModel(LlamaModel):
    @staticmethod
    def mlp_activation(gate):
        return F.gelu(gate, approximate="tanh")


register_model(ARCHITECTURE, "tests.support.plugin_gelu_llama:GeluLlamaModel")
