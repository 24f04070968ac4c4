"""Phi-3 / Phi-4(-mini): a Llama-style decoder whose checkpoints fuse q, k, v into one `qkv_proj`
and gate, up into one `gate_up_proj` (the Llama decoder joins them at load anyway: here they arrive
joined), with longrope scaling (Phi-3's short and long factors and attention factor) and partial
rotary embeddings (Phi-4-mini rotates 3/4 of each head), both read by `hf_loader.HFConfig.rope`.
A sliding window (Phi-3-mini's 2,047) is one sliding cache group, as Mistral's.

llama.cpp's `phi3` files hold the same fused tensors (`attn_qkv`, and `ffn_up` of gate and up
rows), the rotated dimensions as `rope.dimension_count`, and longrope as two tensors
(`rope_factors_long` / `_short`, read by the loader) with `rope.scaling.attn_factor` and
`rope.scaling.original_context_length`. llama.cpp itself ignores the file's sliding window
(a TODO in its phi3 model); treadle honours it, as transformers does.
"""

from treadle.model.config import ModelConfig, file_float, file_int
from treadle.model.families.llama import DecoderLayer, LayerWeights, LlamaModel, expected_shapes
from treadle.model.loading.gguf_names import LLAMA_LAYER_TENSORS


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
    hf_model_types = ("phi3",)
    hf_architectures = ("Phi3ForCausalLM",)
    gguf_architectures = ("phi3",)

    layer_class = Phi3Layer
    gguf_permuted_qk = False
    gguf_layer_tensors = {
        **LLAMA_LAYER_TENSORS,
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
    }

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

    @classmethod
    def config_from_gguf(cls, gguf) -> ModelConfig:
        config = gguf.llama_style(partial_rotary=True)
        rope = config.rope
        key = f"{gguf.arch}.rope.scaling."
        rope.attention_factor = file_float(gguf.path, key + "attn_factor", gguf.get("rope.scaling.attn_factor", 1.0))
        original = gguf.get("rope.scaling.original_context_length", config.max_position)
        rope.original_max_position = file_int(gguf.path, key + "original_context_length", original, 1, 1 << 40)
        return gguf.checked(config)
