"""gpt-oss (OpenAI's open-weight MoE): a Llama-style decoder with these changes.

- attention sinks: one learned logit per query head joins each softmax's denominator (and nothing
  else), in treadle's kernel and the SDPA fallback alike (attention.py); q, k, v and o have biases;
- layers alternate: even layers attend within a 128-token sliding window, odd ones to everything
  (two cache groups, kv_layout.py); one RoPE (NEOX halves, YaRN) for both;
- every feed-forward is a mixture of experts (moe.py) whose router has a bias and whose weights are
  the softmax of the top-k scores alone; each expert has biases and a clamped SwiGLU
  ((up + 1) * gate * sigmoid(1.702 gate), gate <= 7, |up| <= 7);
- the experts ship as MXFP4 (4-bit E2M1 values, one E8M0 scale per 32): a Hugging Face folder's
  `*_blocks` / `*_scales` are repacked, without widening, into the GGUF MXFP4 blocks that llama.cpp's
  converter writes (`quant.mxfp4_from_hf`), and multiplied by the quantized-weights kernels.

YaRN: the checkpoints say `truncate: false` (the ramp's bounds are not rounded), which a GGUF file
does not record and llama.cpp does not apply (it truncates); treadle applies YaRN as the model was
trained, untruncated, from either source.

The model's weights are taken under these names whatever the source (an HF folder's are renamed
first, `_experts_from_hf`): `mlp.router.{weight,bias}`, the experts stacked as
`mlp.experts.{gate,up,down}_proj` ([experts, rows, cols], rows the outputs) and their biases
`mlp.experts.{gate,up,down}_proj_bias` ([experts, rows]), `self_attn.sinks`.
"""

from dataclasses import dataclass

import torch

from treadle.model.config import ModelConfig, ModelLoadError, MoEConfig, file_float
from treadle.model.families.gemma3 import layer_windows
from treadle.model.families.llama import DecoderLayer, LayerWeights, LlamaModel, expected_shapes
from treadle.model.kernels.quant import QuantizedTensor, mxfp4_from_hf
from treadle.model.layers.attention import paged_attention
from treadle.model.layers.moe import ExpertWeights
from treadle.model.layers.rotary import apply_rotary
from treadle.model.loading.gguf_names import LLAMA_LAYER_TENSORS

SLIDING_WINDOW_PATTERN = 2  # layers 0, 2, ... local: transformers' default layer_types, llama.cpp's swa pattern
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # transformers' defaults; llama.cpp's fixed values
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


@dataclass
class GptOssConfig(ModelConfig):
    pass


class GptOssLayer(DecoderLayer):
    moe_names = dict(router="mlp.router.weight", experts="mlp.experts", names=EXPERT_NAMES)

    def __init__(self, config: ModelConfig, lw: LayerWeights):
        super().__init__(config, lw)
        self.o_proj.bias = lw.take("self_attn.o_proj.bias")
        sinks = lw.take_float("self_attn.sinks")
        if sinks.shape != (config.num_heads,):
            raise ModelLoadError(
                f"weight {lw.prefix}self_attn.sinks: shape {tuple(sinks.shape)}, expected ({config.num_heads},)"
            )
        self.sinks = sinks.contiguous()


