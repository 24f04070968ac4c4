"""Gemma 4 (the text model): Gemma 3's decoder with per-layer embeddings, layers that share KV,
wider global heads and an optional mixture of experts beside every MLP.

- local and global layers (`layer_types`, 5:1 by default; the last layer global): local layers
  attend within a sliding window with heads of `head_dim` and RoPE base 10,000; global layers
  with heads of `global_head_dim` (512 in the published models) and `num_global_key_value_heads`
  KV heads where the model sets `attention_k_eq_v`, rotated "proportionally": the head's first
  `partial_rotary_factor` of its frequency pairs turn, the others (frequency 0) pass, over the
  whole head in the rotate-half layout. Each kind has its own head size, so the KV pool holds
  pages of mixed layers (kv_layout.py);
- attention_k_eq_v: a global layer's values are its key projection before the key's norm and
  rotation (no v_proj), so its keys are its values times k_norm's weight, rotated: its cache holds
  the values once and attention makes the keys as it reads them (KeysFromValues); every layer
  norms q and k per head (weights that multiply: Gemma 4's RMSNorm is not Gemma 3's 1 + w) and v
  without a weight; attention is unscaled (the norms set it);
- the last `num_kv_shared_layers` layers compute no K/V: each reads the KV of the last earlier
  layer of its own kind, through that layer's cache group and pages (they hold none of their own);
  with `use_double_wide_mlp` their MLP is twice as wide;
- per-layer embeddings (PLE, `hidden_size_per_layer_input` > 0): a second table [vocab, layers x
  P], scaled by sqrt(P), plus a projection of the (scaled) embedding, normed per layer, the two
  summed and scaled by 1/sqrt(2); after each layer's MLP, gelu(gate(h)) * that layer's P values,
  projected back, normed and added;
- the MoE block (`enable_moe_block`): beside the dense MLP, experts (GeGLU, top-k of a softmax
  router that reads the layer's residual through a weightless norm, a learned scale and 1/sqrt(H),
  renormalised, then scaled per expert) on their own pre-norm; the MLP's and the experts' outputs
  each normed, summed, then normed again;
- each layer's output scaled by a learned `layer_scalar`; final logits soft-capped where set.

config.json in both forms: `per_layer_config` (per layer index: head_dim, num_key_value_heads),
as transformers saves it, or `global_head_dim` / `num_global_key_value_heads`, as the published
checkpoints carry it. llama.cpp's gemma4 GGUF files: the global head size as key_length and the
local one as key_length_swa, per-layer KV head counts, `shared_kv_layers`, the per-layer feed
-forward widths, the global layers' proportional rotation as its rope_freqs tensor (1 / 1e30).
A Gemma4ForConditionalGeneration folder serves its text model; its vision and audio towers are read
past (said in the log).
"""

import functools
import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from treadle.model.config import LIMITS, ModelLoadError, MoEConfig, RopeConfig, file_int
from treadle.model.families.gemma3 import LOCAL_ROPE_THETA, Gemma3Config, Gemma3Model, layer_windows
from treadle.model.families.llama import LayerWeights, LlamaModel, in_row_slices, weight_part
from treadle.model.kernels.quant import quant_rows_op
from treadle.model.layers.attention import KeysFromValues, metadata_by_layer, paged_attention
from treadle.model.layers.linear import Linear
from treadle.model.layers.moe import MoE
from treadle.model.layers.norm import RMSNorm
from treadle.model.layers.rotary import RotaryEmbedding, apply_rotary
from treadle.model.loading.gguf_names import LLAMA_LAYER_TENSORS

log = logging.getLogger("treadle.model")

SLIDING_WINDOW_PATTERN = 6
GLOBAL_ROPE_THETA = 1_000_000.0
GLOBAL_PARTIAL_ROTARY = 0.25  # transformers' default for the global layers' proportional RoPE
UNROTATED = 1e30  # llama.cpp's rope_freqs factor of a frequency that does not turn


