"""`paged_attention.c`: attention for bfloat16 KV caches with a fixed order of every sum per query
token (see its header), and int8 KV rows' stores. Built with `cc -O3 -march=native` into
~/.cache/treadle/kernels/, keyed by the source, the compiler and the CPU; loaded with ctypes (which
releases the GIL during the call); its loop runs on torch's OpenMP threads. Without a compiler the
engine keeps torch's SDPA (`available()` is False and the log says why once). Importing this
module registers `torch.ops.treadle.paged_attention` (the compiled graphs' form of the call).
"""

import ctypes
import os

import torch

from treadle.model.kernels.build import Library, build


def _build(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The kernel library (extra_flags: a test builds the portable path with -mno-avx512f)."""
    lib = build("paged_attention.c", ["-ffp-contract=off", *extra_flags])
    fn = lib.treadle_paged_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [
        ptr,
        i64,
        ptr,
        ptr,
        i64,
        i64,
        i64,
        i64,
        i64,
        ptr,
        i64,
        ptr,
        ptr,
        ptr,
        ctypes.c_float,
        ctypes.c_float,
        ptr,
        ptr,
        i64,
        i64,
        i64,
        i64,
    ]
    fn.restype = ctypes.c_int
    derived = lib.treadle_paged_attention_derived
    derived.argtypes = fn.argtypes + [ptr, ptr, ptr, i64, i64]
    derived.restype = ctypes.c_int
    store = lib.treadle_store_int8_rows
    store.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, i64]
    store.restype = None
    return lib


_kernel = Library(
    _build,
    "treadle's attention kernel is unavailable (%s): torch's SDPA instead, "
    "and bfloat16 answers may depend on the batch (not batch-invariant)",
)


def available() -> bool:
    return _kernel.available()


def paged_attention(
    q,
    k_cache,
    v_cache,
    tables,
    row_table,
    key_begin,
    key_end,
    scale: float,
    span: int | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    key_weight: torch.Tensor | None = None,
    rot_cos: torch.Tensor | None = None,
    rot_sin: torch.Tensor | None = None,
):
    """Attention of each row q[r] over its keys key_begin[r] .. key_end[r] - 1 (see the C source).
    q: [rows, heads, head_dim] bf16 (heads x head_dim contiguous); caches: [blocks, block_size,
    kv_heads, head_dim] bf16, or int8 KV's [blocks, block_size, kv_heads, head_dim + 4] int8 rows
    (values, then a float32 scale: attention.quantize_kv), each block contiguous (blocks may be a
    page apart: a view into a pool of mixed layers, kv_layout.py); tables: [n, width] int64; row_table,
    key_begin, key_end: [rows] int64; span: the largest key_end - key_begin (computed when not
    given); softcap > 0: scores soft-capped, softcap * tanh(s / softcap); sinks: None, or float32
    [heads], each head's sink logit in the softmax's denominator (gpt-oss); key_weight: None, or
    float32 [head_dim]: the keys are made from the values (Gemma 4's attention_k_eq_v layers hold
    their values once: k_cache is not read), value * key_weight rotated by the float32 tables rot_cos
    / rot_sin [positions, half] at each key's index. Returns [rows, heads, head_dim] bf16."""
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    rows, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty((rows, heads, head_dim), dtype=q.dtype)
    if span is None:
        span = int((key_end - key_begin).max())
    if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (heads,) or not sinks.is_contiguous()):
        raise ValueError(f"attention sinks: expected float32 [{heads}], got {sinks.dtype} {tuple(sinks.shape)}")
    derive = (None, None, None, 0, 0)
    if key_weight is not None:
        for name, t in (("key_weight", key_weight), ("rot_cos", rot_cos), ("rot_sin", rot_sin)):
            if t is None or t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"derived keys: {name} must be a contiguous float32 tensor")
        if key_weight.shape != (head_dim,) or rot_cos.shape != rot_sin.shape or rot_cos.dim() != 2:
            raise ValueError(f"derived keys: weight {tuple(key_weight.shape)}, tables {tuple(rot_cos.shape)}")
        derive = (key_weight.data_ptr(), rot_cos.data_ptr(), rot_sin.data_ptr(), rot_cos.shape[1], rot_cos.shape[0])
    code = _kernel.lib.treadle_paged_attention_derived(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_size, v_cache.stride(0), kv_heads,
        head_dim, heads // kv_heads, tables.data_ptr(), tables.stride(0), row_table.data_ptr(), key_begin.data_ptr(),
        key_end.data_ptr(), scale, softcap, None if sinks is None else sinks.data_ptr(), out.data_ptr(), out.stride(0),
        rows, span, int(k_cache.dtype == torch.int8), *derive,
    )  # fmt: skip
    if code:
        raise RuntimeError(f"paged attention kernel: error {code} (head_dim {head_dim}, group {heads // kv_heads})")
    return out


def store_int8_rows(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write x [tokens, kv_heads, head_dim] (bf16 or float32, each token's heads contiguous) into
    the int8 KV cache [blocks, block_size, kv_heads, head_dim + 4] (each block contiguous) at
    `slots` (int64), as attention.quantize_kv would, bit for bit, in one pass (see the C source)."""
    tokens, heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        x = x.contiguous()
    if head_dim > 512:
        raise ValueError(f"int8 KV rows: head_dim {head_dim} > 512")
    _kernel.lib.treadle_store_int8_rows(
        x.data_ptr(),
        int(x.dtype == torch.bfloat16),
        x.stride(0),
        tokens,
        heads,
        head_dim,
        slots.data_ptr(),
        cache.data_ptr(),
        cache.shape[1],
        cache.stride(0),
    )


@torch.library.custom_op("treadle::paged_attention", mutates_args=())
def paged_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    row_table: torch.Tensor,
    key_begin: torch.Tensor,
    key_end: torch.Tensor,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None = None,
    key_weight: torch.Tensor | None = None,
    rot_cos: torch.Tensor | None = None,
    rot_sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` as a torch operator, for the compiled decode graphs: inductor calls it as
    an opaque kernel (the same C code, so the same bits as the eager path)."""
    if not available():
        raise RuntimeError(f"treadle's attention kernel is unavailable ({_kernel.error})")
    return paged_attention(
        q, k_cache, v_cache, tables, row_table, key_begin, key_end, scale, softcap=softcap, sinks=sinks,
        key_weight=key_weight, rot_cos=rot_cos, rot_sin=rot_sin,
    )  # fmt: skip


@paged_attention_op.register_fake
def _(q, k_cache, v_cache, tables, row_table, key_begin, key_end, scale, softcap, sinks=None, key_weight=None,
      rot_cos=None, rot_sin=None):  # fmt: skip
    return q.new_empty(q.shape)


def unusable_reason(dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Why the kernel cannot serve this model, or None: it takes bfloat16 on the CPU, head_dim a
    multiple of 16 up to 512, at most 16 query heads per KV head, and needs a C compiler."""
    if dtype != torch.bfloat16:
        return f"it computes in bfloat16, not {dtype}"
    if device.type != "cpu":
        return f"it runs on the CPU, not {device}"
    if head_dim % 16 or head_dim > 512 or heads // kv_heads > 16:
        return f"head_dim {head_dim} with {heads // kv_heads} query heads per KV head is not supported"
    if os.environ.get("TREADLE_ATTENTION", "kernel") != "kernel":
        return "TREADLE_ATTENTION is not 'kernel'"
    if not available():
        return f"it could not be built ({_kernel.error})"
    return None


def usable(dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int) -> bool:
    return unusable_reason(dtype, device, heads, kv_heads, head_dim) is None
