"""Gemma 2: Gemma 3's decoder (gemma3.py) without the q/k norms, with one RoPE base for every
layer, every other layer local (layers 0, 2, ... within the sliding window), and soft-capping of
the attention scores (`attn_logit_softcapping`, 50 in the released models: treadle's kernel and the
SDPA path's `eager_attention` both apply it before the softmax) and of the final logits (30).
"""

import dataclasses

from treadle.model.families.gemma3 import Gemma3Config, Gemma3Model

SLIDING_WINDOW_PATTERN = 2  # transformers' default and llama.cpp's fixed value for gemma2 files


class Gemma2Model(Gemma3Model):
    hf_model_types = ("gemma2",)
    hf_architectures = ("Gemma2ForCausalLM",)
    gguf_architectures = ("gemma2",)

    @classmethod
    def config_from_hf(cls, hf) -> Gemma3Config:
        cls._check_activation(hf)
        config = cls._gemma_style(hf, SLIDING_WINDOW_PATTERN, qk_norm=False)
        config.local_rope = dataclasses.replace(config.rope)
        return cls._checked(hf.where, hf.checked(config))

    @classmethod
    def config_from_gguf(cls, gguf) -> Gemma3Config:
        # llama.cpp: the query scale is 1/sqrt(head_dim), except Gemma 2 27B's (46 layers): 1/sqrt(hidden / heads)
        config = cls._gguf_gemma_style(gguf, SLIDING_WINDOW_PATTERN, layers_scaled_by_width=46)
        config.local_rope = dataclasses.replace(config.rope)
        return config
