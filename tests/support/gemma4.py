"""Tiny random Gemma 4 models: a Hugging Face folder (Gemma4ForCausalLM, as transformers saves it:
`per_layer_config`) with everything Gemma 4 adds switched on, and the GGUF file llama.cpp's converter
writes from it (convert_hf_to_gguf.py of llama-cpp-python 0.3.36's vendored llama.cpp,
`conversion/gemma.py`: Gemma4Model).

The model: six layers, local (a 12-token window, heads of 16) and global (heads of 32, one KV head,
`attention_k_eq_v`, proportional RoPE turning a quarter of the head) as [L, L, G, L, L, G]; the last
two layers share KV (layer 4 reads layer 3's, layer 5 layer 2's) and their MLP is double-wide;
per-layer embeddings of 8; four experts (top 2) beside every MLP; final logits soft-capped. Norm
weights, layer scalars and the router's scales are drawn away from 1 so each matters.

What the converter writes, and `write_gemma4_gguf` after it: architecture `gemma4`; key_length /
value_length the global head size and *_swa the local one; head_count_kv per layer where the
global layers' count differs; `attention.sliding_window_pattern` one bool per layer;
`attention.shared_kv_layers`; `embedding_length_per_layer_input`; feed_forward_length per layer
with double-wide layers; `expert_feed_forward_length`; rope.dimension_count the global head and
rope.dimension_count_swa the local one; `rope_freqs` (1 for a turning frequency, 1e30 for the rest)
for the global layers; norms as they are (Gemma 4's multiply: no 1 + w); the experts' fused
`ffn_gate_up_exps` [E, 2F, H]; router.proj as ffn_gate_inp.weight, router.scale as ffn_gate_inp.scale,
per_expert_scale as ffn_down_exps.scale; layer_scalar as layer_output_scale.weight; PLE tensors as
per_layer_token_embd / per_layer_model_proj / per_layer_proj_norm and blk.N.{inp_gate, proj, post_norm}.
"""

import json
import os

import numpy as np
import torch

from tests.support.tiny_models import _GGUF_LAYER, _write_tokenizer, save_folder, tiny_tokenizer

TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2


def hf_config(vocab_size: int, **overrides):
    from transformers import Gemma4TextConfig

    fields = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=12, layer_types=list(TYPES), num_kv_shared_layers=2, use_double_wide_mlp=True,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab_size, enable_moe_block=True, num_experts=4,
        top_k_experts=2, moe_intermediate_size=32, final_logit_softcapping=30.0, max_position_embeddings=256,
        rms_norm_eps=1e-6, initializer_range=0.08, eos_token_id=vocab_size - 1, bos_token_id=None, pad_token_id=None,
        tie_word_embeddings=True,
    )  # fmt: skip
    fields.update(overrides)
    return Gemma4TextConfig(**fields)


def save_gemma4(folder: str, seed: int = 0, **overrides):
    """A random Gemma4ForCausalLM and tokenizer files in `folder`; returns the transformers model
    (float32, eager attention, eval)."""
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    config = hf_config(tok.get_vocab_size(), **overrides)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.normal_(1.0, 0.3)
            elif name.endswith(("router.scale", "per_expert_scale")):
                param.uniform_(0.5, 1.5)
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.6, 1.4)
    save_folder(folder, model, tok)
    return model


def published_form(folder: str) -> None:
    """config.json rewritten as the published checkpoints carry it: `global_head_dim` and
    `num_global_key_value_heads`, no `per_layer_config`."""
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    per_layer = config.pop("per_layer_config")
    full = next(v for k, v in per_layer.items() if config["layer_types"][int(k)] == "full_attention")
    config["global_head_dim"] = full["head_dim"]
    if "num_key_value_heads" in full:
        config["num_global_key_value_heads"] = full["num_key_value_heads"]
    json.dump(config, open(path, "w"))


_LAYER = {
    **_GGUF_LAYER,  # the attention and MLP tensors as every Llama-style file names them
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
    "layer_scalar": "layer_output_scale.weight",
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}


def write_gemma4_gguf(path: str, model, quantize: str | None = None) -> None:
    """`model` (save_gemma4's) as llama.cpp's converter writes it, float32 (--outtype f32); `quantize`:
    the layers' matrices then stored as that type (a whole-block row width), as llama-quantize --pure."""
    from types import SimpleNamespace

    import gguf

    cfg = SimpleNamespace(**model.config.to_dict())  # (per-layer attributes are not read off the config)
    n = cfg.num_hidden_layers
    swa = [t == "sliding_attention" for t in cfg.layer_types]
    per_layer = {int(k): v for k, v in cfg.per_layer_config.items()}
    full = SimpleNamespace(**{"num_key_value_heads": cfg.num_key_value_heads, **per_layer[swa.index(False)]})
    w = gguf.GGUFWriter(path, "gemma4")
    w.add_block_count(n)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    first_shared = n - cfg.num_kv_shared_layers
    if cfg.use_double_wide_mlp:
        w.add_feed_forward_length([cfg.intermediate_size * (2 if i >= first_shared else 1) for i in range(n)])
    else:
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(full.head_dim)
    w.add_value_length(full.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)
    if full.num_key_value_heads != cfg.num_key_value_heads:
        w.add_head_count_kv([cfg.num_key_value_heads if s else full.num_key_value_heads for s in swa])
    else:
        w.add_head_count_kv(cfg.num_key_value_heads)
    if cfg.enable_moe_block:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.top_k_experts)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_shared_kv_layers(cfg.num_kv_shared_layers)
    w.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input or 0)
    w.add_sliding_window_pattern(swa)
    w.add_key_length_swa(cfg.head_dim)
    w.add_value_length_swa(cfg.head_dim)
    w.add_rope_dimension_count(full.head_dim)
    w.add_rope_dimension_count_swa(cfg.head_dim)
    _write_tokenizer(w, tiny_tokenizer(), pre="default")
    partial = cfg.rope_parameters["full_attention"]["partial_rotary_factor"]
    turning = int(full.head_dim * partial / 2)
    freqs = np.array([1.0] * turning + [1e30] * (full.head_dim // 2 - turning), dtype=np.float32)
    w.add_tensor("rope_freqs.weight", freqs)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = t.float().numpy()
        if name in _GLOBAL:
            w.add_tensor(_GLOBAL[name], data)
            continue
        _, _, index, rest = name.split(".", 3)
        gname = f"blk.{index}.{_LAYER[rest]}"
        if rest == "layer_scalar":
            data = data.reshape(1)
        kind = None
        if quantize and data.ndim >= 2 and rest not in ("router.proj.weight",) and data.shape[-1] % 32 == 0:
            kind = getattr(gguf.GGMLQuantizationType, quantize)
            data = gguf.quants.quantize(data, kind)
        w.add_tensor(gname, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
