"""Small building blocks of the decoder: RMSNorm, rotary position embeddings, linear layers."""

import math

import torch
import torch.nn.functional as F

from .config import RopeConfig


class RMSNorm:
    """weight * x / sqrt(mean(x²) + eps) over the last dimension, in one fused kernel.

    torch has no fused RMSNorm on CPU (F.rms_norm runs ~8 kernels), but layer_norm is one: the
    row [x, -x] has mean 0 and variance mean(x²), so layer_norm of it, with the weight repeated,
    is RMSNorm(x) in its first half. It normalizes in float32 and rounds once to x's dtype.
    """

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight2 = torch.cat((weight, weight))
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        return F.layer_norm(torch.cat((x, x.neg()), dim=-1), (2 * d,), self.weight2, None, self.eps)[..., :d]


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
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
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.float()


class RotaryEmbedding:
    """cos/sin tables for every position up to max_position, indexed by each token's position."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int):
        inv_freq = rope_inverse_frequencies(rope, head_dim)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos()
        self.signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)

    def to(self, device):
        self.cos, self.signed_sin = self.cos.to(device), self.signed_sin.to(device)
        return self

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ([-sin, sin] over the two halves) of each token's position, shaped
        [T, 1, D] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated in HF's rotate-half layout, computed in float32, returned in x's dtype.

    rotate_half(x) = [-x2, x1] = roll(x, D/2) * [-1, 1]; the sign lives in `signed_sin`.
    """
    x32 = x.float()
    return torch.addcmul(x32 * cos, x32.roll(x.shape[-1] // 2, dims=-1), signed_sin).to(x.dtype)


class Linear:
    """y = x W^T (+ b), with the compute path chosen by batch shape.

    A dense weight in the model's dtype serves every batch. When the file stored the weight as
    4-bit blocks and the model runs in bfloat16, those blocks are also kept packed for torch's
    int4 weight-only kernel, which reads a quarter of the bytes: it wins when few rows are
    multiplied (a decode step of one or a few requests is bound by reading weights), and loses
    to the dense bf16 GEMM beyond `int4_max_rows`. The output head (stored as 8-bit blocks in
    the default model) can likewise keep a per-channel int8 copy.
    """

    int4_max_rows = 4
    # batch-invariant mode: the dense GEMM in calls of at most this many rows. oneDNN's bf16 GEMM
    # computes a row the same way for every M up to 32 and switches blocking beyond (measured on
    # AMX and AVX-512 CPUs), so a row's logits would otherwise depend on how many rows share it.
    INVARIANT_ROWS = 32
    row_chunk: int | None = None

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None = None, int4=None, int8: bool = False):
        """weight None: the 4-bit form is the only one, used for every row count (batch-invariant mode)."""
        if weight is None and int4 is None:
            raise ValueError("Linear needs a dense weight or a 4-bit one")
        self.weight = weight
        self.bias = bias
        self.int4 = None
        self.int8 = None
        if int8:
            # per-output-channel int8 (torch's int8 weight-only kernel): half the bytes of bf16
            scale = weight.float().abs().amax(dim=1).clamp(min=1e-8) / 127.0
            q = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
            self.int8 = (q, scale.to(weight.dtype))
        if int4 is not None:
            device = int4.q.device if weight is None else weight.device
            # torch's layout: packed [N, K/8] ints and [K/32, N, 2] (scale, zero) pairs
            self.int4 = (
                torch.ops.aten._convert_weight_to_int4pack_for_cpu(int4.q.to(device=device, dtype=torch.int32), 1),
                torch.stack([int4.scale.t(), int4.zero.t()], dim=-1).contiguous().to(device=device, dtype=torch.bfloat16),
                int4.GROUP,
            )

    def stored_forms(self) -> list[tuple[torch.Tensor, str]]:
        """Every tensor this layer keeps, with the type its bytes are counted under."""
        forms = [(t, str(t.dtype).removeprefix("torch.")) for t in (self.weight, self.bias) if t is not None]
        if self.int4 is not None:
            forms += [(self.int4[0], "int4"), (self.int4[1], "int4")]  # the packed values and their scales
        if self.int8 is not None:
            forms += [(self.int8[0], "int8"), (self.int8[1], "int8")]
        return forms

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None and x.shape[0] <= self.int4_max_rows:
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), *self.int8)
            return y if self.bias is None else y + self.bias
        if self.int4 is not None and (self.weight is None or x.shape[0] <= self.int4_max_rows):
            packed, scales_zeros, group = self.int4
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed, group, scales_zeros)
            return y if self.bias is None else y + self.bias
        if self.row_chunk is not None and x.shape[0] > self.row_chunk:
            return torch.cat([F.linear(part, self.weight, self.bias) for part in x.split(self.row_chunk)])
        return F.linear(x, self.weight, self.bias)
