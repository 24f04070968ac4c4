"""Tiny random gpt-oss models: a Hugging Face folder whose experts ship as MXFP4 blocks and scales (as the
published checkpoints do), and the GGUF file llama.cpp's converter writes from it (convert_hf_to_gguf.py of
llama-cpp-python 0.3.36's vendored llama.cpp, `conversion/gpt_oss.py`: the experts repacked to GGUF MXFP4
blocks, never widened; gate and up split; `attn_sinks`, biases as `*.bias`).

Checked against the real converter (--outtype f32) on this module's folder: every tensor the same
(name, type, shape, bytes) and every metadata key the same value, apart from the converter's naming keys
(general.name, size_label, type), `add_bos_token` and the tensors' order.

The transformers model returned holds the experts' dequantized MXFP4 values, so it is the reference for
both files. Sinks are large and the experts' weights wide enough that the SwiGLU clamp (7) is hit.
"""

import json
import os

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.support.tiny_models import CHATML, _write_tokenizer, tiny_tokenizer

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., cols] float -> (blocks uint8 [..., cols / 32, 16], scales uint8 [..., cols / 32], the values
    they hold [..., cols]) in the Hugging Face layout: byte i of a block holds value 2i in its low
    nibble and 2i + 1 in its high one (transformers' `convert_moe_packed_tensors`), E8M0 scales."""
    g = w.float().reshape(*w.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(g.abs().amax(-1).clamp_min(1e-20) / 6)).clamp(-100, 100)
    x = g / torch.exp2(exponent)[..., None]
    index = (x.abs()[..., None] - FP4).abs().argmin(-1)
    code = (index + 8 * ((x < 0) & (index > 0))).to(torch.uint8)
    values = FP4[index] * torch.where(x < 0, -1.0, 1.0) * torch.exp2(exponent)[..., None]
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8), values.reshape(w.shape)


def hf_config(vocab_size: int, **overrides):
    from transformers import GptOssConfig

    fields = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=12,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        eos_token_id=vocab_size - 1,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 32,
        },
    )  # fmt: skip
    fields.update(overrides)
    return GptOssConfig(**fields)


def save_gpt_oss(folder: str, seed: int = 0, mxfp4: bool = True, **overrides):
    """A random GptOssForCausalLM and tokenizer files in `folder`; returns the transformers model (float32,
    eager attention, eval) whose experts hold what the folder's MXFP4 blocks hold. mxfp4=False: the
    folder as transformers saves it (dense experts, [E, H, 2F] with gate and up columns interleaved)."""
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(tok.get_vocab_size(), **overrides), dtype=torch.float32)
    model.eval()
    blocks = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.sinks.normal_(0.0, 2.0)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.normal_(1.0, 0.2)
            experts = layer.mlp.experts
            experts.gate_up_proj.normal_(0.0, 0.6)  # gate and up often past the clamp
            experts.down_proj.normal_(0.0, 0.15)
            for bias in (experts.gate_up_proj_bias, experts.down_proj_bias, layer.mlp.router.bias):
                bias.normal_(0.0, 0.5)
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(experts, name)  # [E, in, out]: MXFP4 holds [E, out, in]
                b, s, values = to_mxfp4(param.transpose(1, 2))
                param.copy_(values.transpose(1, 2))
                blocks[f"model.layers.{i}.mlp.experts.{name}_blocks"] = b.contiguous()
                blocks[f"model.layers.{i}.mlp.experts.{name}_scales"] = s.contiguous()
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    if mxfp4:
        path = os.path.join(folder, "model.safetensors")
        tensors = {k: v for k, v in load_file(path).items() if not k.endswith(("gate_up_proj", "down_proj"))}
        save_file({**tensors, **blocks}, path, metadata={"format": "pt"})
        config = json.load(open(os.path.join(folder, "config.json")))
        config["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                       "lm_head"],
        }  # fmt: skip
        json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "chat_template": CHATML}, f)
    model.mxfp4_blocks = blocks
    return model


def gguf_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """The converter's `repack_mxfp4`: HF blocks [E, rows, G, 16] and scales [E, rows, G] -> GGUF MXFP4
    bytes [E, rows, G * 17] (each block's E8M0 scale, then value j in byte j's low nibble and value
    j + 16 in its high one), written independently of treadle's own repacking."""
    lo, hi = blocks & 0x0F, blocks >> 4
    values = torch.stack([lo, hi], dim=-1).reshape(*blocks.shape[:-1], 32)  # the block's 32 codes in order
    qs = values[..., :16] | (values[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), qs], dim=-1).reshape(*blocks.shape[:2], -1).numpy()


def write_gpt_oss_gguf(path: str, model) -> None:
    """`model` (save_gpt_oss's) as llama.cpp's converter writes it, float32 apart from the MXFP4 experts."""
    import gguf

    cfg = model.config
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _write_tokenizer(w, tiny_tokenizer(), pre="gpt-4o")

    state = model.state_dict()
    f32 = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}  # fmt: skip
    for name, key in f32.items():
        w.add_tensor(name, state[key].numpy())
    layer_names = {
        "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
        "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
        "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp.weight": "mlp.router.weight",
        "ffn_gate_inp.bias": "mlp.router.bias",
    }  # fmt: skip
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, key in layer_names.items():
            w.add_tensor(f"blk.{i}.{name}", state[p + key].numpy())
        gate_up_bias = state[p + "mlp.experts.gate_up_proj_bias"]
        w.add_tensor(f"blk.{i}.ffn_gate_exps.bias", gate_up_bias[:, 0::2].contiguous().numpy())
        w.add_tensor(f"blk.{i}.ffn_up_exps.bias", gate_up_bias[:, 1::2].contiguous().numpy())
        w.add_tensor(f"blk.{i}.ffn_down_exps.bias", state[p + "mlp.experts.down_proj_bias"].numpy())
        blocks = {k.removeprefix(p + "mlp.experts."): v for k, v in model.mxfp4_blocks.items() if k.startswith(p)}
        mxfp4 = gguf.GGMLQuantizationType.MXFP4
        parts = {
            "ffn_gate_exps": (blocks["gate_up_proj_blocks"][:, 0::2], blocks["gate_up_proj_scales"][:, 0::2]),
            "ffn_up_exps": (blocks["gate_up_proj_blocks"][:, 1::2], blocks["gate_up_proj_scales"][:, 1::2]),
            "ffn_down_exps": (blocks["down_proj_blocks"], blocks["down_proj_scales"]),
        }
        for name, (b, s) in parts.items():
            w.add_tensor(f"blk.{i}.{name}.weight", gguf_mxfp4(b, s), raw_dtype=mxfp4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
