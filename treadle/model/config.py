"""The hyperparameters of one Llama-style decoder, whatever file they came from."""

import math
from dataclasses import dataclass, field

from treadle.kv_layout import KVLayout, kv_layout


class ModelLoadError(ValueError):
    """A model file or folder that treadle cannot load; the message names file, item and reason."""


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `factor` times the original (its paper's 0.1 ln s + 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass
class RopeConfig:
    theta: float = 10000.0
    # None, "linear", "llama3", "longrope", "yarn" or "dynamic" (HF names); llama.cpp's rope_freqs tensor
    # arrives as `freq_factors`.
    scaling_type: str | None = None
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    freq_factors: list[float] | None = None
    # partial rotary embeddings (Phi-4-mini, ...): the first rotary_dim of each head rotate, the rest pass
    rotary_dim: int | None = None
    # longrope (Phi-3): per-frequency divisors for contexts within / beyond original_max_position, and
    # the factor cos and sin are multiplied by
    short_factor: list[float] | None = None
    long_factor: list[float] | None = None
    attention_factor: float = 1.0
    # yarn: the rotation counts bounding the ramp between interpolated and extrapolated frequencies
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass
class MoEConfig:
    """A mixture-of-experts feed-forward (moe.py): each token's `top_k` of `num_experts` experts,
    weighted by the router's softmax (renormalised over the chosen when `norm_topk`), plus a shared
    expert of `shared_size` on every token where the model has one (Qwen2-MoE, gated by a sigmoid).
    gpt-oss's block: biases on the router and the experts, the softmax over the top-k logits alone,
    and a clamped SwiGLU (`swiglu_limit` > 0; moe.py's `expert_activation`)."""

    num_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate size
    norm_topk: bool = False
    shared_size: int = 0
    biases: bool = False
    softmax_after_topk: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    gelu: bool = False  # Gemma 4: the experts' gate through tanh-approximated GELU (GeGLU), not SiLU
    # per layer, whether its feed-forward is the experts (Qwen's decoder_sparse_step and
    # mlp_only_layers); None: every layer
    sparse_layers: list[bool] | None = None

    def sparse(self, layer: int) -> bool:
        return self.sparse_layers is None or self.sparse_layers[layer]


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k and v
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    # OLMoE: q and k normed over the whole projection (all heads at once) instead of per head
    qk_norm_per_head: bool = True
    clip_qkv: float | None = None  # OLMo: q, k and v clamped to [-clip, clip]
    moe: MoEConfig | None = None
    # hybrids: per layer, "attention" or "recurrent" (a state-space mixer with a per-request state
    # instead of KV: mamba.py); None: every layer attends
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # per layer, its sliding window or None for full attention (Gemma's local and global layers);
    # None here: every layer has `sliding_window`
    layer_windows: list[int | None] | None = None
    name: str = ""
    # positions the engine will use (its max_model_len), set before the model is built: the rotary
    # tables cover them where they exceed the model's own context (capped: llama.ROPE_TABLE_CAP)
    position_table: int | None = None
    # a GGUF model's image encoder: llama.cpp's mmproj file (loader.attach_mmproj), where its family reads one
    mmproj: str | None = None
    # the labels of the output head's rows where that head is a classifier, not the vocabulary (a
    # llama.cpp reranker GGUF's `cls.output.weight`, its `classifier.output_labels`): the model scores
    # (pooling "score", its logits' columns these rows) and cannot generate; None: a vocabulary head
    head_labels: list[str] | None = None
    # per attention layer, (KV heads, head size) where layers differ (Gemma 4's global layers beside
    # its local ones); None: every layer has num_kv_heads heads of head_dim
    layer_kv_shapes: list[tuple[int, int]] | None = None
    # per attention layer, the earlier layer whose K/V it reads instead of its own (Gemma 4's last
    # num_kv_shared_layers), None for a layer with KV of its own; None: no layer shares
    kv_sources: list[int | None] | None = None
    # per attention layer, True where the cache holds its values alone and its keys are made from
    # them (Gemma 4's attention_k_eq_v layers: layers.attention.KeysFromValues); None: none does
    kv_values_only: list[bool] | None = None

    def kv_rows(self) -> list[int]:
        """Every attention layer's cache rows per token and KV head: 2 (a key and a value), or 1
        where the keys are made from the values."""
        if self.kv_values_only is None:
            return [2] * len(self.windows())
        return [1 if only else 2 for only in self.kv_values_only]

    def kv_shapes(self) -> list[tuple[int, int]]:
        """Every attention layer's (KV heads, head size)."""
        if self.layer_kv_shapes is not None:
            return list(self.layer_kv_shapes)
        return [(self.num_kv_heads, self.head_dim)] * len(self.windows())

    def kv_layout(self) -> KVLayout:
        """How the attention layers share the KV pool (kv_layout.py); the rows' sizes count where
        layers' shapes differ."""
        units = None
        if self.layer_kv_shapes is not None or self.kv_values_only is not None:
            units = [rows * heads * dim for rows, (heads, dim) in zip(self.kv_rows(), self.kv_shapes())]
        return kv_layout(self.windows(), units, self.kv_sources)

    def kv_page_elements(self, block_size: int, extra: int = 0) -> int:
        """One page of the pool, in its elements: a block of every layer of the largest cache
        group (`extra`: elements beside each row's values, an int8 row's scale)."""
        shapes, rows = self.kv_shapes(), self.kv_rows()
        return max(
            sum(rows[i] * block_size * shapes[i][0] * (shapes[i][1] + extra) for i in g.layers)
            for g in self.kv_layout().groups
        )

    def windows(self) -> list[int | None]:
        """Every attention layer's sliding window (None: full attention); a hybrid's recurrent
        layers have no KV and are not listed."""
        windows = (
            list(self.layer_windows) if self.layer_windows is not None else [self.sliding_window] * self.num_layers
        )
        return (
            windows if self.layer_types is None else [w for w, t in zip(windows, self.layer_types) if t == "attention"]
        )

    @property
    def recurrent(self) -> bool:
        """Whether some layers keep a recurrent state per request (a hybrid model)."""
        return self.layer_types is not None and "recurrent" in self.layer_types


@dataclass
class ModelFiles:
    """What every loader produces: hyperparameters, weights under HF names (float tensors, deferred
    float32 conversions, or a GGUF file's quantized tensors as `QuantizedTensor`s), the tokenizer."""

    config: ModelConfig
    weights: dict
    tokenizer: "object"


# ---------------------------------------------------------------- values read from files

# Bounds on what a file may claim: far above any real model, far below what would make the loader
# allocate or loop without end before it finds the mistake.
LIMITS = {
    "vocab_size": (1, 1 << 24),
    "hidden_size": (1, 1 << 16),
    "intermediate_size": (1, 1 << 20),
    "num_layers": (1, 1024),
    "num_heads": (1, 1024),
    "num_kv_heads": (1, 1024),
    "head_dim": (2, 1024),
    "max_position": (2, 1 << 40),  # a prompt token and one more
    "sliding_window": (1, 1 << 40),
}


def file_int(where: str, key: str, value, lo: int, hi: int) -> int:
    """An integer a file gives under `key`, within [lo, hi]; else a ModelLoadError naming the key."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{where}: {key} = {value!r}: not an integer")
    if not lo <= value <= hi:
        raise ModelLoadError(f"{where}: {key} = {value}: out of range (expected {lo}..{hi})")
    return value


def file_float(where: str, key: str, value, positive: bool = True) -> float:
    """A finite number a file gives under `key` (positive unless told); else a ModelLoadError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelLoadError(f"{where}: {key} = {value!r}: not a number")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")) or (positive and value <= 0):
        raise ModelLoadError(f"{where}: {key} = {value}: expected a finite{' positive' if positive else ''} number")
    return value


def check_config(where: str, config: ModelConfig, keys: dict[str, str]) -> ModelConfig:
    """Every hyperparameter within LIMITS and consistent with the others; `keys` names each field as
    the file spells it (for the message)."""
    for name, (lo, hi) in LIMITS.items():
        value = getattr(config, name)
        if value is not None or name != "sliding_window":
            setattr(config, name, file_int(where, keys.get(name, name), value, lo, hi))
    if config.num_heads % config.num_kv_heads:
        raise ModelLoadError(
            f"{where}: {keys.get('num_kv_heads')} = {config.num_kv_heads}: "
            f"does not divide {keys.get('num_heads')} = {config.num_heads}"
        )
    if config.head_dim % 2:
        raise ModelLoadError(
            f"{where}: {keys.get('head_dim')} = {config.head_dim}: rotary embeddings need an even head size"
        )
    config.rms_norm_eps = file_float(where, keys.get("rms_norm_eps", "rms_norm_eps"), config.rms_norm_eps)
    rope = config.rope
    rope.theta = file_float(where, keys.get("rope_theta", "rope_theta"), rope.theta)
    rope.factor = file_float(where, keys.get("rope_factor", "rope factor"), rope.factor)
    rope.low_freq_factor = file_float(where, "rope low_freq_factor", rope.low_freq_factor)
    rope.high_freq_factor = file_float(where, "rope high_freq_factor", rope.high_freq_factor)
    rope.original_max_position = file_int(
        where, "rope original_max_position_embeddings", rope.original_max_position, 1, 1 << 40
    )
    if rope.rotary_dim is not None and not (2 <= rope.rotary_dim <= config.head_dim and rope.rotary_dim % 2 == 0):
        raise ModelLoadError(
            f"{where}: partial_rotary_factor gives {rope.rotary_dim} rotated dimensions of {config.head_dim}: "
            "expected an even number in 2..head_dim"
        )
    if rope.scaling_type == "longrope":
        dim = rope.rotary_dim or config.head_dim
        for name in ("short_factor", "long_factor"):
            values = getattr(rope, name)
            if (
                not isinstance(values, list)
                or len(values) != dim // 2
                or not all(isinstance(v, (int, float)) and v > 0 for v in values)
            ):
                raise ModelLoadError(f"{where}: rope_scaling {name}: expected {dim // 2} positive numbers")
        rope.attention_factor = file_float(where, "rope_scaling attention_factor", rope.attention_factor)
    if rope.scaling_type == "yarn":
        rope.attention_factor = file_float(where, "rope_scaling attention_factor", rope.attention_factor)
        rope.beta_fast = file_float(where, "rope_scaling beta_fast", rope.beta_fast)
        rope.beta_slow = file_float(where, "rope_scaling beta_slow", rope.beta_slow)
    if config.moe is not None:
        check_moe(where, config, keys)
    if config.clip_qkv is not None:
        config.clip_qkv = file_float(where, keys.get("clip_qkv", "clip_qkv"), config.clip_qkv)
    if rope.scaling_type == "llama3" and rope.low_freq_factor == rope.high_freq_factor:
        raise ModelLoadError(
            f"{where}: rope low_freq_factor = high_freq_factor = {rope.low_freq_factor}: "
            "llama3 scaling divides by their difference"
        )
    return config


def check_moe(where: str, config: ModelConfig, keys: dict[str, str]) -> None:
    moe = config.moe
    moe.num_experts = file_int(where, keys.get("num_experts", "num_experts"), moe.num_experts, 1, 1 << 12)
    moe.top_k = file_int(where, keys.get("top_k", "num_experts_per_tok"), moe.top_k, 1, moe.num_experts)
    moe.expert_size = file_int(
        where, keys.get("expert_size", "moe_intermediate_size"), moe.expert_size, *LIMITS["intermediate_size"]
    )
    moe.shared_size = file_int(
        where,
        keys.get("shared_size", "shared_expert_intermediate_size"),
        moe.shared_size,
        0,
        LIMITS["intermediate_size"][1],
    )
    if moe.sparse_layers is not None and len(moe.sparse_layers) != config.num_layers:
        raise ModelLoadError(f"{where}: sparse layers: {len(moe.sparse_layers)} given for {config.num_layers} layers")
