"""quant.c's library and the instruction-set path this process uses, without torch.

`quant.py` builds on this; an engine core also uses it alone, to repack a GGUF file's tensors
while torch is still importing (model/gguf_prefetch.py).
"""

import ctypes
import logging
import os
import threading

import numpy as np

from treadle.model.kernels.build import build

# name -> (GGUF type id, values per block, bytes per block); quant.c's Q_TYPES must say the same
# (check_block_table, at each library's load).
TYPES = {
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
    "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210),
    "IQ4_NL": (20, 32, 18), "IQ4_XS": (23, 256, 136), "MXFP4": (39, 32, 17),
}  # fmt: skip
ISAS = {"portable": 0, "avx2": 1, "vnni": 2}
log = logging.getLogger("treadle.kernels")

_lock = threading.Lock()
# quant.c is built once per path and product, with those tiles only (TREADLE_Q_TILES: the path's
# width; TREADLE_Q_EXACT: the float32 product's tiles, else the int8 one's): a first start compiled
# all four, ~10 s on 2 cores, where the one it uses takes ~3
TILES = {"vnni": 512, "avx2": 256, "portable": 0}
_libs: dict[tuple[str, bool], ctypes.CDLL] = {}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def _key(path: str, exact: bool | None) -> tuple[str, bool]:
    """The library `path`'s product needs: `exact` for float32 x (None: one already loaded for the
    path, else the product of the engine's default dtype here: float32 without native bf16)."""
    if path == "portable":
        return (path, False)  # no tiles: one library
    if exact is None:
        loaded = [key for key in tuple(_libs) if key[0] == path]  # (a snapshot: another thread may be adding one)
        if loaded:
            return loaded[0]
        flags = _cpu_flags()
        exact = "avx512_bf16" not in flags and "amx_bf16" not in flags
    return (path, exact)


def _variant(path: str, exact: bool | None = None) -> ctypes.CDLL:
    """quant.c's library holding `path`'s kernels for the product (`_key`), built and loaded once."""
    key = _key(path, exact)
    lib = _libs.get(key)
    if lib is None:
        with _lock:
            lib = _libs.get(key)
            if lib is None:
                lib = build(
                    "quant.c",
                    ["-ffp-contract=off", f"-DTREADLE_Q_TILES={TILES[path]}", f"-DTREADLE_Q_EXACT={int(key[1])}"],
                )
                i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
                lib.treadle_q_isa_supported.argtypes = [i32]
                lib.treadle_q_row_bytes.argtypes = [i32, i64]
                lib.treadle_q_row_bytes.restype = i64
                lib.treadle_q_pack.argtypes = [i32, ptr, i64, i64, ptr, i32]
                lib.treadle_q_dequantize.argtypes = [i32, ptr, i64, i64, ptr, i64, ptr, i32]
                lib.treadle_q_matmul_f32.argtypes = [i32, ptr, i64, i64, ptr, i64, ptr, i64, i32, i32]
                lib.treadle_q_dequantize_t.argtypes = [i32, ptr, i64, i64, i64, i64, ptr, i64, i32]
                lib.treadle_q_matmul_q8.argtypes = [i32, ptr, i64, i64, ptr, i32, i64, i64, ptr, i64, i32, i32]
                lib.treadle_q_quantize.argtypes = [i32, ptr, i64, i64, ptr]
                lib.treadle_q_block_geometry.argtypes = [i32, ptr, ptr]
                check_block_table(lib)
                _libs[key] = lib
    return lib


def check_block_table(lib: ctypes.CDLL) -> None:
    """The library's block table (quant.c's Q_TYPES: GGUF id -> values, bytes per block) is TYPES'
    exactly, or the library is refused: a row's bytes computed on one side and read on the other
    must agree."""
    elems, nbytes = ctypes.c_int(), ctypes.c_int()
    found = {}
    for type_id in range(64):  # GGUF's type ids are below 64
        if lib.treadle_q_block_geometry(type_id, ctypes.byref(elems), ctypes.byref(nbytes)) == 0:
            found[type_id] = (elems.value, nbytes.value)
    expected = {type_id: (values, size) for type_id, values, size in TYPES.values()}
    if found != expected:
        raise RuntimeError(f"quant.c's block table {found} is not quant_lib.TYPES' {expected}")


def product_library(path: str, exact: bool) -> ctypes.CDLL:
    """`path`'s library for one product (float32 x: `exact`), as a product asks on its every call:
    one lookup once it is loaded."""
    return _libs.get(_key(path, exact)) or _variant(path, exact)


def library(exact: bool | None = None) -> ctypes.CDLL:
    """quant.c's library for the path in use (`isa`): with the float32 product's tiles (`exact`),
    the int8 one's (False), or either (None: for what every library does, packing, lookups)."""
    return _variant(isa(), exact)


def _likely_path() -> str:
    """The fastest path this CPU's flags (/proc/cpuinfo) suggest: the library built first, which
    then says for certain what the CPU runs (each library can)."""
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c"} <= flags:
        return "vnni"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else "portable"


_unavailable: str | None = None


