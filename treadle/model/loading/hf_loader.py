"""Read a Hugging Face model folder: config.json, *.safetensors, tokenizer files."""

import glob
import json
import math
import os
import struct
import weakref
from typing import TYPE_CHECKING

from treadle.model.config import (
    LIMITS,
    ModelConfig,
    ModelFiles,
    ModelLoadError,
    RopeConfig,
    check_config,
    file_float,
    file_int,
    yarn_mscale,
)
from treadle.model.families.registry import hf_model_type, is_registered, registered_architectures, resolve_model_class
from treadle.text.tokenizer import read_json, tokenizer_from_hf_folder

if TYPE_CHECKING:
    import torch

    from treadle.model.loading.deferred import DeferredWeight


def read_config(folder: str) -> dict:
    """config.json as a dict (no torch: the tokenizer alone needs it too)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{folder}: config.json: missing, not a Hugging Face model folder")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, found {type(config).__name__}")
    return config


def _architecture(folder: str, cfg: dict) -> str:
    """model_type if registered, else the first registered `architectures` class name (a built-in
    family's class name as its model_type)."""
    model_type = cfg.get("model_type")
    if isinstance(model_type, str) and is_registered(model_type):
        return model_type
    classes = cfg.get("architectures") or []
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise ModelLoadError(f"{folder}/config.json: architectures = {classes!r}: expected a list of class names")
    for name in classes:
        if is_registered(name):
            return hf_model_type(name)
    listed = f", architectures = {classes!r}" if classes else ""
    raise ModelLoadError(
        f"{folder}/config.json: model_type = {model_type!r}{listed}: unsupported architecture "
        f"(supported: {', '.join(sorted(registered_architectures()))})"
    )


# ModelConfig's fields as config.json names them (for error messages)
HF_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "max_position": "max_position_embeddings", "sliding_window": "sliding_window",
    "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta", "rope_factor": "rope_scaling.factor",
}  # fmt: skip


