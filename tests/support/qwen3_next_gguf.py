"""Qwen3-Next / Qwen3.5 / Qwen3.5-MoE transformers models written as GGUF files, exactly as llama.cpp's
converter writes them (convert_hf_to_gguf.py of llama-cpp-python 0.3.36's vendored llama.cpp,
`conversion/qwen.py`: Qwen3NextModel, Qwen3_5TextModel, Qwen3_5MoeTextModel; docs/design/qwen3_5.md §6).

What the converter does, and this module after it:
- architecture `qwen3next`, `qwen35` or `qwen35moe` from the model's class; `block_count` counts the
  MTP block, `attention.recurrent_layers` flags the Gated DeltaNet layers (False for the MTP layers),
  `ssm.*` the linear layers' sizes, `rope.dimension_count` the rotated part of each head,
  `rope.dimension_sections` (qwen35*: [11, 11, 10, 0] where the config names none),
  `feed_forward_length` only where config.json has `intermediate_size` (not Qwen3.5-MoE);
- every RMSNorm stored as 1 + w, but the linear layers' gated norm (`ssm_norm`); A as -exp(A_log);
  the conv kernel squeezed to [channels, K]; experts stacked [E, rows, cols];
- Qwen3-Next's interleaved `in_proj_qkvz` regrouped into `attn_qkv` ([q | k | v], every key group's
  rows together) and `attn_gate` (z), `in_proj_ba` kept as `ssm_ba`;
- qwen35 / qwen35moe: the value heads "tiled" (position i * nk + g holds grouped head g * r + i) in
  every per-value-head tensor: qkv's v rows, gate, beta, alpha, dt, A, the conv's v channels and
  ssm_out's columns (only where nk != nv);
- with `mtp`: an MTP block (`nextn_predict_layers`), layer L = num_hidden_layers as a full-attention
  layer plus `blk.L.nextn.{eh_proj,enorm,hnorm,shared_head_norm}`, from random weights under the
  checkpoint's `mtp.*` names (`mtp_weights`), so that a loader must skip it;
- `fuse_qkv` / `fuse_gate_up_exps`: the converter's --fuse-qkv (full-attention layers' q, k, v rows
  as one `attn_qkv.weight`) and --fuse-gate-up-exps (`ffn_gate_up_exps.weight` [E, 2F, H], gate rows
  first).

Float32 throughout (the converter's --outtype f32); `quantize` then stores the layers' matrices as
`llama-quantize --pure` would. Qwen3-Next's dense layers (`mlp_only_layers`, off `decoder_sparse_step`)
are written as `ffn_{gate,up,down}.weight`: llama.cpp's qwen3next has no such tensors, and its converter
fails on such a model ("Can not map tensor"); the released Qwen3-Next has none.

`add_mtp_weights` puts the same MTP weights into a saved Hugging Face folder, so that the real converter
(without --no-mtp) writes the same block.
"""

import os

import numpy as np
import torch
from tokenizers import Tokenizer

from tests.support.tiny_models import _GGUF_LAYER, _write_tokenizer

ARCHITECTURES = {
    "Qwen3NextForCausalLM": "qwen3next",
    "Qwen3_5ForCausalLM": "qwen35",
    "Qwen3_5MoeForCausalLM": "qwen35moe",
}
PRE_TOKENIZERS = {"qwen3next": "qwen2", "qwen35": "qwen35", "qwen35moe": "qwen35"}
QWEN35_MROPE_SECTION = [11, 11, 10, 0]  # what the converter writes where rope_parameters name none

