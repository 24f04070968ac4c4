"""Linear layers: y = x W^T (+ b) over row blocks stored as the file gave them (dense or quantized),
with LoRA deltas on the rows of each adapter."""

import torch
import torch.nn.functional as F

from treadle.model.kernels.quant import QuantizedTensor, quant_matmul_op
from treadle.model.kernels.quant import matmul as quant_matmul


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
        forms = [
            (p.data, p.kind) if isinstance(p, QuantizedTensor) else (p, str(p.dtype).removeprefix("torch."))
            for p in self.parts
        ]
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
            outs = [
                product(x, p.data, p.type_id) if isinstance(p, QuantizedTensor) else self._dense(x, p, None)
                for p in self.parts
            ]
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
        if (
            len(self.parts) == 1
            and isinstance(part, QuantizedTensor)
            and self.bias is None
            and not (self.lora and LORA_ROWS.groups)
        ):
            if x.dtype == torch.bfloat16 and not torch.compiler.is_compiling():
                return quant_matmul(x, part.data, part.type_id, widened=True)
        return self(x).float()

    ARGMAX_ROWS = 16384  # output rows (a vocabulary's tokens) a step's argmax takes at a time: a multiple of 16

    def argmax_ready(self, dtype: torch.dtype) -> bool:
        """Whether `argmax_output` answers for rows of `dtype`: one quantized part, no bias, no
        adapter rows in the step, eager, bf16 or float32 rows."""
        part = self.parts[0]
        if (
            len(self.parts) != 1
            or not isinstance(part, QuantizedTensor)
            or self.bias is not None
            or (self.lora and LORA_ROWS.groups)
        ):
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
