"""`--quantization q8_0|q4_k|q4_0` (vLLM's flag name): a Hugging Face folder's float weights
quantized at load into GGUF block types, then held and multiplied exactly as a GGUF file's
(`kernels/quant.py`).

Every matrix is quantized (the decoder's projections, the output head and the embedding); norms
and biases stay in the model's dtype. A matrix whose row length is not a whole number of the type's
blocks takes the next type that fits, as llama-quantize does (Q4_K -> Q5_0 when the row is not a
multiple of 256), or stays dense when none does (fewer than 32 values per row).

Q8_0, Q4_0 and Q5_0 round as gguf-py's quantizers do (llama.cpp's reference rounding). Q4_K is
quantized here: per 32 values, scale (max - min) / 15 and minimum -min, the 8 scales and minimums
of a block of 256 then coded in 6 bits against the block's two float16 factors; llama.cpp's
quantizer also searches for scales that lower the error, this one does not. quant.c computes all
four (`quant.quantize`, on torch's threads): the bytes of their numpy forms (`reference_blocks`,
tested), 2-14x faster.
"""

import gguf
import numpy as np
import torch

from treadle.model.config import ModelLoadError
from treadle.model.kernels import quant
from treadle.model.kernels.quant import TYPES, QuantizedTensor
from treadle.model.loading import gguf_prefetch
from treadle.model.loading.deferred import DeferredWeight
from treadle.model.loading.gguf_names import LLAMA_LAYER_TENSORS

CHOICES = {"q8_0": "Q8_0", "q4_k": "Q4_K", "q4_0": "Q4_0"}
FALLBACK = {"Q4_K": "Q5_0"}
# a matrix is quantized about this many values at a time (8 MB in float32, a few times that with
# the quantizer's temporaries), each piece read from the file alone: a load holds the quantized
# blocks, never a whole matrix in float32 (a 1B model's embedding: 1 GB) nor its blocks twice
PIECE_VALUES = 1 << 21


# a layer's matrices the model joins into one product (layers.Linear: consecutive parts of one
# form), quantized into one buffer, one after another: a GGUF file's groups (gguf_prefetch.JOINED)
# under Hugging Face names
JOINED = tuple(tuple(LLAMA_LAYER_TENSORS[name] for name in group) for group in gguf_prefetch.JOINED)


def quantize_weights(weights: dict, quantization: str) -> dict:
    """`weights` (HF names -> float tensors) with every matrix quantized, one at a time; a layer's
    JOINED matrices into one buffer where they share a type and whole 16-row groups precede the
    last (QuantizedTensor.cat then joins them as a view, not a copy)."""
    if quantization not in CHOICES:
        raise ModelLoadError(f"quantization {quantization!r}: expected one of {', '.join(CHOICES)}")
    if not quant.available():
        raise ModelLoadError(
            f"quantization {quantization}: treadle's quantized-weight kernels could not be built here "
            "(a C compiler, cc, is needed)"
        )
    kinds = {}
    for name, tensor in weights.items():
        if isinstance(tensor, QuantizedTensor) or len(tensor.shape) != 2 or 0 in tensor.shape:
            continue  # (an empty matrix is left to the model's shape checks)
        kind = CHOICES[quantization]
        while kind is not None and tensor.shape[1] % TYPES[kind][1]:
            kind = FALLBACK.get(kind)
        if kind is not None:
            kinds[name] = kind
    buffers = {}  # name -> its rows of a joined buffer
    for name in kinds:
        for group in JOINED:
            if not name.endswith("." + group[0]):
                continue
            parts = [name[: -len(group[0])] + part for part in group]
            if all(
                kinds.get(p) == kinds[name] and weights[p].shape[1] == weights[name].shape[1] for p in parts
            ) and all(weights[p].shape[0] % 16 == 0 for p in parts[:-1]):
                _, elems, size = TYPES[kinds[name]]
                joined = torch.empty(
                    (sum(weights[p].shape[0] for p in parts), weights[name].shape[1] // elems * size), dtype=torch.uint8
                )
                row = 0
                for p in parts:
                    buffers[p] = joined[row : row + weights[p].shape[0]]
                    row += weights[p].shape[0]
    for name, kind in kinds.items():
        weights[name] = quantize_matrix(weights[name], kind, out=buffers.get(name))
    return weights


def quantize_matrix(
    weight: "torch.Tensor | DeferredWeight", kind: str, out: torch.Tensor | None = None
) -> QuantizedTensor:
    """A float [rows, cols] matrix (or one still in its file) as rows of `kind` blocks, quantized
    in pieces of whole 16-row groups (each block is quantized alone: the same bytes as at once),
    each piece moved into its rows of the kernels' buffer as it is made (`out`, where given: rows
    of a joined buffer)."""
    rows, cols = weight.shape
    _, elems, size = TYPES[kind]
    data = torch.empty((rows, cols // elems * size), dtype=torch.uint8) if out is None else out
    step = max(16, PIECE_VALUES // cols // 16 * 16)
    pieces = []
    for begin in range(0, rows, step):
        end = min(rows, begin + step)
        piece = weight.rows(begin, end) if isinstance(weight, DeferredWeight) else weight[begin:end].detach().float()
        x = np.ascontiguousarray(piece.cpu().numpy(), dtype=np.float32)
        blocks = quant.quantize(x, kind)  # quant.c: the bytes of the numpy forms below (reference_blocks), faster
        pieces.append(QuantizedTensor(kind, blocks, cols, out=data[begin:end]))
    return QuantizedTensor.cat(pieces)  # a view of `data` (of its base): the pieces lie in it one after another


def reference_blocks(x: np.ndarray, kind: str) -> np.ndarray:
    """The numpy form of quant.c's quantizer (the tests' reference): gguf-py's, or quantize_q4_k."""
    return quantize_q4_k(x) if kind == "Q4_K" else gguf.quants.quantize(x, gguf.GGMLQuantizationType[kind])


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float32 (cols a multiple of 256) -> Q4_K blocks, uint8 [rows, cols / 256 * 144]."""
    rows, cols = x.shape
    sub = x.reshape(-1, 8, 32)  # blocks of 256, 8 groups of 32
    low = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - low) / 15.0
    minimum = -low
    d = np.abs((scale.max(-1) / 63.0).astype(np.float16))  # (never -0: both are at least 0)
    dmin = np.abs((minimum.max(-1) / 63.0).astype(np.float16))
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dminf > 0, np.rint(minimum / dminf), 0).clip(0, 63).astype(np.uint8)
        step = (df * sc)[..., None]  # the dequantized value is step * q - dmin * mn
        q = np.where(step > 0, np.rint((sub + (dminf * mn)[..., None]) / step), 0).clip(0, 15).astype(np.uint8)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(-1, 128)  # 64 values a chunk: groups 2c, 2c+1
    scales = np.empty((sub.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], axis=1)
    return blocks.reshape(rows, cols // 256 * 144)