def available() -> bool:
    """Whether quant.c builds here for the path in use (it needs a C compiler); the reason is
    logged once if not. A TREADLE_QUANT_ISA this CPU cannot run is a ValueError, not a failure
    to build."""
    global _unavailable
    if _unavailable is None:
        try:
            _variant(isa())  # (the path is chosen by asking a library built first: a build too)
            return True
        except ValueError:  # a TREADLE_QUANT_ISA this CPU cannot run: said as it is
            raise
        except Exception as e:  # noqa: BLE001 - any failure: the loader dequantizes instead, which is correct
            _unavailable = f"{type(e).__name__}: {e}"
            log.warning(
                "treadle's quantized-weight kernels are unavailable (%s): "
                "GGUF quantized tensors are dequantized at load "
                "(larger and slower; install a C compiler, cc, to keep them at the file's bits)",
                _unavailable,
            )
    return False


def supported_isas(prefer: str | None = None) -> list[str]:
    """The instruction-set paths this CPU can run, fastest first (asked of a library already
    loaded, else of `prefer`'s or the likely path's, which is then built)."""
    built = tuple(_libs.items())  # (a snapshot: another thread may be adding one)
    lib = next((lib for key, lib in built if key[0] == prefer), None) or (built[0][1] if built else None)
    lib = lib or _variant(prefer if prefer in TILES else _likely_path())
    return [name for name in ("vnni", "avx2", "portable") if lib.treadle_q_isa_supported(ISAS[name])]


_chosen: dict[str | None, str] = {}


def isa() -> str:
    """The path in use: TREADLE_QUANT_ISA if set (it must be supported), else the fastest."""
    forced = os.environ.get("TREADLE_QUANT_ISA")
    if forced in _chosen:
        return _chosen[forced]
    _chosen[forced] = _choose(forced)
    return _chosen[forced]


def _choose(forced: str | None) -> str:
    if forced and forced not in ISAS:  # (before any build)
        raise ValueError(f"TREADLE_QUANT_ISA={forced!r}: expected one of {', '.join(ISAS)}")
    supported = supported_isas(prefer=forced)
    if forced:
        if forced not in supported:
            raise ValueError(
                f"TREADLE_QUANT_ISA={forced!r}: this CPU does not support it (supported: {', '.join(supported)})"
            )
        return forced
    return supported[0]


PACKED = 0x100  # quant.c's flag in a type argument: the weight is held in the packed layout
PACKED_ISAS = ("vnni", "avx2")  # the paths whose kernels read 16 interleaved rows (quant_tiles.h)


COPY_CHUNK_BYTES = 16 << 20  # a large weight is copied in pieces of about this size (`copy_rows`)


def copy_rows(blocks: np.ndarray, out: np.ndarray, copy, done=None) -> None:
    """copy(source rows, out rows) for whole 16-row groups of `blocks` (uint8 [rows, bytes per
    row]) at a time, ~COPY_CHUNK_BYTES each, calling done(begin, end) with the bytes of `blocks`
    each piece has read: a weight read off a file's memory map releases the pages it has copied,
    so that its load never holds a large tensor twice (Gemma 3's 180 MB embedding)."""
    rows, row_bytes = blocks.shape
    step = max(16, COPY_CHUNK_BYTES // max(row_bytes, 1) // 16 * 16)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        copy(blocks[r0:r1], out[r0:r1])
        if done is not None:
            done(r0 * row_bytes, r1 * row_bytes)


QUANTIZED_HERE = ("Q8_0", "Q4_0", "Q5_0", "Q4_K")  # the types quant.c quantizes (`quantize`)


def quantize(x: np.ndarray, kind: str) -> np.ndarray:
    """float32 rows [N, K] (C-contiguous) as `kind`'s blocks, uint8 [N, row bytes]: gguf-py's
    rounding for Q8_0 / Q4_0 / Q5_0 and model/quantize.py's Q4_K, the same bytes as their numpy
    forms (tested), on torch's OpenMP threads."""
    if kind not in QUANTIZED_HERE or x.ndim != 2:
        raise ValueError(f"{kind}: cannot quantize rows of shape {x.shape} here (types: {', '.join(QUANTIZED_HERE)})")
    type_id, elems, size = TYPES[kind]
    out = np.empty((x.shape[0], x.shape[1] // elems * size), dtype=np.uint8)
    if (
        x.dtype != np.float32
        or not x.flags.c_contiguous
        or library().treadle_q_quantize(type_id, x.ctypes.data, x.shape[0], x.shape[1], out.ctypes.data)
    ):
        raise ValueError(f"{kind}: cannot quantize float32 rows of shape {x.shape} here")
    return out


def pack(blocks: np.ndarray, type_id: int, cols: int, done=None, out: np.ndarray | None = None) -> np.ndarray:
    """The file's blocks (uint8 [rows, bytes per row], C-contiguous) in quant.c's packed layout
    (`done`: as copy_rows calls it), written into `out` where given (C-contiguous, the same shape:
    a part of a joined weight, `join_plan`)."""
    out = np.empty(blocks.shape, dtype=np.uint8) if out is None else out

    def pack_rows(source: np.ndarray, into: np.ndarray) -> None:
        if library().treadle_q_pack(type_id, source.ctypes.data, source.shape[0], cols, into.ctypes.data, 0):
            raise ValueError(f"type {type_id}: cannot hold rows of {cols} values")

    copy_rows(blocks, out, pack_rows, done)
    return out
