"""The hyperparameters of one Llama-style decoder, whatever file they came from."""

from dataclasses import dataclass, field


class ModelLoadError(ValueError):
    """A model file or folder that treadle cannot load; the message names file, item and reason."""


@dataclass
class RopeConfig:
    theta: float = 10000.0
    # None, "linear" or "llama3" (HF names); llama.cpp's rope_freqs tensor arrives as `freq_factors`.
    scaling_type: str | None = None
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    freq_factors: list[float] | None = None


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
    sliding_window: int | None = None
    name: str = ""


@dataclass
class Int4Weight:
    """A linear weight kept as 4-bit integers in groups of 32 along the input dimension.

    Dequantized value: (q - 8) * scale + zero, which is exactly GGUF's Q4_0 (zero = 0) and Q4_1
    (scale = d, zero = m + 8 d) block formula, so no precision is lost by keeping it this way.
    """

    q: "torch.Tensor"  # [out, in] uint8 in 0..15
    scale: "torch.Tensor"  # [out, in // 32] float32
    zero: "torch.Tensor"  # [out, in // 32] float32

    GROUP = 32


@dataclass
class ModelFiles:
    """What every loader produces: hyperparameters, float32 weights under HF names, the tokenizer,
    and (GGUF only) the 4-bit weights as the file stores them, under the same names."""

    config: ModelConfig
    weights: dict
    tokenizer: "object"
    int4: dict = field(default_factory=dict)