# Hugging Face layer tensor -> GGUF name (after the converter's renames); the linear layers' projections
# that the converter regroups or splits are handled apart
_LAYER = {
    **_GGUF_LAYER,  # the attention, MLP and expert tensors as every Llama-style file names them
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    # the MTP block's own tensors, at layer L (the converter's names for mtp.fc, mtp.pre_fc_norm_*, mtp.norm)
    "eh_proj.weight": "nextn.eh_proj.weight",
    "enorm.weight": "nextn.enorm.weight",
    "hnorm.weight": "nextn.hnorm.weight",
    "shared_head.norm.weight": "nextn.shared_head_norm.weight",
}
_MTP_RENAMES = {  # the converter's renames of the MTP head's own tensors (_QwenMtpMixin.filter_tensors)
    "fc": "eh_proj",
    "pre_fc_norm_embedding": "enorm",
    "pre_fc_norm_hidden": "hnorm",
    "norm": "shared_head.norm",
}
# llama-quantize's fallbacks for a row width that is not a whole number of the type's blocks
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def gguf_architecture(model) -> str:
    """`qwen3next`, `qwen35` or `qwen35moe`, as the converter picks it from the model's class."""
    arch = type(model).__name__
    if arch not in ARCHITECTURES:
        raise ValueError(f"{arch}: not a Qwen3-Next / Qwen3.5 causal LM")
    return ARCHITECTURES[arch]


def _hparams(model) -> dict:
    """The config as config.json holds it (the converter reads that file: no deleted keys)."""
    return model.config.to_dict()


def mtp_layer_count(model) -> int:
    """The MTP layers the converter expects: the config's `mtp_num_hidden_layers` (Qwen3.5's real
    configs have 1), else 1 (Qwen3-Next's count comes from the checkpoint: this module writes one)."""
    return _hparams(model).get("mtp_num_hidden_layers") or 1


