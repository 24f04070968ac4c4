"""Weights at the file's bits: GGUF's quantized blocks as they are, multiplied by `quant.c`.

`QuantizedTensor` holds one weight's rows of blocks (uint8 [rows, bytes per row]); `matmul` and
`dequantize` run the C kernels on it. A float32 model multiplies with the exact dequantized
weights; a bfloat16 / float16 model quantizes each activation row to int8 per 32 values and takes
integer dot products, as llama.cpp's CPU backend does (see the header of quant.c for the one rule
both follow, for every number of rows).

Instruction sets: AVX-512 VNNI, AVX2 and portable C compute the same bits; the fastest the CPU has
is used unless TREADLE_QUANT_ISA names one (`vnni`, `avx2`, `portable`).
"""

import numpy as np
import torch

from treadle.model.kernels import quant_lib
from treadle.model.kernels.quant_lib import (  # noqa: F401 - quant's names too
    ISAS,
    PACKED,
    PACKED_ISAS,
    TYPES,
    available,
    isa,
    library,
    quantize,
    supported_isas,
)


class QuantizedTensor:
    """A [rows, cols] weight of GGUF blocks of type `kind`, held in the kernels' layout.

    Built from the file's blocks (uint8 [rows, bytes per row]); `data` is the same bytes, moved
    into quant.c's packed layout (rows of every type interleaved 16 at a time) where this process's
    path is VNNI or AVX2, whose kernels read 16 rows at once (`packed`), else as the file has them; the
    same size either way, and `blocks()` gives the file's back. `type_id` carries the layout."""

    __slots__ = ("kind", "data", "shape", "packed")
    KINDS = frozenset(TYPES)

    def __init__(
        self, kind: str, blocks: torch.Tensor | np.ndarray, cols: int, read=None, out: torch.Tensor | None = None
    ):
        """`blocks`: uint8 [rows, bytes per row], a tensor (kept where no repacking is needed) or a
        numpy array, read-only allowed (a file's memory map: read once, into the kernels' layout,
        in pieces; `read(begin, end)` is called with each piece's bytes once they are copied).
        `out`: where to hold them (uint8, that shape, C-contiguous: a part of a joined buffer)."""
        if kind not in TYPES:
            raise ValueError(f"quantized type {kind} is not supported (supported: {', '.join(TYPES)})")
        _, elems, size = TYPES[kind]
        if (
            cols % elems
            or blocks.dtype not in (torch.uint8, np.uint8)
            or blocks.ndim != 2
            or blocks.shape[1] != cols // elems * size
        ):
            raise ValueError(f"{kind} data of shape {tuple(blocks.shape)} does not hold rows of {cols} values")
        self.kind = kind
        self.shape = torch.Size((blocks.shape[0], cols))
        self.packed = isa() in PACKED_ISAS
        if out is not None and (
            out.dtype != torch.uint8 or tuple(out.shape) != tuple(blocks.shape) or not out.is_contiguous()
        ):
            raise ValueError(
                f"{kind} data of shape {tuple(blocks.shape)} cannot be held in a buffer of shape {tuple(out.shape)}"
            )
        if isinstance(blocks, np.ndarray):
            blocks = np.ascontiguousarray(blocks)
            into = None if out is None else out.numpy()
            if self.packed:
                self.data = torch.from_numpy(quant_lib.pack(blocks, TYPES[kind][0], cols, read, into))
            else:
                into = np.empty(blocks.shape, dtype=np.uint8) if into is None else into
                quant_lib.copy_rows(blocks, into, lambda source, rows: np.copyto(rows, source), read)
                self.data = torch.from_numpy(into)
            if out is not None:
                self.data = out  # the buffer's view itself (its base, which QuantizedTensor.cat joins on)
        else:
            blocks = blocks.contiguous()
            self.data = _pack(blocks, TYPES[kind][0], cols, to_file=False, out=out) if self.packed else blocks
            if out is not None and not self.packed:
                self.data = out.copy_(blocks)

    @classmethod
    def from_packed(cls, kind: str, data: torch.Tensor, cols: int) -> "QuantizedTensor":
        """A weight whose blocks are already in this process's packed layout (`quant_lib.pack`,
        made ahead of the load by model/gguf_prefetch.py)."""
        _, elems, size = TYPES[kind]
        if (
            isa() not in PACKED_ISAS
            or data.dtype != torch.uint8
            or data.dim() != 2
            or not data.is_contiguous()
            or cols % elems
            or data.shape[1] != cols // elems * size
        ):
            raise ValueError(
                f"{kind} packed data of shape {tuple(data.shape)} does not hold rows of {cols} values here"
            )
        out = cls.__new__(cls)
        out.kind, out.shape, out.packed, out.data = kind, torch.Size((data.shape[0], cols)), True, data
        return out

    @property
    def type_id(self) -> int:
        """The kernels' type argument: the GGUF type, `| PACKED` for the packed layout."""
        return TYPES[self.kind][0] | (PACKED if self.packed else 0)

    def nbytes(self) -> int:
        return self.data.numel()

    def blocks(self) -> torch.Tensor:
        """The file's blocks, uint8 [rows, bytes per row]."""
        return _pack(self.data, self.type_id, self.shape[1], to_file=True) if self.packed else self.data

    def rows(self, ids: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` (all when None) dequantized, exactly as gguf.quants.dequantize, in `dtype`."""
        return dequantize(self.data, self.type_id, self.shape[1], ids, dtype)

    def float(self) -> torch.Tensor:
        return self.rows()

    def to(self, device=None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense weight (where a consumer cannot use the blocks: another device, a norm)."""
        return self.rows(dtype=dtype or torch.float32).to(device=device)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.data, self.type_id)

    def index_rows(self, index) -> "QuantizedTensor":
        """The rows `index` (a permutation or slice) as a new tensor: whole blocks moved, values unchanged."""
        return QuantizedTensor(self.kind, self.blocks()[index], self.shape[1])

    @staticmethod
    def cat(parts: list["QuantizedTensor"]) -> "QuantizedTensor":
        """Parts of one kind and width, their rows one after another: a view where the parts lie
        so in one buffer (the load's joined tensors, gguf_prefetch.JOINED), else a copy."""
        first = parts[0]
        if all(p.packed == first.packed for p in parts) and (
            not first.packed or all(p.shape[0] % 16 == 0 for p in parts[:-1])
        ):
            # the stored bytes one after another are the whole's layout: the file's rows as they
            # are, or whole 16-row groups with the last part's N % 16 rows at the end
            out = QuantizedTensor.__new__(QuantizedTensor)
            out.kind, out.packed = first.kind, first.packed
            out.shape = torch.Size((sum(p.shape[0] for p in parts), first.shape[1]))
            base = first.data._base
            adjacent = all(a.data.data_ptr() + a.data.numel() == b.data.data_ptr() for a, b in zip(parts, parts[1:]))
            if (
                base is not None
                and base.dim() == 2
                and base.is_contiguous()
                and adjacent
                and (first.data.data_ptr() - base.data_ptr()) % base.shape[1] == 0
                and all(
                    p.data._base is base and p.data.is_contiguous() and p.data.shape[1] == base.shape[1] for p in parts
                )
            ):
                row = (first.data.data_ptr() - base.data_ptr()) // base.shape[1]
                out.data = base[row : row + out.shape[0]]
            else:
                out.data = torch.cat([p.data for p in parts])
            return out
        return QuantizedTensor(first.kind, torch.cat([p.blocks() for p in parts]), first.shape[1])


def mxfp4_from_hf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A Hugging Face MXFP4 weight (gpt-oss's `*_blocks`, uint8 [..., G, 16], and `*_scales`,
    uint8 [..., G]) as GGUF's MXFP4 blocks, uint8 [..., G * 17]: rows of G * 32 values, what
    `QuantizedTensor("MXFP4", ...)` takes. Only bits move (llama.cpp's converter writes the same
    bytes): the scale byte is the same E8M0 exponent (transformers' 2^(s - 127) times the FP4 value
    is ggml's 2^(s - 128) times its doubled table) and the 4-bit codes index the same table; the
    order within a block changes, from value 2i in byte i's low nibble and 2i + 1 in its high one
    (transformers' `convert_moe_packed_tensors`) to value j in byte j's low nibble and j + 16 in its
    high one (ggml's `block_mxfp4`). gpt-oss's fused `gate_up_proj` interleaves its rows (gate
    rows 0, 2, ..., up rows 1, 3, ...): a caller splits them (rows ::2 and 1::2) before or after."""
    if (
        blocks.dtype != torch.uint8
        or scales.dtype != torch.uint8
        or blocks.dim() < 2
        or blocks.shape[-1] != 16
        or tuple(scales.shape) != tuple(blocks.shape[:-1])
    ):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} ({blocks.dtype}) and scales {tuple(scales.shape)} ({scales.dtype}): "
            "expected uint8 [..., G, 16] and uint8 [..., G]"
        )
    out = torch.empty((*blocks.shape[:-1], 17), dtype=torch.uint8, device=blocks.device)
    out[..., 0] = scales
    first, second = blocks[..., :8], blocks[..., 8:]  # values 0 .. 15 (two a byte), values 16 .. 31
    # GGUF byte 1 + j holds value j (low nibble) and j + 16 (high): for j = 2i value 2i is the low
    # nibble of first[i], for j = 2i + 1 value 2i + 1 is its high nibble; values 16 + j alike in second
    out[..., 1::2] = (first & 0x0F) | (second << 4)
    out[..., 2::2] = (first >> 4) | (second & 0xF0)
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 17)


def _pack(data: torch.Tensor, type_id: int, cols: int, to_file: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """A weight's blocks into the packed layout, or (to_file) back (a numpy array: quant_lib.pack),
    into `out` where given."""
    out = torch.empty(tuple(data.shape), dtype=torch.uint8) if out is None else out
    if library().treadle_q_pack(type_id, data.data_ptr(), data.shape[0], cols, out.data_ptr(), int(to_file)):
        raise ValueError(f"type {type_id}: cannot hold rows of {cols} values")
    return out


def dequantize(
    data: torch.Tensor, type_id: int, cols: int, ids: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    n = data.shape[0] if ids is None else ids.numel()
    bf16 = dtype == torch.bfloat16
    out = torch.empty((n, cols), dtype=torch.bfloat16 if bf16 else torch.float32)
    if ids is not None:
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        if n and (int(ids.min()) < 0 or int(ids.max()) >= data.shape[0]):
            raise IndexError(f"row index out of range for {data.shape[0]} rows")
    code = library().treadle_q_dequantize(
        type_id,
        data.data_ptr(),
        data.shape[0],
        cols,
        None if ids is None else ids.data_ptr(),
        n,
        out.data_ptr(),
        int(bf16),
    )
    if code:
        raise RuntimeError(f"dequantize: error {code}")
    return out if out.dtype == dtype else out.to(dtype)


_ROW_BYTES = {type_id: (elems, size) for type_id, elems, size in TYPES.values()}


def _row_bytes(type_id: int, cols: int) -> int:
    elems, size = _ROW_BYTES[type_id & ~PACKED]
    return cols // elems * size if cols % elems == 0 else -1


BF16_IN_F32 = 2  # quant.c's output mode: float32 rows of bf16-rounded values
# float32 x of at least this many rows (a prompt chunk) on the vector paths: the weight's exact values
# a slab of SLAB rows at a time (treadle_q_dequantize_t, as its columns) times x in one sgemm, faster
# there than the tiles (docs/benchmarks/quantized-weights.md)
F32_SLAB_MIN_ROWS = 48
SLAB = 256


def matmul(x: torch.Tensor, data: torch.Tensor, type_id: int, widened: bool = False) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, W a QuantizedTensor's `data` [N, bytes per row].
    `widened` (bf16 x): the bf16 result's values in a float32 array, written at once (logits)."""
    N = data.shape[0]
    if x.dim() != 2 or x.stride(-1) != 1:  # [..., K], or strided columns: as rows
        lead = x.shape[:-1]
        return matmul(x.reshape(-1, x.shape[-1]).contiguous(), data, type_id, widened).view(*lead, N)
    # A step's bf16 rows go straight through the checks below to one C call: a decode step makes
    # ~120 of these calls, and the Python around one was most of a small product's time.
    M, K = x.shape
    if data.shape[1] != _row_bytes(type_id, K):
        raise ValueError(
            f"quantized matmul: x has {K} columns, the weight's rows are {data.shape[1]} bytes of type {type_id}"
        )
    if M == 0:
        return x.new_empty((0, N), dtype=torch.float32 if widened and x.dtype == torch.bfloat16 else x.dtype)
    chosen, exact = isa(), x.dtype == torch.float32  # (one isa() a call: a small product's Python is most of its time)
    lib, path = quant_lib.product_library(chosen, exact), ISAS[chosen]
    if x.dtype == torch.float32 and M >= F32_SLAB_MIN_ROWS and type_id & PACKED:
        return _slab_matmul(x, data, type_id, lib, path)
    if x.dtype == torch.float32:
        x32 = x if x.stride(0) == K else x.contiguous()
        y = torch.empty((M, N), dtype=torch.float32)
        code = lib.treadle_q_matmul_f32(type_id, data.data_ptr(), N, K, x32.data_ptr(), M, y.data_ptr(), N, 0, path)
    else:
        xq = x if x.dtype == torch.bfloat16 else x.float()  # the activations the kernel quantizes
        bf16 = int(xq.dtype == torch.bfloat16)
        widened = widened and bf16
        y = torch.empty((M, N), dtype=torch.float32 if widened else xq.dtype)
        out = BF16_IN_F32 if widened else bf16
        code = lib.treadle_q_matmul_q8(
            type_id, data.data_ptr(), N, K, xq.data_ptr(), bf16, xq.stride(0), M, y.data_ptr(), N, out, path
        )
    if code:
        raise RuntimeError(f"quantized matmul: error {code} (type {type_id}, K {K})")
    return y if y.dtype == x.dtype or widened else y.to(x.dtype)


def _slab_matmul(x: torch.Tensor, data: torch.Tensor, type_id: int, lib, path: int) -> torch.Tensor:
    """float32 x [M, K] @ W^T for a weight held packed: each slab of SLAB weight rows dequantized
    exactly (the float32 product's weights) into the columns of a [K, SLAB] buffer, then one sgemm
    (torch's) per slab. The file's exact weights, summed in sgemm's order, not the tiles' scale
    groups: a row's bits may differ from a decode step's (float32 promises no batch invariance;
    transformers' own float32 product on the dequantized file is an sgemm too)."""
    M, K = x.shape
    N = data.shape[0]
    y = torch.empty((M, N), dtype=torch.float32)
    # rows SLAB + 16 floats apart: a power-of-two stride would put the store's every column on a few cache sets
    slab = torch.empty((K, min(SLAB, N) + 16), dtype=torch.float32)
    for n0 in range(0, N, SLAB):
        n1 = min(N, n0 + SLAB)
        code = lib.treadle_q_dequantize_t(type_id, data.data_ptr(), N, K, n0, n1, slab.data_ptr(), slab.shape[1], path)
        if code:
            raise RuntimeError(f"quantized matmul: error {code} (type {type_id}, K {K})")
        y[:, n0:n1] = torch.mm(x, slab[:, : n1 - n0])  # (sgemm straight into y's columns, out=, ran slower)
    return y


@torch.library.custom_op("treadle::quant_matmul", mutates_args=())
def quant_matmul_op(x: torch.Tensor, data: torch.Tensor, type_id: int) -> torch.Tensor:
    """`matmul` as a torch operator (the same C code), so compiled graphs call it as one kernel."""
    return matmul(x, data, type_id)


@quant_matmul_op.register_fake
def _(x, data, type_id):
    return x.new_empty((*x.shape[:-1], data.shape[0]))


@torch.library.custom_op("treadle::quant_rows", mutates_args=())
def quant_rows_op(data: torch.Tensor, type_id: int, cols: int, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a quantized weight, dequantized (an embedding lookup), as a torch operator."""
    return dequantize(data, type_id, cols, ids, dtype)


@quant_rows_op.register_fake
def _(data, type_id, cols, ids, dtype):
    return data.new_empty((ids.numel(), cols), dtype=dtype)
