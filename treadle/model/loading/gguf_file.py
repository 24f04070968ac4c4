"""The GGUF container: header, metadata key/values, tensor infos, memory-mapped tensor data.

The `gguf` package's reader builds a numpy view per metadata item, which takes seconds for a
vocabulary of 50k tokens and merges; this parser reads the same layout with `struct` from one
memory map (tens of milliseconds) and leaves dequantization to `gguf.quants`.

Layout (v2/v3, little-endian): b"GGUF", u32 version, u64 tensor count, u64 kv count; kv pairs
(string key, u32 type, value); tensor infos (string name, u32 n_dims, u64 dims[n], u32 type,
u64 offset); tensor data at the next multiple of general.alignment (default 32).
"""

from __future__ import annotations

import math
import mmap
import struct
import sys
from array import array
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from treadle.model.config import ModelLoadError

if TYPE_CHECKING:
    import gguf
    import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# arrays of numbers, read whole with the `array` module (the front end reads metadata without
# numpy, ~15 MB it need not load): GGUF type -> array typecode of that width
_ARRAYS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}
_WIDTHS = {etype: array(code).itemsize for etype, code in _ARRAYS.items()}
_BOOL = 7
_STRING, _ARRAY = 8, 9
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 4  # arrays of arrays
_FLOAT_TYPES = {0: "float32", 1: "float16"}  # ggml type id -> the numpy dtype its data is read as


class GGUFFormatError(ValueError):
    pass