def mtp_weights(model, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random MTP head under the checkpoint's names, float32: `mtp.fc.weight` [H, 2H], its norms
    (`mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.norm`) and `mtp.layers.i.*`, each a
    full-attention decoder layer with the model's feed-forward (experts, per expert, where it has them)."""
    hp = _hparams(model)
    h, heads, kv_heads = hp["hidden_size"], hp["num_attention_heads"], hp["num_key_value_heads"]
    hd = hp.get("head_dim") or h // heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.1):
        return torch.randn(*shape, generator=g, dtype=torch.float32) * scale

    out = {
        "mtp.fc.weight": rand(h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": rand(h, scale=0.2),
        "mtp.pre_fc_norm_hidden.weight": rand(h, scale=0.2),
        "mtp.norm.weight": rand(h, scale=0.2),
    }
    for i in range(mtp_layer_count(model)):
        p = f"mtp.layers.{i}."
        out.update({
            p + "input_layernorm.weight": rand(h, scale=0.2),
            p + "post_attention_layernorm.weight": rand(h, scale=0.2),
            p + "self_attn.q_proj.weight": rand(2 * heads * hd, h),
            p + "self_attn.k_proj.weight": rand(kv_heads * hd, h),
            p + "self_attn.v_proj.weight": rand(kv_heads * hd, h),
            p + "self_attn.o_proj.weight": rand(h, heads * hd),
            p + "self_attn.q_norm.weight": rand(hd, scale=0.2),
            p + "self_attn.k_norm.weight": rand(hd, scale=0.2),
        })  # fmt: skip
        if hp.get("num_experts"):
            f, shared = hp["moe_intermediate_size"], hp["shared_expert_intermediate_size"]
            out[p + "mlp.gate.weight"] = rand(hp["num_experts"], h)
            for e in range(hp["num_experts"]):
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = rand(f, h)
                out[p + f"mlp.experts.{e}.up_proj.weight"] = rand(f, h)
                out[p + f"mlp.experts.{e}.down_proj.weight"] = rand(h, f)
            out[p + "mlp.shared_expert.gate_proj.weight"] = rand(shared, h)
            out[p + "mlp.shared_expert.up_proj.weight"] = rand(shared, h)
            out[p + "mlp.shared_expert.down_proj.weight"] = rand(h, shared)
            out[p + "mlp.shared_expert_gate.weight"] = rand(1, h)
        else:
            size = hp["intermediate_size"]
            out[p + "mlp.gate_proj.weight"] = rand(size, h)
            out[p + "mlp.up_proj.weight"] = rand(size, h)
            out[p + "mlp.down_proj.weight"] = rand(h, size)
    return out


def add_mtp_weights(folder: str, model, seed: int = 0) -> None:
    """Add `mtp_weights(model, seed)` to a folder saved by `save_pretrained` (one model.safetensors),
    as the released checkpoints carry them, so that llama.cpp's converter keeps an MTP block."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    state.update(mtp_weights(model, seed))
    save_file(state, path, metadata={"format": "pt"})


def _hf_tensors(model, mtp: bool, mtp_seed: int) -> dict[str, torch.Tensor]:
    """The model's tensors as the converter sees them after its filter: float32, experts stacked
    per layer and kind ([E, rows, cols], as `Qwen2MoeModel.modify_tensors` stacks them), the MTP head
    renamed to layer-indexed names (`mtp.layers.i.` -> `model.layers.{L + i}.`, `mtp.fc` ->
    `model.layers.L.eh_proj`, ...); no lm_head where the embedding is tied."""
    layers = _hparams(model)["num_hidden_layers"]
    state = {k: v.detach().float() for k, v in model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if mtp:
        for name, tensor in mtp_weights(model, mtp_seed).items():
            parts = name.split(".", 3)
            if parts[1] == "layers":
                state[f"model.layers.{layers + int(parts[2])}.{parts[3]}"] = tensor
            else:
                state[f"model.layers.{layers}.{_MTP_RENAMES[parts[1]]}.{parts[2]}"] = tensor
    out, stacks = {}, {}
    for name, tensor in state.items():
        parts = name.split(".")
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers' in-memory form: [E, 2F, H], gate rows first
            gate, up = tensor.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        elif len(parts) == 8 and parts[3:5] == ["mlp", "experts"]:  # model.layers.N.mlp.experts.E.kind.weight
            stacks.setdefault(f"model.layers.{parts[2]}.mlp.experts.{parts[6]}", {})[int(parts[5])] = tensor
        else:
            out[name] = tensor
    for name, experts in stacks.items():
        out[name] = torch.stack([experts[e] for e in sorted(experts)])
    return out


def _tiled(t: torch.Tensor, dim: int, nk: int, r: int, width: int) -> torch.Tensor:
    """Value heads from grouped order (g * r + i) to tiled (i * nk + g) along `dim`, each head `width`
    wide (`_LinearAttentionVReorderBase._reorder_v_heads`)."""
    shape = list(t.shape)
    dim %= len(shape)
    t = t.reshape(*shape[:dim], nk, r, width, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def _converted(model, arch: str, mtp: bool, mtp_seed: int) -> dict[str, torch.Tensor]:
    """GGUF name -> float32 tensor, in the converter's layouts (no fusions yet)."""
    hp = _hparams(model)
    nk, nv = hp["linear_num_key_heads"], hp["linear_num_value_heads"]
    dk, dv = hp["linear_key_head_dim"], hp["linear_value_head_dim"]
    r, key_dim = nv // nk, nk * dk
    tile = arch in ("qwen35", "qwen35moe") and nk != nv
    out = {}
    for name, t in _hf_tensors(model, mtp, mtp_seed).items():
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = t
            continue
        if name == "model.norm.weight":
            out["output_norm.weight"] = t + 1
            continue
        if name == "lm_head.weight":
            out["output.weight"] = t
            continue
        _, _, layer, rest = name.split(".", 3)
        b = f"blk.{layer}."
        if rest.endswith("norm.weight") and rest != "linear_attn.norm.weight":
            t = t + 1  # (1 + w) norms stored as 1 + w
        if rest == "linear_attn.in_proj_qkvz.weight":  # [nk, (q dk | k dk | v r dv | z r dv)] -> [q | k | v], z
            q, k, v, z = t.reshape(nk, -1, t.shape[1]).split([dk, dk, r * dv, r * dv], dim=1)
            out[b + "attn_qkv.weight"] = torch.cat([x.reshape(-1, t.shape[1]) for x in (q, k, v)])
            out[b + "attn_gate.weight"] = z.reshape(-1, t.shape[1]).contiguous()
            continue
        if rest == "linear_attn.A_log":
            t = -torch.exp(t)
        elif rest == "linear_attn.conv1d.weight":
            t = t.squeeze()
        if tile and rest.startswith("linear_attn."):
            kind = rest.removeprefix("linear_attn.")
            if kind in ("in_proj_qkv.weight", "conv1d.weight"):  # the v rows / channels after q and k
                t = torch.cat([t[: 2 * key_dim], _tiled(t[2 * key_dim :], 0, nk, r, dv)])
            elif kind == "in_proj_z.weight":
                t = _tiled(t, 0, nk, r, dv)
            elif kind in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
                t = _tiled(t, 0, nk, r, 1)
            elif kind == "out_proj.weight":
                t = _tiled(t, 1, nk, r, dv)
        out[b + _LAYER[rest]] = t
    return out


def _fused(tensors: dict[str, torch.Tensor], fuse_qkv: bool, fuse_gate_up_exps: bool) -> dict[str, torch.Tensor]:
    """The converter's --fuse-qkv (a layer with q, k and v: their rows as one attn_qkv) and
    --fuse-gate-up-exps (gate_exps then up_exps along the rows)."""
    out = {}
    for name, t in tensors.items():
        b, _, kind = name.rpartition(".weight")[0].rpartition(".")
        if fuse_qkv and kind == "attn_q":
            t = torch.cat([t, tensors[f"{b}.attn_k.weight"], tensors[f"{b}.attn_v.weight"]])
            name = f"{b}.attn_qkv.weight"
        elif fuse_qkv and kind in ("attn_k", "attn_v"):
            continue
        elif fuse_gate_up_exps and kind == "ffn_gate_exps":
            t = torch.cat([t, tensors[f"{b}.ffn_up_exps.weight"]], dim=1)
            name = f"{b}.ffn_gate_up_exps.weight"
        elif fuse_gate_up_exps and kind == "ffn_up_exps":
            continue
        out[name] = t
    return out


def _ggml_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims: the dimensions up to the last one above 1, in ggml's (reversed) order."""
    ne = list(reversed(shape))
    return max([i + 1 for i, n in enumerate(ne) if n > 1], default=1)


def quantized_type(name: str, shape: tuple[int, ...], qtype):
    """The type `llama-quantize --pure` gives this layer tensor, or None where it stays float32:
    matrices and expert stacks (ggml dims >= 2) named `*weight`, but norms, routers (ffn_gate_inp)
    and conv kernels; a row width not a whole number of blocks takes llama-quantize's fallback
    (Q4_K -> Q5_0, Q6_K -> Q8_0, ...), F16 where that does not fit either."""
    import gguf

    if not name.startswith("blk.") or _ggml_dims(shape) < 2 or not name.endswith("weight"):
        return None
    if "_norm.weight" in name or "ffn_gate_inp.weight" in name or "ssm_conv1d" in name:
        return None
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block:
        fallback = _FALLBACK.get(qtype.name)
        qtype = gguf.GGMLQuantizationType[fallback] if fallback else qtype
        if shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            qtype = gguf.GGMLQuantizationType.F16
    return qtype


def _quantized(data: np.ndarray, qtype) -> np.ndarray:
    import gguf

    if qtype == gguf.GGMLQuantizationType.Q4_K:  # gguf-py has no K-quant quantizer: treadle's (valid blocks)
        from treadle.model.loading.quantize import quantize_q4_k

        return quantize_q4_k(data.reshape(-1, data.shape[-1])).reshape(*data.shape[:-1], -1)
    return gguf.quants.quantize(data, qtype)


def _file_type(qtype):
    import gguf

    if qtype is None:
        return gguf.LlamaFileType.ALL_F32
    names = gguf.LlamaFileType.__members__
    return names.get(f"MOSTLY_{qtype.name}") or names[f"MOSTLY_{qtype.name}_M"]


def write_gated_deltanet_gguf(
    path: str,
    model,
    tok: Tokenizer,
    *,
    mtp: bool = True,
    quantize=None,
    fuse_qkv: bool = False,
    fuse_gate_up_exps: bool = False,
    mtp_seed: int = 0,
) -> None:
    """Write `model` (Qwen3NextForCausalLM, Qwen3_5ForCausalLM or Qwen3_5MoeForCausalLM) as llama.cpp's
    converter does with --outtype f32 (see the module's docstring), the tokenizer by `_write_tokenizer`
    (pre-tokenizer "qwen2" for qwen3next, "qwen35" otherwise).

    mtp: an MTP block (layer L = num_hidden_layers and `blk.L.nextn.*`, random weights, `mtp_weights(model,
      mtp_seed)`) and `nextn_predict_layers`, as the converter keeps it by default; else as with --no-mtp.
    quantize: a GGMLQuantizationType: the layers' matrices in that type, as `llama-quantize --pure` would
      (`quantized_type`), every tensor's shape as it writes them (ffn_gate_inp_shexp [H], not [1, H]);
      unlike llama-quantize, the embedding and output head stay float32, as do norms, routers and conv
      kernels.
    fuse_qkv, fuse_gate_up_exps: the converter's --fuse-qkv and --fuse-gate-up-exps."""
    import gguf

    arch = gguf_architecture(model)
    hp = _hparams(model)
    layers = hp["num_hidden_layers"]
    n_mtp = mtp_layer_count(model) if mtp else 0
    blocks = layers + n_mtp
    rope = dict(hp.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"rope_type {rope['rope_type']!r}: only the default RoPE is written")
    head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]

    w = gguf.GGUFWriter(path, arch)
    # TextModel.set_gguf_parameters
    w.add_block_count(blocks)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    if hp.get("intermediate_size") is not None:  # not Qwen3.5-MoE's (its config has none)
        w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    if "mrope_section" in rope:
        w.add_rope_dimension_sections((list(rope["mrope_section"]) + [0, 0, 0, 0])[:4])
    elif arch in ("qwen35", "qwen35moe"):  # _Qwen35MRopeMixin: llama.cpp requires the key
        w.add_rope_dimension_sections(QWEN35_MROPE_SECTION)
    w.add_rope_freq_base(rope.get("rope_theta", hp.get("rope_theta")))
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("num_experts"):
        w.add_expert_count(hp["num_experts"])
        w.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("head_dim") is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(_file_type(quantize))
    # Qwen2MoeModel
    if hp.get("moe_intermediate_size") is not None:
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if hp.get("shared_expert_intermediate_size") is not None:
        w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    # _QwenMtpMixin
    if n_mtp:
        w.add_nextn_predict_layers(n_mtp)
    # Qwen3NextModel
    w.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    w.add_ssm_state_size(hp["linear_key_head_dim"])
    w.add_ssm_group_count(hp["linear_num_key_heads"])
    w.add_ssm_time_step_rank(hp["linear_num_value_heads"])
    w.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
    if hp.get("layer_types") is not None:
        recurrent = [t == "linear_attention" for t in hp["layer_types"]] + [False] * n_mtp
        w.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    w.add_full_attention_interval(hp.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _write_tokenizer(w, tok, pre=PRE_TOKENIZERS[arch])

    tensors = _fused(_converted(model, arch, mtp, mtp_seed), fuse_qkv, fuse_gate_up_exps)
    for name, t in tensors.items():
        data = np.ascontiguousarray(t.numpy(), dtype=np.float32)
        if quantize is not None:  # llama-quantize writes ggml's dims: leading 1s dropped (ffn_gate_inp_shexp: [H])
            data = data.reshape(data.shape[data.ndim - _ggml_dims(data.shape) :])
        qtype = quantized_type(name, data.shape, quantize) if quantize is not None else None
        if qtype is None:
            w.add_tensor(name, data)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, _quantized(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
