"""GGUF tensor names -> Hugging Face ones: the one table every loader and family reads.

llama.cpp's converter renames a checkpoint's tensors; treadle's models are written against the
Hugging Face names, so a GGUF file's tensors are renamed back here. A family that names its layers
differently extends `LLAMA_LAYER_TENSORS` in its own `gguf_layer_tensors` (interface.CausalLM).
"""

from treadle.model.config import ModelLoadError

# llama.cpp's names of a Llama-style layer's tensors -> the Hugging Face ones (a family's
# `gguf_layer_tensors`, which may extend or change them).
LLAMA_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # mixture-of-experts layers (Mixtral's "llama" files, qwen2moe, qwen3moe, olmoe): the router, the
    # experts stacked [experts, rows, cols] (read by moe.MoE under these names), a shared expert
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}

# Rotary scaling factors a Phi-3 file carries as tensors -> RopeConfig's fields.
LONGROPE_TENSORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
# The tensors outside the layers.
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    # a reranker's head (llama.cpp's rank pooling): the rows of its classifier labels, in place of output.weight
    "cls.output.weight": "lm_head.weight",
    # Gemma 4's per-layer embeddings (the table, the embedding's projection and its norm)
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}


def hf_name(path: str, name: str, layer_tensors: dict[str, str]) -> str:
    """A GGUF tensor's Hugging Face name, under the family's layer table; unknown names are refused."""
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}"
    raise ModelLoadError(f"{path}: tensor {name}: unknown tensor for this architecture (unsupported feature)")