@dataclass
class GGUFTensor:
    """The attributes `gguf`'s ReaderTensor has that the loader uses."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: np.ndarray  # dims, fastest-varying first (GGUF order)
    data: np.ndarray  # floats for F32/F16, else raw bytes shaped [rows, bytes per row]
    n_bytes: int
    offset: int = 0  # of the data in the file


_U64 = struct.Struct("<Q")


class _Cursor:
    def __init__(self, buf):
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """An array of `count` strings (a vocabulary: 262,144 of them for Gemma), read in one loop."""
        buf, pos, end, length = self.buf, self.pos, len(self.buf), _U64.unpack_from
        out = [""] * count
        for i in range(count):
            (n,) = length(buf, pos)
            pos += 8
            if pos + n > end:
                raise GGUFFormatError("string runs past the end of the file")
            out[i] = str(buf[pos : pos + n], "utf-8", "replace")
            pos += n
        self.pos = pos
        return out

    def _array_bytes(self, etype: int, count: int) -> int:
        """The bytes of `count` numbers of type `etype` (for other types, a lower bound: 8 each, a
        string's length), checked against what is left of the file."""
        n = count * _WIDTHS.get(etype, 8)
        if n > len(self.buf) - self.pos:
            raise GGUFFormatError(f"array of {count} elements runs past the end of the file")
        return n

    def skip(self, vtype: int, depth: int = 0) -> None:
        """Past a value without building it (a vocabulary's strings: their lengths are read)."""
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if depth >= MAX_NESTING:
                raise GGUFFormatError(f"arrays nested more than {MAX_NESTING} deep")
            n = self._array_bytes(etype, count)  # checked first: a corrupt count is not walked
            if etype in _ARRAYS:
                self.pos += n
                return
            if etype == _STRING:  # one tight loop over the lengths, as `strings` reads them
                buf, pos, end, length = self.buf, self.pos, len(self.buf), _U64.unpack_from
                for _ in range(count):
                    pos += 8 + length(buf, pos)[0]
                    if pos > end:
                        raise GGUFFormatError("string runs past the end of the file")
                self.pos = pos
                return
            for _ in range(count):
                self.skip(etype, depth + 1)
        elif vtype == _STRING:
            (n,) = _U64.unpack_from(self.buf, self.pos)
            if self.pos + 8 + n > len(self.buf):
                raise GGUFFormatError("string runs past the end of the file")
            self.pos += 8 + n
        else:
            self.value(vtype, depth)

    def value(self, vtype: int, depth: int = 0):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if depth >= MAX_NESTING:
                raise GGUFFormatError(f"arrays nested more than {MAX_NESTING} deep")
            n = self._array_bytes(etype, count)
            if etype in _ARRAYS:
                arr = array(_ARRAYS[etype])
                arr.frombytes(self.buf[self.pos : self.pos + n])
                if sys.byteorder == "big":
                    arr.byteswap()
                self.pos += n
                return [v != 0 for v in arr] if etype == _BOOL else arr.tolist()
            if etype == _STRING:
                return self.strings(count)
            return [self.value(etype, depth + 1) for _ in range(count)]
        raise GGUFFormatError(f"unknown metadata value type {vtype}")


class GGUFFile:
    def __init__(self, path: str, tensors: bool = True, skip: Collection[str] = ()):
        """`infos`: each tensor's (name, dims, ggml type id, offset); `tensors` (tensors=True) their
        data on the map, typed by gguf-py (which loads numpy: a front end reads without them).
        `skip`: metadata keys read past and left out (a description needs no vocabulary)."""
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # empty file
                raise GGUFFormatError(f"cannot map the file: {e}") from None
        buf = memoryview(self._map)
        c = _Cursor(buf)
        where = "header"
        try:
            if bytes(buf[:4]) != b"GGUF":
                raise GGUFFormatError(f"not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
            c.pos = 4
            self.version = c.unpack("<I")
            if self.version not in (2, 3):
                raise GGUFFormatError(f"GGUF version {self.version} is not supported (2, 3)")
            n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
            if n_kv * 13 > len(buf) or n_tensors * 24 > len(buf):  # the smallest key/value and tensor info
                raise GGUFFormatError(
                    f"header claims {n_tensors} tensors and {n_kv} metadata entries; "
                    f"the file ({len(buf)} bytes) cannot hold them"
                )
            self.metadata: dict = {}
            self.skipped: set[str] = set()  # keys of `skip` the file has: present, not read
            for i in range(n_kv):
                where = f"metadata entry {i}"
                key = c.string()
                where = f"metadata {key!r}"
                if key in skip:
                    c.skip(c.unpack("<I"))
                    self.skipped.add(key)
                else:
                    self.metadata[key] = c.value(c.unpack("<I"))
            infos = []
            for i in range(n_tensors):
                where = f"tensor info {i}"
                name = c.string()
                where = f"tensor {name}"
                n_dims = c.unpack("<I")
                if not 1 <= n_dims <= MAX_DIMS:
                    raise GGUFFormatError(f"{n_dims} dimensions (GGUF tensors have 1 to {MAX_DIMS})")
                dims = [c.unpack("<Q") for _ in range(n_dims)]
                infos.append((name, dims, c.unpack("<I"), c.unpack("<Q")))
        except struct.error as e:
            raise GGUFFormatError(f"truncated header ({where}): {e}") from None
        except GGUFFormatError as e:
            raise GGUFFormatError(f"{where}: {e}") from None
        align = self.metadata.get("general.alignment", 32)
        if isinstance(align, bool) or not isinstance(align, int) or not 1 <= align <= 1 << 20:
            raise GGUFFormatError(f"general.alignment = {align!r}: expected an integer from 1 to {1 << 20}")
        start = -(-c.pos // align) * align
        self.infos = infos
        self.tensors = [self._tensor(buf, start, *info) for info in infos] if tensors else []

    def _tensor(self, buf, start: int, name: str, dims: list[int], type_id: int, offset: int) -> GGUFTensor:
        import numpy as np

        gguf = gguf_constants()  # the type tables (gguf.quants takes its enum values: an IntEnum)

        try:
            qtype = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFFormatError(f"tensor {name}: unknown tensor type id {type_id}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if 0 in dims:
            raise GGUFFormatError(f"tensor {name}: dimension {dims.index(0)} is 0")
        if dims and dims[0] % block:
            raise GGUFFormatError(
                f"tensor {name}: dimension 0 = {dims[0]}: not a multiple of {qtype.name}'s block of {block}"
            )
        n = math.prod(dims)
        n_bytes = n * type_size // block
        begin = start + offset
        if begin + n_bytes > len(buf):
            raise GGUFFormatError(f"tensor {name}: data runs past the end of the file ({len(buf)} bytes): truncated")
        shape = tuple(reversed(dims))
        if type_id in _FLOAT_TYPES:
            data = np.frombuffer(buf, dtype=_FLOAT_TYPES[type_id], count=n, offset=begin).reshape(shape)
        else:
            raw = np.frombuffer(buf, dtype=np.uint8, count=n_bytes, offset=begin)
            data = raw.reshape(shape[:-1] + (shape[-1] // block * type_size,)) if shape else raw
        return GGUFTensor(name, qtype, np.array(dims), data, n_bytes, begin)

    def release(self, tensor: GGUFTensor, begin: int = 0, end: int | None = None, around: bool = False) -> None:
        """Drop the file's pages under this tensor's bytes [begin, end) (all of them by default)
        from the process (they stay in the page cache): once they are copied into their run-time
        form, its mapped pages need not count twice.

        A read fault maps a file's large folios whole (reading a 2.5 KB norm mapped 2 MiB of the
        file here), so the pages before the range go too, back to a 2 MiB boundary (the tensors
        there, in file order, are already copied), and with `around` (a tensor read out of order)
        those after it, to the next boundary; a page still needed is mapped again from the cache."""
        start = (tensor.offset + begin) // FOLIO_SPAN * FOLIO_SPAN
        stop = tensor.offset + (tensor.n_bytes if end is None else end)
        stop = (
            min(len(self._map), -(-stop // FOLIO_SPAN) * FOLIO_SPAN)
            if around
            else stop // mmap.PAGESIZE * mmap.PAGESIZE
        )
        if stop > start and hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_DONTNEED, start, stop - start)


FOLIO_SPAN = 2 << 20  # the largest folio a read fault maps whole (a 2 MiB huge page)


def gguf_constants():
    """gguf-py's `constants` module (the format's type tables) without the package, whose import
    loads numpy and its writers (~22 MB): a front end names a file's types and loads no tensor."""
    if "gguf" in sys.modules:
        return sys.modules["gguf"]
    global _constants
    if _constants is None:
        import importlib.util
        import os

        origin = importlib.util.find_spec("gguf").origin  # the package's __init__.py, not run
        spec = importlib.util.spec_from_file_location(
            "treadle._gguf_constants", os.path.join(os.path.dirname(origin), "constants.py")
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _constants = module
    return _constants


_constants = None


def open_gguf(path: str, tensors: bool = True, skip: Collection[str] = ()) -> GGUFFile:
    """GGUFFile(path, tensors, skip), its failures as a ModelLoadError that names the file."""
    try:
        return GGUFFile(path, tensors, skip)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot open: {e}") from e
    except GGUFFormatError as e:
        raise ModelLoadError(f"{path}: {e}") from None


def read_metadata(path: str) -> dict:
    """The metadata key/values of a GGUF file (the tokenizer needs no tensors)."""
    return open_gguf(path, tensors=False).metadata
