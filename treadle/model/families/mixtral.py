"""Mixtral: a Mistral decoder whose feed-forward is a mixture of experts (moe.py), the chosen
experts' weights always renormalised. Checkpoints name the experts `block_sparse_moe.experts.E.w1`
(gate), `w3` (up), `w2` (down) and the router `block_sparse_moe.gate`; llama.cpp writes Mixtral as
a "llama" file with stacked experts, which the Llama family reads (its `expert_count`).
"""

from dataclasses import replace

from treadle.model.config import ModelConfig, MoEConfig
from treadle.model.families.llama import DecoderLayer, MistralModel
from treadle.model.layers.moe import moe_shapes

NAMES = dict(router="block_sparse_moe.gate.weight", experts="block_sparse_moe.experts", names=("w1", "w3", "w2"))


class MixtralLayer(DecoderLayer):
    moe_names = NAMES


class MixtralModel(MistralModel):
    hf_model_types = ("mixtral",)
    hf_architectures = ("MixtralForCausalLM",)
    gguf_architectures = ()  # llama.cpp writes Mixtral files as "llama" with experts

    layer_class = MixtralLayer

    @staticmethod
    def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = MistralModel.expected_shapes(replace(config, moe=None))
        for i in range(config.num_layers):
            moe_shapes(config, i, shapes, f"model.layers.{i}.", **NAMES)
        return shapes

    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        moe = MoEConfig(
            num_experts=hf.need("num_local_experts"),
            top_k=hf.need("num_experts_per_tok"),
            expert_size=hf.need("intermediate_size"),
            norm_topk=True,
        )
        return hf.checked(hf.llama_style(moe=moe))
