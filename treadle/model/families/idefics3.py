"""SmolVLM and Idefics3: a Llama text model (llama.py) that sees through SigLIP and a pixel-shuffle
connector (idefics3_vision.py).

- config.json keeps the text model's hyperparameters in `text_config`, read with transformers'
  defaults: a key it leaves out takes LlamaConfig's (vocab 32,000, RMSNorm eps 1e-6, ...), a
  missing `text_config` the composite config's (eps 1e-5). Only the top level's
  `tie_word_embeddings` (False unless written) ties the head: text_config's is not read;
- the checkpoint names the text model `model.text_model.*` (read as `model.*`), the encoder
  `model.vision_model.*`, the connector `model.connector.*`; the head is `lm_head.weight`;
- an image is tiles (media/processors.py, Idefics3Images): a grid of `<row_i_col_j>` tiles and the
  whole image shrunk to one, each tile's embeddings taking the place of its run of `<image>`
  tokens (`image_token_id`), tiles in prompt order. The text model attends causally over them.
"""

from dataclasses import dataclass, field

import torch

from treadle.model.config import ModelConfig, ModelLoadError
from treadle.model.families.idefics3_vision import Idefics3Vision
from treadle.model.families.llama import LlamaModel

# transformers' LlamaConfig defaults, for keys a text_config leaves out
LLAMA_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
}  # fmt: skip
NO_TEXT_CONFIG = {"rms_norm_eps": 1e-5}  # Idefics3Config's text_config when there is none


@dataclass
class Idefics3Config(ModelConfig):
    # the folder's config.json (the encoder's and the connector's settings: idefics3_vision.py)
    multimodal: dict = field(default_factory=dict)


class Idefics3Model(LlamaModel):
    hf_model_types = ("idefics3", "smolvlm")
    hf_architectures = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")

    @classmethod
    def config_from_hf(cls, hf) -> Idefics3Config:
        text = hf.section("text_config") if "text_config" in hf.cfg else NO_TEXT_CONFIG
        kind = text.get("model_type", "llama")
        if kind != "llama":
            raise ModelLoadError(f"{hf.where}: text_config.model_type = {kind!r}: expected llama")
        text = {**LLAMA_DEFAULTS, **text, "tie_word_embeddings": hf.get("tie_word_embeddings", False)}
        text_hf = type(hf)(hf.folder, text, hf.arch)
        return text_hf.checked(text_hf.llama_style(Idefics3Config, multimodal=hf.cfg))

    def __init__(
        self, config: Idefics3Config, weights: dict, dtype: torch.dtype, device="cpu", batch_invariant: bool = False
    ):
        vision = {}  # the encoder's and the connector's tensors, and the text model's under Llama's names
        for name in list(weights):
            base = name.removeprefix("model.")
            if Idefics3Vision.is_vision_tensor(base):
                vision[base] = weights.pop(name)
            elif base.startswith("text_model."):
                weights["model." + base.removeprefix("text_model.")] = weights.pop(name)
        self.vision = Idefics3Vision.from_hf(
            config.multimodal, config.hidden_size, vision.pop, list(vision), dtype, device
        )
        if vision:
            raise ModelLoadError(f"weight model.{sorted(vision)[0]}: unexpected for architecture {config.architecture}")
        super().__init__(config, weights, dtype, device, batch_invariant)