class GptOssModel(LlamaModel):
    hf_model_types = ("gpt_oss",)
    hf_architectures = ("GptOssForCausalLM",)
    gguf_architectures = ("gpt-oss",)

    layer_class = GptOssLayer
    gguf_permuted_qk = False
    decoder_kernel = False  # sinks and experts: the layers stay in Python (their products are the kernels')
    gguf_layer_tensors = {
        **LLAMA_LAYER_TENSORS,
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_output.bias": "self_attn.o_proj.bias",
        "attn_sinks.weight": "self_attn.sinks",
        "ffn_gate_inp.weight": "mlp.router.weight",
        "ffn_gate_inp.bias": "mlp.router.bias",
        "ffn_gate_exps.weight": "mlp.experts.gate_proj",
        "ffn_up_exps.weight": "mlp.experts.up_proj",
        "ffn_down_exps.weight": "mlp.experts.down_proj",
        "ffn_gate_exps.bias": "mlp.experts.gate_proj_bias",
        "ffn_up_exps.bias": "mlp.experts.up_proj_bias",
        "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
    }

    # ---------------------------------------------------------------- reading its files

    @classmethod
    def config_from_hf(cls, hf) -> GptOssConfig:
        quant = hf.section("quantization_config")
        if quant and quant.get("quant_method") != "mxfp4":
            raise ModelLoadError(
                f"{hf.where}: quantization_config quant_method = {quant.get('quant_method')!r}: "
                "unsupported for gpt-oss (supported: mxfp4, or none)"
            )
        num_layers = hf.int("num_hidden_layers", "num_layers")
        types = hf.get("layer_types")
        if types is not None and (
            not isinstance(types, list)
            or len(types) != num_layers
            or not all(t in ("sliding_attention", "full_attention") for t in types)
        ):
            raise ModelLoadError(
                f"{hf.where}: layer_types: expected {num_layers} of 'sliding_attention' / 'full_attention'"
            )
        window = hf.get("sliding_window", 128) or None
        moe = MoEConfig(
            num_experts=hf.get("num_local_experts", hf.get("num_experts")),
            top_k=hf.need("num_experts_per_tok"),
            expert_size=hf.need("intermediate_size"),
            biases=True,
            softmax_after_topk=True,
            swiglu_limit=hf.get("swiglu_limit", SWIGLU_LIMIT),
            swiglu_alpha=hf.get("swiglu_alpha", SWIGLU_ALPHA),
        )
        params = hf.section("rope_parameters") or hf.section("rope_scaling")
        if not params:  # transformers' default for the family
            params = dict(DEFAULT_ROPE, rope_theta=hf.get("rope_theta", 150000.0))
        config = hf.llama_style(
            GptOssConfig,
            head_dim=hf.get("head_dim", 64),
            attention_bias=True,
            rope=hf.rope(params, default_theta=150000.0),
            layer_windows=layer_windows(num_layers, window, SLIDING_WINDOW_PATTERN, types) if window else None,
            sliding_window=None,
            moe=moe,
        )
        return cls._checked(hf.where, hf.checked(config))

    @classmethod
    def config_from_gguf(cls, gguf) -> GptOssConfig:
        window = gguf.get("attention.sliding_window") or None
        num_layers = gguf.get("block_count", required=True)
        pattern = gguf.get("attention.sliding_window_pattern", SLIDING_WINDOW_PATTERN)
        moe = gguf.moe(norm_topk=False)
        if moe is None:
            raise gguf.fail("expert_count", "missing: gpt-oss's feed-forward is a mixture of experts")
        moe.biases = moe.softmax_after_topk = True
        moe.swiglu_limit, moe.swiglu_alpha = SWIGLU_LIMIT, SWIGLU_ALPHA
        config = gguf.llama_style(
            GptOssConfig,
            intermediate_size=moe.expert_size,
            attention_bias=True,
            layer_windows=layer_windows(num_layers, window, pattern)
            if window and isinstance(num_layers, int) and isinstance(pattern, int)
            else None,
            sliding_window=None,
            moe=moe,
        )
        # a gpt-oss file does not record YaRN's truncate: false; the model was trained without it
        config.rope.truncate = False
        return cls._checked(gguf.path, gguf.checked(config))

    @staticmethod
    def _checked(where: str, config: GptOssConfig) -> GptOssConfig:
        moe = config.moe
        moe.swiglu_limit = file_float(where, "swiglu_limit", moe.swiglu_limit)
        moe.swiglu_alpha = file_float(where, "swiglu_alpha", moe.swiglu_alpha)
        if not moe.swiglu_limit > 0:
            raise ModelLoadError(f"{where}: swiglu_limit = {moe.swiglu_limit}: expected a positive number")
        return config

    # ---------------------------------------------------------------- the model

    @staticmethod
    def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = expected_shapes(config)
        h = config.hidden_size
        f, n = config.moe.expert_size, config.moe.num_experts
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
                shapes.pop(p + name, None)
            shapes.update(
                {
                    p + "self_attn.o_proj.bias": (h,), p + "self_attn.sinks": (config.num_heads,),
                    p + "mlp.router.weight": (n, h), p + "mlp.router.bias": (n,),
                    p + "mlp.experts.gate_proj": (n, f, h), p + "mlp.experts.up_proj": (n, f, h),
                    p + "mlp.experts.down_proj": (n, h, f),
                    p + "mlp.experts.gate_proj_bias": (n, f), p + "mlp.experts.up_proj_bias": (n, f),
                    p + "mlp.experts.down_proj_bias": (n, h),
                }
            )  # fmt: skip
        return shapes

    def __init__(
        self, config: GptOssConfig, weights: dict, dtype: torch.dtype, device="cpu", batch_invariant: bool = False
    ):
        for i in range(config.num_layers):
            _experts_from_hf(weights, f"model.layers.{i}.mlp.experts.", config.hidden_size)
        super().__init__(config, weights, dtype, device, batch_invariant)

    def tensors(self) -> list[torch.Tensor]:
        return super().tensors() + [layer.sinks for layer in self.layers]

    def attention(self, layer, x: torch.Tensor, tables, kv, layer_meta) -> torch.Tensor:
        cfg = self.config
        heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
        t = x.shape[0]
        qk, v = layer.qkv(x).split_with_sizes([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = apply_rotary(qk.reshape(t, heads + kv_heads, cfg.head_dim), *tables)
        q, k = qk.split_with_sizes([heads, kv_heads], dim=1)
        attn = paged_attention(
            q, k, v.reshape(t, kv_heads, cfg.head_dim), kv[0], kv[1], layer_meta, self.scale, sinks=layer.sinks
        )
        return layer.o_proj(attn.view(t, self.q_size))


# transformers' GptOssConfig default (the published checkpoints carry the same in rope_scaling)
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _experts_from_hf(w: dict, prefix: str, hidden: int) -> None:
    """A Hugging Face folder's experts of one layer, renamed in `w` to the stacked per-matrix form the
    model takes (a GGUF file's is that already). Two forms:
    - MXFP4 (as published): `gate_up_proj_blocks` [E, 2F, H/32, 16] and `_scales` [E, 2F, H/32],
      gate and up rows interleaved; `down_proj_blocks` / `_scales` [E, H, F/32, ...]. Repacked to
      GGUF MXFP4 blocks, the same bits (llama.cpp's converter does the same).
    - dense (a folder transformers saved): `gate_up_proj` [E, H, 2F], gate and up columns
      interleaved; `down_proj` [E, F, H]: transposed to [E, rows, cols].
    The biases: `gate_up_proj_bias` [E, 2F] (interleaved) and `down_proj_bias` [E, H]."""
    dense = prefix + "gate_up_proj" in w  # a folder transformers saved: down_proj is [E, F, H] too
    if prefix + "gate_up_proj_bias" in w:
        both = w.pop(prefix + "gate_up_proj_bias").float()
        w[prefix + "gate_proj_bias"], w[prefix + "up_proj_bias"] = both[:, 0::2], both[:, 1::2]
    if prefix + "gate_up_proj_blocks" in w:
        blocks, scales = _raw(w, prefix + "gate_up_proj_blocks"), _raw(w, prefix + "gate_up_proj_scales")
        w[prefix + "gate_proj"] = _mxfp4_experts(prefix + "gate_up_proj", blocks[:, 0::2], scales[:, 0::2], hidden)
        w[prefix + "up_proj"] = _mxfp4_experts(prefix + "gate_up_proj", blocks[:, 1::2], scales[:, 1::2], hidden)
    elif prefix + "gate_up_proj" in w:
        both = w.pop(prefix + "gate_up_proj").float()
        w[prefix + "gate_proj"] = both[:, :, 0::2].transpose(1, 2).contiguous()
        w[prefix + "up_proj"] = both[:, :, 1::2].transpose(1, 2).contiguous()
    if prefix + "down_proj_blocks" in w:
        blocks, scales = _raw(w, prefix + "down_proj_blocks"), _raw(w, prefix + "down_proj_scales")
        w[prefix + "down_proj"] = _mxfp4_experts(prefix + "down_proj", blocks, scales, None)
    elif dense and prefix + "down_proj" in w:
        w[prefix + "down_proj"] = w.pop(prefix + "down_proj").float().transpose(1, 2).contiguous()


def _raw(w: dict, key: str) -> torch.Tensor:
    if key not in w:
        raise ModelLoadError(f"weight {key}: missing")
    t = w.pop(key)
    t = t.to(dtype=torch.uint8) if not isinstance(t, torch.Tensor) else t
    if t.dtype != torch.uint8:
        raise ModelLoadError(f"weight {key}: dtype {t.dtype}, expected uint8 (MXFP4 blocks or scales)")
    return t


def _mxfp4_experts(name: str, blocks: torch.Tensor, scales: torch.Tensor, cols: int | None) -> ExpertWeights:
    """[E, rows, G, 16] blocks and [E, rows, G] scales -> one MXFP4 QuantizedTensor per expert."""
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ModelLoadError(
            f"weight {name}_blocks / _scales: shapes {tuple(blocks.shape)} and {tuple(scales.shape)}: "
            "expected [experts, rows, groups, 16] and [experts, rows, groups]"
        )
    width = blocks.shape[2] * 32
    if cols is not None and width != cols:
        raise ModelLoadError(f"weight {name}_blocks: rows of {width} values, expected {cols}")
    packed = mxfp4_from_hf(blocks, scales)  # [E, rows, G * 17]
    return ExpertWeights([QuantizedTensor("MXFP4", part, width) for part in packed.unbind(0)])