@dataclass
class Gemma4Config(Gemma3Config):
    global_head_dim: int = 512
    global_kv_heads: int = 0  # 0: num_kv_heads
    k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    ple_dim: int = 0  # hidden_size_per_layer_input; 0: no per-layer embeddings
    ple_vocab: int = 0

    def is_global(self, layer: int) -> bool:
        return self.layer_windows is None or self.layer_windows[layer] is None

    def layer_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head size) of a layer."""
        if self.is_global(layer):
            return (self.global_kv_heads or self.num_kv_heads), self.global_head_dim
        return self.num_kv_heads, self.head_dim

    def first_shared(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    def ffn_size(self, layer: int) -> int:
        wide = self.double_wide_mlp and layer >= self.first_shared()
        return self.intermediate_size * (2 if wide else 1)


def _kv_sources(config: Gemma4Config) -> list[int | None] | None:
    """Each shared layer's source: the last earlier layer of its kind that computes KV."""
    first = config.first_shared()
    if config.num_kv_shared_layers == 0:
        return None
    out: list[int | None] = [None] * config.num_layers
    for i in range(first, config.num_layers):
        kind = config.is_global(i)
        sources = [j for j in range(first) if config.is_global(j) == kind]
        if not sources:
            raise ModelLoadError(f"{config.name}: shared-KV layer {i} has no earlier layer of its kind to read")
        out[i] = sources[-1]
    return out


def _finish(where: str, config: Gemma4Config) -> Gemma4Config:
    """The shared fields checked, then the KV pool's per-layer shapes and sources set."""
    config.global_head_dim = file_int(where, "global_head_dim", config.global_head_dim, *LIMITS["head_dim"])
    if config.global_kv_heads:
        config.global_kv_heads = file_int(where, "num_global_key_value_heads", config.global_kv_heads, 1, 1024)
        if config.num_heads % config.global_kv_heads:
            raise ModelLoadError(
                f"{where}: num_global_key_value_heads = {config.global_kv_heads}: does not divide the heads"
            )
    if config.global_head_dim % 2:
        raise ModelLoadError(
            f"{where}: global_head_dim = {config.global_head_dim}: rotary embeddings need an even size"
        )
    config.num_kv_shared_layers = file_int(
        where, "num_kv_shared_layers", config.num_kv_shared_layers, 0, config.num_layers - 1
    )
    config.ple_dim = file_int(where, "hidden_size_per_layer_input", config.ple_dim, 0, LIMITS["hidden_size"][1])
    if config.ple_dim:
        config.ple_vocab = file_int(where, "vocab_size_per_layer_input", config.ple_vocab, 1, LIMITS["vocab_size"][1])
    freq = config.rope.freq_factors
    if freq is not None and len(freq) != config.global_head_dim // 2:
        raise ModelLoadError(
            f"{where}: the global layers' rotation: {len(freq)} frequencies, expected {config.global_head_dim // 2}"
        )
    n = config.num_layers
    config.layer_kv_shapes = [config.layer_shape(i) for i in range(n)]
    config.kv_sources = _kv_sources(config)
    # a k_eq_v layer's keys are its values times k_norm's weight, rotated: its cache holds the values once
    config.kv_values_only = [config.is_global(i) for i in range(n)] if config.k_eq_v else None
    return config


