"""Phi-3 / Phi-4(-mini): a Llama-style decoder whose checkpoints fuse q, k, v into one `qkv_proj`
and gate, up into one `gate_up_proj` (the Llama decoder joins them at load anyway: here they arrive
joined), with longrope scaling (Phi-3's short and long factors and attention factor) and partial
rotary embeddings (Phi-4-mini rotates 3/4 of each head), both read by `hf_loader.HFConfig.rope`.
A sliding window (Phi-3-mini's 2,047) is one sliding cache group, as Mistral's.

GGUF files of this architecture (llama.cpp's `phi3`, with rope_factors_long/short tensors) are
not read yet.
"""

from .config import ModelConfig
from .llama import DecoderLayer, LayerWeights, LlamaModel, expected_shapes


class Phi3Layer(DecoderLayer):
    def __init__(self, config: ModelConfig, lw: LayerWeights):
        self.input_norm = lw.norm("input_layernorm.weight")
        self.post_attention_norm = lw.norm("post_attention_layernorm.weight")
        self.qkv = lw.linear(("self_attn.qkv_proj.weight",))
        self.q_norm = self.k_norm = None
        self.o_proj = lw.linear(("self_attn.o_proj.weight",))
        self.gate_up = lw.linear(("mlp.gate_up_proj.weight",))  # gate rows first, then up: as the model chunks it
        self.down = lw.linear(("mlp.down_proj.weight",))


class Phi3Model(LlamaModel):
    layer_class = Phi3Layer
    gguf_permuted_qk = False

    @staticmethod
    def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = expected_shapes(config)
        h, ff = config.hidden_size, config.intermediate_size
        qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            for name in (
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "mlp.gate_proj.weight",
                "mlp.up_proj.weight",
            ):
                del shapes[p + name]
            shapes[p + "self_attn.qkv_proj.weight"] = (qkv, h)
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * ff, h)
        return shapes

    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        return hf.checked(hf.llama_style(attention_bias=False))