class HFConfig:
    """config.json's values as a family's reader takes them: each missing or wrong one a
    ModelLoadError naming the file and the key."""

    def __init__(self, folder: str, cfg: dict, arch: str):
        self.folder, self.cfg, self.arch = folder, cfg, arch
        self.where = f"{folder}/config.json"

    def need(self, key: str):
        if key not in self.cfg:
            raise ModelLoadError(f"{self.where}: {key}: missing")
        return self.cfg[key]

    def get(self, key: str, default=None):
        return self.cfg.get(key, default)

    def section(self, key: str) -> dict:
        value = self.cfg.get(key) or {}
        if not isinstance(value, dict):
            raise ModelLoadError(f"{self.where}: {key} = {value!r}: expected an object")
        return value

    def int(self, key: str, limits: str) -> int:
        return file_int(self.where, key, self.need(key), *LIMITS[limits])

    def rope(self, params: dict, default_theta: float = 10000.0) -> RopeConfig:
        """One RoPE's parameters (rope_parameters, or rope_scaling beside rope_theta)."""
        rope = RopeConfig(theta=params.get("rope_theta", self.cfg.get("rope_theta", default_theta)))
        kind = params.get("rope_type", params.get("type"))
        if kind in ("llama3", "linear"):
            rope.scaling_type = kind
            rope.factor = params.get("factor", 1.0)
            rope.low_freq_factor = params.get("low_freq_factor", 1.0)
            rope.high_freq_factor = params.get("high_freq_factor", 4.0)
            rope.original_max_position = params.get("original_max_position_embeddings", 8192)
        elif kind in ("longrope", "su"):  # "su": Phi-3's first name for it
            rope.scaling_type = "longrope"
            original = params.get("original_max_position_embeddings", self.cfg.get("original_max_position_embeddings"))
            if original is None:
                raise ModelLoadError(f"{self.where}: rope_scaling longrope: original_max_position_embeddings missing")
            original = rope.original_max_position = self._positions(
                "rope_scaling original_max_position_embeddings", original
            )
            rope.short_factor, rope.long_factor = params.get("short_factor"), params.get("long_factor")
            factor = (
                self._factor(params)
                or self._positions("max_position_embeddings", self.cfg.get("max_position_embeddings", original))
                / original
            )
            attention = params.get("attention_factor")
            rope.attention_factor = (
                attention
                if attention is not None
                else (1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original)))
            )
        elif kind == "yarn":
            rope.scaling_type = "yarn"
            context = self._positions("max_position_embeddings", self.need("max_position_embeddings"))
            original = rope.original_max_position = self._positions(
                "rope_scaling original_max_position_embeddings",
                params.get("original_max_position_embeddings") or context,
            )
            factor = self._factor(params) or context / original
            rope.factor = factor
            rope.beta_fast = params.get("beta_fast") or 32.0
            rope.beta_slow = params.get("beta_slow") or 1.0
            rope.truncate = bool(params.get("truncate", True))
            attention = params.get("attention_factor")
            if attention is None:
                mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
                attention = (
                    yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                    if mscale and mscale_all
                    else yarn_mscale(factor)
                )
            rope.attention_factor = attention
        elif kind == "dynamic":
            # dynamic NTK: transformers rescales the base whenever a sequence passes the context;
            # here once, for the engine's length (layers.rope_inverse_frequencies), as vLLM does
            rope.scaling_type = "dynamic"
            rope.factor = self._factor(params) or 1.0
            rope.original_max_position = self._positions(
                "max_position_embeddings", self.need("max_position_embeddings")
            )
        elif kind not in (None, "default"):
            raise ModelLoadError(
                f"{self.where}: rope_scaling type {kind!r}: unsupported "
                "(supported: linear, llama3, longrope, yarn, dynamic)"
            )
        partial = params.get("partial_rotary_factor", self.cfg.get("partial_rotary_factor"))
        if partial is not None and partial != 1.0:
            head_dim = self.cfg.get("head_dim") or self.int("hidden_size", "hidden_size") // self.int(
                "num_attention_heads", "num_heads"
            )
            rope.rotary_dim = int(head_dim * partial)
        return rope

    def _positions(self, key: str, value) -> int:
        return file_int(self.where, key, value, *LIMITS["max_position"])

    def _factor(self, params: dict) -> float | None:
        """rope_scaling's factor, checked; None where the file gives none."""
        factor = params.get("factor")
        return None if factor is None else file_float(self.where, "rope_scaling factor", factor)

    def llama_style(self, config_class=ModelConfig, **fields) -> ModelConfig:
        """The fields every Llama-style config.json gives, `fields` given or overriding; not yet checked."""
        hidden = self.int("hidden_size", "hidden_size")
        heads = self.int("num_attention_heads", "num_heads")
        values = dict(
            architecture=self.arch,
            vocab_size=self.need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=self.need("intermediate_size"),
            num_layers=self.need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=self.cfg.get("num_key_value_heads") or heads,
            head_dim=self.cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=self.cfg.get("rms_norm_eps", 1e-6),
            rope=self.rope(self.section("rope_scaling") or self.section("rope_parameters")),
            max_position=self.cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(self.cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(self.cfg.get("attention_bias", False)),
            sliding_window=self.cfg.get("sliding_window") or None,
            name=os.path.basename(os.path.normpath(self.folder)),
        )
        values.update(fields)
        return config_class(**values)

    def checked(self, config: ModelConfig) -> ModelConfig:
        return check_config(self.where, config, HF_KEYS)


def _config_from_json(folder: str, cfg: dict) -> ModelConfig:
    """The architecture's family reads its own config (`CausalLM.config_from_hf`); every value is
    checked (check_config) before anything is built."""
    arch = _architecture(folder, cfg)
    return resolve_model_class(arch).config_from_hf(HFConfig(folder, cfg, arch))


def load_hf_folder(folder: str) -> ModelFiles:
    from safetensors import SafetensorError

    raw = read_config(folder)
    config = _config_from_json(folder, raw)
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{folder}: *.safetensors: no weight files (treadle reads safetensors only)")
    weights = {}  # name -> DeferredWeight: read when the model takes it
    for path in files:
        try:
            reader = SafetensorsFile(path)
        except ModelLoadError:
            raise
        except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{path}: corrupt or truncated safetensors file: {e}") from e
        for name in reader.entries:
            weights[name] = reader.deferred(name)
    if "lm_head.weight" not in weights and not config.tie_word_embeddings:
        config.tie_word_embeddings = True
    tokenizer = tokenizer_from_hf_folder(folder, raw)
    return ModelFiles(config, weights, tokenizer)


class SafetensorsFile:
    """A .safetensors file's tensors, each read when asked for (or a matrix's rows) from the file
    into memory of its own. The safetensors library checks the header first (every tensor's
    dtype, shape and offsets, the data covering the file exactly); reading here rather than from
    its memory map keeps the pages read out of the process's resident set (a map's read pages
    count there until it is closed: the whole file by the end of a load), and a load never holds
    the whole file's tensors, with their float32 copies, at once."""

    # safetensors' dtype names -> torch's
    DTYPES = {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    }  # fmt: skip

    def __init__(self, path: str):
        import torch  # (this module is imported by the front end, which holds no torch)
        from safetensors import safe_open

        # one descriptor for the reader's life: the header checked and every tensor read are this
        # file's, even if the path is replaced meanwhile (a store's re-pull renames a new one in)
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)
        with safe_open(path, framework="pt") as f:  # the library's checks
            names = list(f.keys())
        opened, checked = os.fstat(self.fd), os.stat(path)
        if (opened.st_dev, opened.st_ino, opened.st_size) != (checked.st_dev, checked.st_ino, checked.st_size):
            raise OSError("the file was replaced while it was opened")
        (length,) = struct.unpack("<Q", self._pread(8, 0))
        header = json.loads(self._pread(length, 8))
        self.path, self.base = path, 8 + length
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        for name in names:
            entry = header[name]
            if entry["dtype"] not in self.DTYPES:
                raise ModelLoadError(
                    f"{path}: tensor {name}: dtype {entry['dtype']} is not one treadle reads ({', '.join(self.DTYPES)})"
                )
            self.entries[name] = (
                getattr(torch, self.DTYPES[entry["dtype"]]),
                tuple(entry["shape"]),
                self.base + entry["data_offsets"][0],
            )

    def _pread(self, size: int, offset: int, into=None) -> bytes:
        """`size` bytes at `offset` (into `into`, a writable buffer, where given): read in as many
        calls as it takes (Linux gives at most ~2 GiB per call; network file systems less)."""
        view = memoryview(bytearray(size) if into is None else into).cast("B")
        done = 0
        while done < size:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got == 0:
                raise OSError("the file ended early (changed while loading?)")
            done += got
        return view.obj if into is None else b""

    def read(self, name: str, begin: int = 0, end: int | None = None) -> "torch.Tensor":
        """The tensor in its stored dtype; rows begin:end of its first dimension, where given."""
        import torch

        dtype, shape, offset = self.entries[name]
        if not shape:
            begin, end, row_shape = 0, 1, ()
        else:
            end, row_shape = shape[0] if end is None else end, shape[1:]
        row_bytes = math.prod(row_shape) * dtype.itemsize
        data = torch.empty((end - begin) * row_bytes, dtype=torch.uint8)
        try:
            self._pread(data.numel(), offset + begin * row_bytes, data.numpy())
        except OSError as e:
            raise ModelLoadError(f"{self.path}: tensor {name}: {e}") from e
        return data.view(dtype).reshape(shape if not shape else (end - begin, *row_shape))

    def deferred(self, name: str) -> "DeferredWeight":

        from treadle.model.loading.deferred import DeferredWeight

        dtype, shape, _ = self.entries[name]
        return DeferredWeight(
            lambda: self.read(name).float(),
            shape,
            stored=lambda: self.read(name),  # (integer tensors too: MXFP4 blocks are taken as their bytes)
            rows=lambda begin, end: self.read(name, begin, end).float(),
            dtype=dtype,
        )
