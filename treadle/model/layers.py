"""Small building blocks of the decoder: RMSNorm, rotary position embeddings, linear layers."""

import math

import torch
import torch.nn.functional as F

from treadle.model.config import RopeConfig
from treadle.model.kernels import rowops
from treadle.model.kernels.quant import QuantizedTensor, quant_matmul_op
from treadle.model.kernels.quant import matmul as quant_matmul


class RMSNorm:
    """weight * x / sqrt(mean(x²) + eps) over the last dimension, in one fused kernel.

    torch has no fused RMSNorm on CPU (F.rms_norm runs ~8 kernels), but layer_norm is one: the
    row [x, -x] has mean 0 and variance mean(x²), so layer_norm of it, with the weight repeated,
    is RMSNorm(x) in its first half. It normalizes in float32 and rounds once to x's dtype.

    bfloat16 rows on the CPU take treadle's C kernel instead (kernels/rowops.c: the sum of squares
    in a fixed order, one rounding; one call where the trick is four operations).
    """

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight2 = torch.cat((weight, weight))
        self.weight = self.weight2[: weight.shape[0]]  # the C kernel's (a view: no second copy)
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        if rowops.usable(x):
            out = rowops.rms_norm(x, self.weight, self.eps)
            if out is not None:
                return out
        return F.layer_norm(torch.cat((x, x.neg()), dim=-1), (2 * d,), self.weight2, None, self.eps)[..., :d]


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int, positions: int | None = None) -> torch.Tensor:
    """The inverse frequencies of a `head_dim`-wide rotation (the rotated part of a head). longrope
    takes its long factors where the engine uses positions beyond the original context
    (`positions`: how many; as vLLM and llama.cpp decide it, once, not per sequence as transformers)."""
    if rope.scaling_type == "longrope":
        ext = rope.long_factor if positions is not None and positions > rope.original_max_position else rope.short_factor
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * rope.theta**shape)  # as transformers computes it
    if rope.scaling_type == "yarn":
        return yarn_inverse_frequencies(rope, head_dim)
    theta = rope.theta
    if rope.scaling_type == "dynamic" and positions is not None and positions > rope.original_max_position:
        # dynamic NTK's base for a sequence of `positions` (transformers' formula, taken once for the engine's length)
        theta = theta * ((rope.factor * positions / rope.original_max_position) - (rope.factor - 1)) ** (head_dim / (head_dim - 2))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # as transformers computes it
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
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
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
    widened to both halves when gathered (`tables`). The full-width tables repeated every value:
    Gemma 3's two ropes at 8,192 positions took 34 MB, a 128K-context model's 134.

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
    if x.dim() == 3 and rowops.usable(x):  # one C call, the same bits (kernels/rowops.c)
        out = rowops.rotary(x, cos, signed_sin)
        if out is not None:
            return out
    if d < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :d], cos, signed_sin), x[..., d:]], dim=-1)
    x32 = x.float()
    return torch.addcmul(x32 * cos, x32.roll(d // 2, dims=-1), signed_sin).to(x.dtype)


class Linear:
    """y = x W^T (+ b) over W's row blocks (`parts`), each stored in the form the file gave it.

    A dense part is a tensor in the model's dtype (`F.linear`). A quantized part is a
    `QuantizedTensor`: the file's GGUF blocks, multiplied by treadle's kernels (kernels/quant.py),
    which read the packed bytes once per call and compute each output row the same way whatever
    the number of rows. Consecutive parts of one form are joined at load (q, k and v become one
    product when the file stores them alike), so a layer is usually one part.
    """

    # batch-invariant mode: the dense GEMM in calls of at most this many rows. oneDNN's bf16 GEMM
    # computes a row the same way for every M up to 32 and switches blocking beyond (measured on
    # AMX and AVX-512 CPUs), so a row's logits would otherwise depend on how many rows share it.
    INVARIANT_ROWS = 32
    row_chunk: int | None = None
    # LoRA (model/lora.py): adapter id -> (A [rank, in], B [out, rank] with the scale folded in),
    # added to the rows of the step that use that adapter (LORA_ROWS). Empty: no adapter here.
    lora: dict | None = None

    def __init__(self, parts, bias: torch.Tensor | None = None):
        parts = list(parts) if isinstance(parts, (list, tuple)) else [parts]
        if not parts:
            raise ValueError("Linear needs a weight")
        joined = [parts[0]]
        for part in parts[1:]:
            last = joined[-1]
            if isinstance(part, QuantizedTensor) and isinstance(last, QuantizedTensor) and part.kind == last.kind:
                joined[-1] = QuantizedTensor.cat([last, part])
            elif not isinstance(part, QuantizedTensor) and not isinstance(last, QuantizedTensor):
                joined[-1] = torch.cat([last, part])
            else:
                joined.append(part)
        self.parts = joined
        self.bias = bias
        # the checkpoint's matrices this layer holds, in its output's order: (name, rows), e.g.
        # ("model.layers.0.self_attn.q_proj", 576); where a LoRA adapter's targets land
        self.sources: list[tuple[str, int]] = []

    @property
    def weight(self) -> torch.Tensor | None:
        """The dense weight, when the layer is one dense part."""
        return self.parts[0] if len(self.parts) == 1 and not isinstance(self.parts[0], QuantizedTensor) else None

    @property
    def quantized(self) -> bool:
        return any(isinstance(p, QuantizedTensor) for p in self.parts)

    def stored_forms(self) -> list[tuple[torch.Tensor, str]]:
        """Every tensor this layer keeps, with the type its bytes are counted under."""
        forms = [(p.data, p.kind) if isinstance(p, QuantizedTensor) else (p, str(p.dtype).removeprefix("torch.")) for p in self.parts]
        if self.bias is not None:
            forms.append((self.bias, str(self.bias.dtype).removeprefix("torch.")))
        return forms

    def rows_apart(self, rows: int) -> bool:
        """Whether x in slices of `rows` rows gives the bits x whole does: quantized parts compute
        each row alone; a dense part does where its products are already cut into row chunks that
        `rows` is a multiple of (batch-invariant mode)."""
        dense = any(not isinstance(p, QuantizedTensor) for p in self.parts)
        return not dense or (self.row_chunk is not None and rows % self.row_chunk == 0)

    def _dense(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.row_chunk is not None and x.shape[0] > self.row_chunk:
            return torch.cat([F.linear(part, weight, bias) for part in x.split(self.row_chunk)])
        return F.linear(x, weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1 and not isinstance(self.parts[0], QuantizedTensor):
            y = self._dense(x, self.parts[0], self.bias)
        else:
            # eager: the kernel itself; under torch.compile: the same kernel as an opaque operator
            product = quant_matmul_op if torch.compiler.is_compiling() else quant_matmul
            outs = [product(x, p.data, p.type_id) if isinstance(p, QuantizedTensor) else self._dense(x, p, None) for p in self.parts]
            y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
            y = y if self.bias is None else y + self.bias
        if self.lora and LORA_ROWS.groups:
            y = self._add_lora(x, y)
        return y

    def float_output(self, x: torch.Tensor) -> torch.Tensor:
        """self(x).float(), the same values; a single quantized part (no bias, no adapters, eager)
        writes them at once, without the [rows, out] array in x's dtype beside them (a 16-row
        step's logits of a 262K-token vocabulary: 8 MB less at its peak)."""
        part = self.parts[0]
        if len(self.parts) == 1 and isinstance(part, QuantizedTensor) and self.bias is None and not (self.lora and LORA_ROWS.groups):
            if x.dtype == torch.bfloat16 and not torch.compiler.is_compiling():
                return quant_matmul(x, part.data, part.type_id, widened=True)
        return self(x).float()

    ARGMAX_ROWS = 16384  # output rows (a vocabulary's tokens) a step's argmax takes at a time: a multiple of 16

    def argmax_ready(self, dtype: torch.dtype) -> bool:
        """Whether `argmax_output` answers for rows of `dtype`: one quantized part, no bias, no
        adapter rows in the step, eager, bf16 or float32 rows."""
        part = self.parts[0]
        if len(self.parts) != 1 or not isinstance(part, QuantizedTensor) or self.bias is not None or (self.lora and LORA_ROWS.groups):
            return False
        return not torch.compiler.is_compiling() and dtype in (torch.bfloat16, torch.float32)

    def argmax_output(self, x: torch.Tensor, transform=None) -> torch.Tensor | None:
        """The first index of each row's maximum of `transform(float_output(x))` (an elementwise
        function, e.g. a soft cap), without the whole [rows, out] array: the output is made
        ARGMAX_ROWS columns at a time from the weight's rows, whose values are those of the whole
        product (each is its own dot product; packed rows come 16 to a group, whole groups taken),
        and the running maximum keeps the first of equals. A 16-row step of a 262K-token vocabulary
        holds 1 MiB of logits rather than 16. None where not `argmax_ready`: the caller takes
        float_output."""
        if not self.argmax_ready(x.dtype):
            return None
        part = self.parts[0]
        best = index = None
        for start in range(0, part.shape[0], self.ARGMAX_ROWS):
            y = quant_matmul(x, part.data[start : start + self.ARGMAX_ROWS], part.type_id, widened=True)
            values, at = (y if transform is None else transform(y)).max(dim=-1)
            if best is None:
                best, index = values, at
                continue
            # a later slice wins on a larger value, or a NaN where the earlier had none (max's rule)
            later = (values > best) | (values.isnan() & ~best.isnan())
            best, index = torch.where(later, values, best), torch.where(later, at + start, index)
        return index

    def _add_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + (x A^T) B^T on each adapter's rows: one low-rank product pair per adapter in the
        step (its rows gathered), in the same row chunks as the dense products, so a row's delta
        does not depend on its batch either."""
        for adapter, rows in LORA_ROWS.groups:
            ab = self.lora.get(adapter)
            if ab is None:
                continue
            a, b = ab
            delta = self._dense(self._dense(x.index_select(0, rows), a, None), b, None)
            y = y.index_add(0, rows, delta.to(y.dtype))
        return y


class LoraRows:
    """The current step's rows per LoRA adapter: [(adapter id, row indices)], set by the runner
    around a forward (model/lora.py); empty outside one, and for steps without adapters."""

    def __init__(self):
        self.groups: list[tuple[int, torch.Tensor]] = []


LORA_ROWS = LoraRows()