def proportional_rope(theta: float, head_dim: int, partial: float, factor: float = 1.0) -> RopeConfig:
    """transformers' "proportional" RoPE: the first partial * head_dim / 2 frequency pairs turn
    (their base exponent over the whole head), the rest are frequency 0; as divisors of the
    head's frequencies (0: an infinite divisor)."""
    turning = int(partial * head_dim // 2)
    factors = [factor] * turning + [math.inf] * (head_dim // 2 - turning)
    return RopeConfig(theta=theta, freq_factors=factors)


class Gemma4Layer:
    def __init__(self, config: Gemma4Config, lw: LayerWeights):
        i = lw.index
        self.index = i
        self.heads, self.dim = config.num_heads, config.layer_shape(i)[1]
        self.kv_heads = config.layer_shape(i)[0]
        self.is_global = config.is_global(i)
        self.shared = i >= config.first_shared()
        self.k_eq_v = config.k_eq_v and self.is_global
        self.input_norm = lw.norm("input_layernorm.weight")
        self.post_attention_norm = lw.norm("post_attention_layernorm.weight")
        self.pre_feedforward_norm = lw.norm("pre_feedforward_layernorm.weight")
        self.post_feedforward_norm = lw.norm("post_feedforward_layernorm.weight")
        names = ["self_attn.q_proj.weight"]
        if not self.shared:
            names.append("self_attn.k_proj.weight")
            if not self.k_eq_v:
                names.append("self_attn.v_proj.weight")
        bias = torch.cat([lw.take(n.replace("weight", "bias")) for n in names]) if config.attention_bias else None
        self.qkv = lw.linear(names, bias)
        self.q_norm = lw.norm("self_attn.q_norm.weight")
        self.k_norm = None if self.shared else lw.norm("self_attn.k_norm.weight")
        if self.shared:  # a shared layer's own K/V weights, where a file still has them, are not used
            for name in ("k_proj", "v_proj", "k_norm", "v_norm"):
                lw.w.pop(lw.prefix + f"self_attn.{name}.weight", None)
        self.o_proj = lw.linear(
            ("self_attn.o_proj.weight",), lw.take("self_attn.o_proj.bias") if config.attention_bias else None
        )
        self.gate_up = lw.linear(("mlp.gate_proj.weight", "mlp.up_proj.weight"))
        self.down = lw.linear(("mlp.down_proj.weight",))
        self.moe = None
        if config.moe is not None:
            self.moe = Gemma4Experts(config, lw)
            self.post_feedforward_norm_1 = lw.norm("post_feedforward_layernorm_1.weight")
            self.pre_feedforward_norm_2 = lw.norm("pre_feedforward_layernorm_2.weight")
            self.post_feedforward_norm_2 = lw.norm("post_feedforward_layernorm_2.weight")
        self.ple = None
        if config.ple_dim:
            self.ple = (
                lw.linear(("per_layer_input_gate.weight",)),
                lw.linear(("per_layer_projection.weight",)),
                lw.norm("post_per_layer_input_norm.weight"),
            )
        self.scalar = lw.take("layer_scalar").reshape(-1)[:1] if lw.prefix + "layer_scalar" in lw.w else None


class Gemma4Experts(MoE):
    """The MoE block's router and experts: experts.{gate_up_proj, down_proj} stacked (or a GGUF
    file's), router.{proj, scale, per_expert_scale}."""

    def __init__(self, config: Gemma4Config, lw: LayerWeights):
        super().__init__(
            config, lw, router="router.proj.weight", experts="experts", shared="", fused_gate_up="gate_up_proj"
        )
        self.scale = lw.take_float("router.scale") * config.hidden_size**-0.5
        self.per_expert_scale = lw.take_float("router.per_expert_scale")
        self.eps = config.rms_norm_eps

    def route(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router reads the layer's residual through a weightless norm, its scale and 1/sqrt(H)."""
        x = residual.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        probs = self.router((x * self.scale).to(residual.dtype)).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[chosen], chosen


class Gemma4Model(Gemma3Model):
    hf_model_types = ("gemma4_text", "gemma4")
    hf_architectures = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
    gguf_architectures = ("gemma4",)

    layer_class = Gemma4Layer
    decoder_kernel = False  # kernels/decoder.py has no per-layer embeddings nor shared KV
    gguf_layer_tensors = {
        **LLAMA_LAYER_TENSORS,
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
        "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
        "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
        "inp_gate.weight": "per_layer_input_gate.weight",
        "proj.weight": "per_layer_projection.weight",
        "post_norm.weight": "post_per_layer_input_norm.weight",
        "layer_output_scale.weight": "layer_scalar",
        "ffn_gate_inp.weight": "router.proj.weight",
        "ffn_gate_inp.scale": "router.scale",
        "ffn_down_exps.scale": "router.per_expert_scale",
        "ffn_gate_exps.weight": "experts.gate_proj",
        "ffn_up_exps.weight": "experts.up_proj",
        "ffn_gate_up_exps.weight": "experts.gate_up_proj",
        "ffn_down_exps.weight": "experts.down_proj",
    }
    mmproj_projectors = ()
    bidirectional_images = False

    # ---------------------------------------------------------------- reading its files

    @classmethod
    def config_from_hf(cls, hf) -> Gemma4Config:
        if "text_config" in hf.cfg:  # Gemma4ForConditionalGeneration: its text model
            towers = [k for k in ("vision_config", "audio_config") if hf.cfg.get(k)]
            if towers:
                log.info("%s: serving the text model; its %s are not read", hf.folder, " and ".join(towers))
            hf = type(hf)(
                hf.folder, {**hf.section("text_config"), "architectures": hf.cfg.get("architectures")}, hf.arch
            )
        cls._check_activation(hf)
        if hf.get("use_bidirectional_attention") == "all":
            raise ModelLoadError(f"{hf.where}: use_bidirectional_attention = 'all': not a causal language model")
        num_layers = hf.int("num_hidden_layers", "num_layers")
        types = hf.get("layer_types")
        if types is None:
            types = [
                "sliding_attention" if (i + 1) % SLIDING_WINDOW_PATTERN else "full_attention" for i in range(num_layers)
            ]
        if not (
            isinstance(types, list)
            and len(types) == num_layers
            and all(t in ("sliding_attention", "full_attention") for t in types)
        ):
            raise ModelLoadError(
                f"{hf.where}: layer_types: expected {num_layers} of 'sliding_attention' / 'full_attention'"
            )
        types = list(types[:-1]) + ["full_attention"]  # as transformers forces it
        params = hf.section("rope_parameters")
        local = params.get("sliding_attention") or {}
        full = params.get("full_attention") or {}
        if not isinstance(local, dict) or not isinstance(full, dict):
            raise ModelLoadError(f"{hf.where}: rope_parameters: expected an object per layer type")
        head_dim, global_head_dim, global_kv = cls._global_shape(hf, types)
        kind = full.get("rope_type", "proportional")
        if kind == "proportional":
            global_rope = proportional_rope(
                full.get("rope_theta", GLOBAL_ROPE_THETA),
                global_head_dim,
                full.get("partial_rotary_factor", GLOBAL_PARTIAL_ROTARY if not full else 1.0),
                full.get("factor", 1.0),
            )
        elif kind == "default":
            global_rope = RopeConfig(theta=full.get("rope_theta", GLOBAL_ROPE_THETA))
        else:
            raise ModelLoadError(f"{hf.where}: rope_parameters full_attention rope_type {kind!r}: unsupported")
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(
                f"{hf.where}: rope_parameters sliding_attention rope_type {local['rope_type']!r}: unsupported"
            )
        moe = None
        if hf.get("enable_moe_block", False):
            moe = MoEConfig(
                num_experts=hf.get("num_experts"), top_k=hf.get("top_k_experts"),
                expert_size=hf.get("moe_intermediate_size"), norm_topk=True, gelu=True,
            )  # fmt: skip
        config = hf.llama_style(
            Gemma4Config,
            head_dim=head_dim,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            layer_windows=layer_windows(num_layers, hf.get("sliding_window") or None, types=types)
            if hf.get("sliding_window")
            else None,
            sliding_window=None,
            query_pre_attn_scalar=1.0,
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            attn_logit_softcapping=None,
            qk_norm=True,
            rope=global_rope,
            local_rope=RopeConfig(theta=local.get("rope_theta", LOCAL_ROPE_THETA)),
            global_head_dim=global_head_dim,
            global_kv_heads=global_kv,
            k_eq_v=bool(hf.get("attention_k_eq_v", False)),
            num_kv_shared_layers=hf.get("num_kv_shared_layers", 0),
            double_wide_mlp=bool(hf.get("use_double_wide_mlp", False)),
            ple_dim=hf.get("hidden_size_per_layer_input") or 0,
            ple_vocab=hf.get("vocab_size_per_layer_input") or 0,
            moe=moe,
        )
        config = hf.checked(config)
        return _finish(hf.where, cls._checked(hf.where, config))

    @staticmethod
    def _global_shape(hf, types: list) -> tuple[int, int, int]:
        """(local head size, global head size, global KV heads or 0) from either form of config.json."""
        head_dim = hf.get("head_dim", 256)
        global_dim, global_kv = hf.get("global_head_dim"), hf.get("num_global_key_value_heads")
        per_layer = hf.get("per_layer_config")
        if per_layer is not None:
            if not isinstance(per_layer, dict):
                raise ModelLoadError(f"{hf.where}: per_layer_config: expected an object by layer index")
            for index, values in per_layer.items():
                i = int(index) if str(index).isdigit() else -1
                if not 0 <= i < len(types) or not isinstance(values, dict):
                    raise ModelLoadError(f"{hf.where}: per_layer_config[{index!r}]: not a layer's settings")
                if types[i] == "full_attention":
                    global_dim = values.get("head_dim", global_dim)
                    global_kv = values.get("num_key_value_heads", global_kv)
                elif set(values) - {"head_dim", "num_key_value_heads"} or values.get("head_dim", head_dim) != head_dim:
                    raise ModelLoadError(
                        f"{hf.where}: per_layer_config[{index!r}]: a local layer's own shape: unsupported"
                    )
        elif not hf.get("attention_k_eq_v", True):
            global_kv = None  # transformers: the global KV heads apply with attention_k_eq_v
        return head_dim, global_dim if global_dim is not None else 512, global_kv or 0

    @classmethod
    def config_from_gguf(cls, gguf) -> Gemma4Config:
        num_layers = gguf.number("block_count", *LIMITS["num_layers"], required=True)
        pattern = gguf.get("attention.sliding_window_pattern")
        if not (isinstance(pattern, list) and len(pattern) == num_layers and all(isinstance(p, bool) for p in pattern)):
            raise gguf.fail("attention.sliding_window_pattern", f"expected {num_layers} booleans (one per layer)")
        window = gguf.get("attention.sliding_window") or None
        global_dim = gguf.number("attention.key_length", *LIMITS["head_dim"], required=True)
        local_dim = gguf.number("attention.key_length_swa", *LIMITS["head_dim"], default=global_dim)
        if (
            gguf.get("attention.value_length", global_dim) != global_dim
            or gguf.get("attention.value_length_swa", local_dim) != local_dim
        ):
            raise gguf.fail("attention.value_length", "differs from key_length, not supported")
        heads = gguf.number("attention.head_count", *LIMITS["num_heads"], required=True)
        kv = gguf.get("attention.head_count_kv", heads)
        local_kv = global_kv = kv
        if isinstance(kv, list):
            if len(kv) != num_layers:
                raise gguf.fail("attention.head_count_kv", f"expected {num_layers} counts")
            local = {n for n, swa in zip(kv, pattern) if swa}
            glob = {n for n, swa in zip(kv, pattern) if not swa}
            if len(local) > 1 or len(glob) > 1:
                raise gguf.fail("attention.head_count_kv", "differs among layers of one kind: not supported")
            global_kv = glob.pop() if glob else None
            local_kv = local.pop() if local else global_kv
        ff = gguf.get("feed_forward_length", required=True)
        shared = gguf.get("attention.shared_kv_layers", 0)
        double = False
        if isinstance(ff, list):
            first = num_layers - shared if isinstance(shared, int) else num_layers
            base = {f for i, f in enumerate(ff) if i < first}
            wide = {f for i, f in enumerate(ff) if i >= first}
            if len(ff) != num_layers or len(base) != 1 or len(wide) > 1:
                raise gguf.fail(
                    "feed_forward_length", "per-layer widths other than Gemma 4's double-wide shared layers"
                )
            ff = base.pop()
            double = bool(wide) and wide.pop() == 2 * ff
        moe = gguf.moe(norm_topk=True)
        if moe is not None:
            moe.gelu = True
        config = gguf.llama_style(
            Gemma4Config,
            partial_rotary=True,
            per_layer_kv_heads="family",
            intermediate_size=ff,
            num_kv_heads=local_kv,
            head_dim=local_dim,
            layer_windows=[window if swa else None for swa in pattern] if window else None,
            sliding_window=None,
            final_logit_softcapping=gguf.get("final_logit_softcapping"),
            local_rope=RopeConfig(theta=gguf.get("rope.freq_base_swa", LOCAL_ROPE_THETA)),
            query_pre_attn_scalar=1.0,
            global_head_dim=global_dim,
            global_kv_heads=global_kv if global_kv != local_kv else 0,
            num_kv_shared_layers=shared,
            double_wide_mlp=double,
            ple_dim=gguf.get("embedding_length_per_layer_input", 0),
            moe=moe,
        )
        config.k_eq_v = cls._gguf_k_eq_v(gguf, config)
        config.rope.rotary_dim = None  # the global rotation is its rope_freqs tensor, over the whole head
        config.ple_vocab = config.vocab_size
        config = gguf.checked(config)
        return _finish(gguf.path, cls._checked(gguf.path, config))

    @staticmethod
    def _gguf_k_eq_v(gguf, config) -> bool:
        """A global layer with KV of its own and no attn_v tensor: its values are its keys."""
        names = gguf.tensor_names
        windows = config.layer_windows or [None] * config.num_layers
        own = config.num_layers - (config.num_kv_shared_layers or 0)
        return any(
            windows[i] is None and f"blk.{i}.attn_k.weight" in names and f"blk.{i}.attn_v.weight" not in names
            for i in range(own)
        )

    @staticmethod
    def rope_freqs_head_dim(config) -> int:
        return config.global_head_dim  # the tensor is the global layers' rotation

    @staticmethod
    def rope_factors(factors: list[float]) -> list[float]:
        """llama.cpp's rope_freqs of the global layers: 1e30 marks a frequency that does not turn."""
        return [math.inf if f >= UNROTATED else f for f in factors]

    @staticmethod
    def from_gguf_tensor(name: str, data: np.ndarray) -> np.ndarray:
        return data  # Gemma 4's norms multiply by their weight, in both sources

    # ---------------------------------------------------------------- the model

    @staticmethod
    def expected_shapes(config: Gemma4Config) -> dict[str, tuple[int, ...]]:
        h, p = config.hidden_size, config.ple_dim
        shapes = {
            "model.embed_tokens.weight": (config.vocab_size, h),
            "model.norm.weight": (h,),
            "lm_head.weight": (config.vocab_size, h),
        }
        if p:
            shapes["model.embed_tokens_per_layer.weight"] = (config.ple_vocab, config.num_layers * p)
            shapes["model.per_layer_model_projection.weight"] = (config.num_layers * p, h)
            shapes["model.per_layer_projection_norm.weight"] = (p,)
        for i in range(config.num_layers):
            pre = f"model.layers.{i}."
            kvh, d = config.layer_shape(i)
            ff = config.ffn_size(i)
            q = config.num_heads * d
            layer = {
                "self_attn.q_proj.weight": (q, h), "self_attn.o_proj.weight": (h, q),
                "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
                "self_attn.k_proj.weight": (kvh * d, h), "self_attn.v_proj.weight": (kvh * d, h),
                "mlp.gate_proj.weight": (ff, h), "mlp.up_proj.weight": (ff, h), "mlp.down_proj.weight": (h, ff),
                "per_layer_input_gate.weight": (p, h), "per_layer_projection.weight": (h, p),
            }  # fmt: skip
            for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm", "post_per_layer_input_norm", "pre_feedforward_layernorm_2",
                         "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"):  # fmt: skip
                layer[name + ".weight"] = (h,)
            if config.moe is not None:
                n, f = config.moe.num_experts, config.moe.expert_size
                layer.update({
                    "router.proj.weight": (n, h), "router.scale": (h,), "router.per_expert_scale": (n,),
                    "experts.gate_up_proj": (n, 2 * f, h), "experts.gate_proj": (n, f, h), "experts.up_proj": (n, f, h),
                    "experts.down_proj": (n, h, f),
                })  # fmt: skip
            shapes.update({pre + k: v for k, v in layer.items()})
        return shapes

    def __init__(
        self, config: Gemma4Config, weights: dict, dtype: torch.dtype, device="cpu", batch_invariant: bool = False
    ):
        dropped = 0
        for name in list(weights):  # a ConditionalGeneration folder: its text model under its own names
            if name.startswith(
                ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
            ):
                weights.pop(name)
                dropped += 1
            elif name.startswith("model.language_model."):
                weights["model." + name.removeprefix("model.language_model.")] = weights.pop(name)
        if dropped:
            log.info("Gemma 4: %d vision / audio tensors not read (the text model is served)", dropped)
        self.device, self.dtype, self.config = device, dtype, config
        self.ple_embed = self.ple_projection = self.ple_norm = None
        if config.ple_dim:
            for name in ("model.embed_tokens_per_layer.weight", "model.per_layer_model_projection.weight"):
                if name not in weights:
                    raise ModelLoadError(f"weight {name}: missing")
            self.ple_embed = weight_part(weights, "model.embed_tokens_per_layer.weight", dtype, device)
            self.ple_projection = Linear(weight_part(weights, "model.per_layer_model_projection.weight", dtype, device))
            if "model.per_layer_projection_norm.weight" not in weights:
                raise ModelLoadError("weight model.per_layer_projection_norm.weight: missing")
            self.ple_norm = self.make_norm(weights.pop("model.per_layer_projection_norm.weight"))
        for i in range(config.first_shared(), config.num_layers):
            for name in ("k_proj", "v_proj", "k_norm", "v_norm"):
                weights.pop(f"model.layers.{i}.self_attn.{name}.weight", None)
        LlamaModel.__init__(self, config, weights, dtype, device, batch_invariant)
        if batch_invariant and self.ple_projection is not None:
            self.ple_projection.row_chunk = Linear.INVARIANT_ROWS
        self.vision = None
        self.windows = config.windows()
        self.global_rotary = self.rotary
        self.local_rotary = self.rotary_for(config.local_rope, config.head_dim)
        self.embed_scale = torch.tensor(math.sqrt(config.hidden_size), dtype=dtype, device=device)
        if config.ple_dim:
            self.ple_scale = torch.tensor(math.sqrt(config.ple_dim), dtype=dtype, device=device)
        eps = config.rms_norm_eps
        self.v_norms = {
            d: RMSNorm(torch.ones(d, dtype=dtype, device=device), eps)
            for d in {config.head_dim, config.global_head_dim}
        }
        # per layer, how its keys are made from the values its cache holds where its KV source (itself,
        # or the layer a shared layer reads) is a k_eq_v layer: that layer's k_norm weight; else None
        made = {
            layer.index: KeysFromValues(layer.k_norm.weight.float().contiguous(), self.global_rotary)
            for layer in self.layers
            if layer.k_eq_v and not layer.shared
        }
        sources = config.kv_sources or [None] * config.num_layers
        self.keys_from_values = [made.get(i if src is None else src) for i, src in enumerate(sources)]

    def make_norm(self, weight) -> RMSNorm:
        return LlamaModel.make_norm(self, weight)  # Gemma 4's weights multiply (not 1 + w)

    def rotary_for(self, rope, head_dim: int | None = None) -> RotaryEmbedding:
        """The global layers' rotation (LlamaModel's `rotary`) over the global head, unless told."""
        return LlamaModel.rotary_for(self, rope, head_dim or self.config.global_head_dim)

    def linears(self) -> list[Linear]:
        out = [self.lm_head] + ([self.ple_projection] if self.ple_projection is not None else [])
        for layer in self.layers:
            out += [layer.qkv, layer.o_proj, layer.gate_up, layer.down]
            if layer.moe is not None:
                out += layer.moe.linears()
            if layer.ple is not None:
                out += list(layer.ple[:2])
        return out

    def tensors(self) -> list[torch.Tensor]:
        norms = []
        for layer in self.layers:
            norms += [layer.input_norm, layer.post_attention_norm, layer.pre_feedforward_norm,
                      layer.post_feedforward_norm, layer.q_norm, layer.k_norm]  # fmt: skip
            if layer.moe is not None:
                norms += [layer.post_feedforward_norm_1, layer.pre_feedforward_norm_2, layer.post_feedforward_norm_2]
            if layer.ple is not None:
                norms.append(layer.ple[2])
        extra = [self.ple_embed] if self.ple_embed is not None else []
        return [self.embed, self.norm.weight2] + extra + [n.weight2 for n in norms if n is not None]

    def per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """[T, layers, P]: each layer's per-layer embedding of each token (transformers' get_ and
        project_per_layer_inputs)."""
        cfg = self.config
        t, n, p = h.shape[0], cfg.num_layers, cfg.ple_dim
        table = self.ple_embed
        if isinstance(table, torch.Tensor):
            tok = F.embedding(input_ids, table)
        elif torch.compiler.is_compiling():  # a file's quantized table: its rows through the operator
            tok = quant_rows_op(table.data, table.type_id, table.shape[1], input_ids, self.dtype)
        else:
            tok = table.rows(input_ids, self.dtype)
        tok = (tok * self.ple_scale).view(t, n, p)
        proj = (self.ple_projection(h) * (cfg.hidden_size**-0.5)).view(t, n, p)
        return (self.ple_norm(proj) + tok) * (2.0**-0.5)

    def residual_stream(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        h = self.embedding(input_ids) * self.embed_scale
        ple = self.per_layer_inputs(input_ids, h) if self.ple_embed is not None else None
        global_tables = self.global_rotary.tables(positions)
        local_tables = self.local_rotary.tables(positions)
        metas = metadata_by_layer(meta, self.layer_groups)
        for i, (layer, kv, layer_meta) in enumerate(zip(self.layers, kv_caches, metas)):
            tables = global_tables if layer.is_global else local_tables
            h = h + layer.post_attention_norm(self.attention(layer, layer.input_norm(h), tables, kv, layer_meta))
            residual = h
            x = layer.pre_feedforward_norm(h)
            m = in_row_slices(functools.partial(self.mlp, layer), x, (layer.gate_up, layer.down))
            if layer.moe is not None:
                experts = layer.moe(layer.pre_feedforward_norm_2(residual), residual)
                m = layer.post_feedforward_norm_1(m) + layer.post_feedforward_norm_2(experts)
            h = residual + layer.post_feedforward_norm(m)
            if ple is not None:
                gate, projection, norm = layer.ple
                g = self.mlp_activation(gate(h)) * ple[:, i]
                h = h + norm(projection(g))
            if layer.scalar is not None:
                h = h * layer.scalar
        return h

    def attention(self, layer, x: torch.Tensor, tables, kv, layer_meta) -> torch.Tensor:
        t, heads, d = x.shape[0], layer.heads, layer.dim
        projected = layer.qkv(x)
        q = layer.q_norm(projected[:, : heads * d].view(t, heads, d))
        k = v = None
        derived = self.keys_from_values[layer.index]
        if not layer.shared:
            kvh = layer.kv_heads
            raw_k = projected[:, heads * d : (heads + kvh) * d].view(t, kvh, d)
            raw_v = raw_k if layer.k_eq_v else projected[:, (heads + kvh) * d :].view(t, kvh, d)
            if derived is None:
                k = apply_rotary(layer.k_norm(raw_k), *tables)
            v = self.v_norms[d](raw_v)
        q = apply_rotary(q, *tables)
        attn = paged_attention(q, k, v, kv[0], kv[1], layer_meta, 1.0, derived=derived)
        return layer.o_proj(attn.reshape(t, heads * d))
