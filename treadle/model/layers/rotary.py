"""Rotary position embeddings: inverse frequencies (Llama-3, linear, YaRN and longrope scaling),
the cos/sin tables filled as positions are reached, and the rotation (partial rotary included)."""

import math

import torch

from treadle.model.config import RopeConfig
from treadle.model.kernels import rowops


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int, positions: int | None = None) -> torch.Tensor:
    """The inverse frequencies of a `head_dim`-wide rotation (the rotated part of a head). longrope
    takes its long factors where the engine uses positions beyond the original context
    (`positions`: how many; as vLLM and llama.cpp decide it, once, not per sequence as transformers)."""
    if rope.scaling_type == "longrope":
        ext = (
            rope.long_factor if positions is not None and positions > rope.original_max_position else rope.short_factor
        )
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * rope.theta**shape)  # as transformers computes it
    if rope.scaling_type == "yarn":
        return yarn_inverse_frequencies(rope, head_dim)
    theta = rope.theta
    if rope.scaling_type == "dynamic" and positions is not None and positions > rope.original_max_position:
        # dynamic NTK's base for a sequence of `positions` (transformers' formula, taken once for the engine's length)
        theta = theta * ((rope.factor * positions / rope.original_max_position) - (rope.factor - 1)) ** (
            head_dim / (head_dim - 2)
        )
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )  # as transformers computes it
        return inv_freq
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.freq_factors is not None:
        # llama.cpp's rope_freqs tensor: per-frequency divisors (Llama 3 scaling baked in).
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float64)
    elif rope.scaling_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.scaling_type == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.float()


def yarn_inverse_frequencies(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN (arXiv 2309.00071), as transformers computes it: each frequency interpolated by `factor`,
    extrapolated, or blended along a linear ramp between the dimensions that turn `beta_fast` and
    `beta_slow` times over the original context; cos and sin are scaled by `attention_factor`."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class RotaryEmbedding:
    """cos/sin tables for every position up to max_position, indexed by each token's position.

    Each holds the rotation's dim/2 frequencies once ([P, dim/2] float32); a step's rows are
    widened to both halves when gathered (`tables`): full-width tables would repeat every value and
    take twice the memory.

    On the CPU the tables are allocated whole but filled as positions are first reached, FILL
    positions at a time (`cover`): pages never written stay out of the resident set (Gemma 3's
    at 8,192 positions are 16 MiB; a server whose requests reach 1,000 positions holds 2). Each
    block is computed with the same shapes whenever it is filled, so a position's values do not
    depend on when, or in which step, it was first reached. The tensors stay the same objects
    (compiled graphs read them at each call); an eager `tables` fills what its positions need, and
    the runner covers a compiled step's positions before it runs (`CausalLM.cover_positions`).
    Elsewhere (a GPU's memory is not this concern) the tables are filled whole."""

    FILL = 256

    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int):
        dim = rope.rotary_dim or head_dim  # partial rotary embeddings: the first `dim` of each head
        self.inv_freq = rope_inverse_frequencies(rope, dim, max_position)
        self.scale = rope.attention_factor
        self._allocate((max_position, dim // 2), self.inv_freq.device)  # (untouched: not resident until filled)

    def to(self, device):
        device = torch.device(device)
        if device != self.cos.device:
            self.inv_freq = self.inv_freq.to(device)
            self._allocate(self.cos.shape, device)
        if device.type != "cpu":
            self.cover(self.cos.shape[0])
        return self

    def _allocate(self, shape, device) -> None:
        with torch.inference_mode(False):  # normal tensors, which `cover` may fill in or out of inference mode
            self.cos = torch.empty(shape, device=device)
            self.sin = torch.empty(shape, device=device)
        self.filled = 0

    def cover(self, n: int) -> None:
        """Fill the tables through position n - 1 (whole FILL blocks, within the table)."""
        if n <= self.filled:
            return
        size = self.cos.shape[0]
        if n > size:
            raise ValueError(f"position {n - 1} is beyond the rotary tables' {size} positions")
        with torch.no_grad():
            for start in range(self.filled, n, self.FILL):
                t = torch.arange(start, start + self.FILL, dtype=torch.float32, device=self.inv_freq.device)
                freqs = torch.outer(t, self.inv_freq)
                cos, sin = freqs.cos(), freqs.sin()
                if self.scale != 1.0:
                    cos, sin = cos * self.scale, sin * self.scale
                end = min(start + self.FILL, size)
                self.cos[start:end] = cos[: end - start]
                self.sin[start:end] = sin[: end - start]
                self.filled = end

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ([-sin, sin] over the two halves) of each token's position, shaped
        [T, 1, dim] to broadcast over heads."""
        if positions.device.type == "cpu" and positions.numel() and not torch.compiler.is_compiling():
            self.cover(int(positions.max()) + 1)
        cos, sin = self.cos[positions], self.sin[positions]
        return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated in HF's rotate-half layout, computed in float32, returned in x's dtype.

    rotate_half(x) = [-x2, x1] = roll(x, D/2) * [-1, 1]; the sign lives in `signed_sin`. Tables
    narrower than the head (partial rotary embeddings) rotate its first part; the rest passes.
    """
    d = cos.shape[-1]
    # one C call, the same bits (kernels/rowops.c)
    if x.dim() == 3 and rowops.usable(x, (torch.bfloat16, torch.float32)):
        out = rowops.rotary(x, cos, signed_sin)
        if out is not None:
            return out
    if d < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :d], cos, signed_sin), x[..., d:]], dim=-1)
    x32 = x.float()
    return torch.addcmul(x32 * cos, x32.roll(d // 2, dims=-1), signed_sin).to(x.dtype)
