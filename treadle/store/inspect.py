"""What a model file or folder is, read without its weights: architecture, parameter count,
quantization, context length, chat template, license, and its own generation defaults.

Generation defaults, in SamplingParams' names (temperature, top_p, top_k, min_p,
repetition_penalty, max_tokens), come from the model: an HF folder's generation_config.json
(vLLM's `--generation-config auto`), a GGUF file's general.sampling.* keys (llama.cpp's), then the
store's per-model parameter file (params.json, Ollama's PARAMETER lines), later ones winning.
"""

import functools
import json
import math
import os
import re
import struct
from dataclasses import asdict, dataclass, field

# generation_config.json / GGUF general.sampling.* -> SamplingParams field
HF_GENERATION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
GGUF_SAMPLING_FIELDS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
# Ollama's PARAMETER names (a params.json's keys) -> SamplingParams field
OLLAMA_PARAMETERS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
    "num_predict": "max_tokens",
    "stop": "stop",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
DEFAULT_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float,
                  "max_tokens": int, "stop": list, "seed": int,
                  "presence_penalty": float, "frequency_penalty": float}  # fmt: skip
PARAMS_FILE = "params.json"


class InspectError(ValueError):
    pass


@dataclass
class ModelInfo:
    format: str  # "gguf" | "safetensors"
    architecture: str
    parameters: int | None  # weights' element count
    quantization: str  # Q4_K_M, Q8_0, BF16, F32, ...
    context_length: int | None
    size: int  # bytes on disk
    chat_template: str = ""
    license: str = ""
    defaults: dict = field(default_factory=dict)  # generation defaults, SamplingParams' names
    vision: bool = False  # it takes images: a vision tower and an image processor in its folder

    def as_dict(self) -> dict:
        return asdict(self)


def human_count(n: int | None) -> str:
    if not n:
        return ""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def human_bytes(n: int) -> str:
    for unit in ("GB", "MB", "KB"):
        scale = {"GB": 1e9, "MB": 1e6, "KB": 1e3}[unit]
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def checked_defaults(values: dict, where: str) -> dict:
    """Generation defaults with SamplingParams' types, or an InspectError naming the bad one."""
    out = {}
    for key, value in values.items():
        kind = DEFAULT_FIELDS.get(key)
        if kind is None:
            raise InspectError(f"{where}: {key!r} is not a generation parameter ({', '.join(DEFAULT_FIELDS)})")
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)
        elif kind is int and isinstance(value, int) and not isinstance(value, bool):
            out[key] = value
        elif kind is list and isinstance(value, list | str):
            out[key] = [value] if isinstance(value, str) else [str(v) for v in value]
        else:
            raise InspectError(f"{where}: {key} = {value!r} is not a {kind.__name__}")
    return out


def ollama_parameters(values: dict, where: str) -> dict:
    """A params.json in Ollama's names (repeat_penalty, num_predict, ...) -> SamplingParams' names."""
    if not isinstance(values, dict):
        raise InspectError(f"{where}: expected an object of parameters")
    renamed = {}
    for key, value in values.items():
        if key not in OLLAMA_PARAMETERS:
            raise InspectError(f"{where}: unknown parameter {key!r} ({', '.join(OLLAMA_PARAMETERS)})")
        renamed[OLLAMA_PARAMETERS[key]] = value
    return checked_defaults(renamed, where)


def describe(path: str) -> ModelInfo:
    """The model at `path` (a .gguf file or an HF folder), read without its weights."""
    info = _describe_gguf(path) if os.path.isfile(path) else _describe_folder(path)
    params_file = os.path.join(os.path.dirname(path) if os.path.isfile(path) else path, PARAMS_FILE)
    if os.path.isfile(params_file):
        with open(params_file, encoding="utf-8") as f:
            try:
                values = json.load(f)
            except ValueError as e:
                raise InspectError(f"{params_file}: not JSON: {e}") from None
        info.defaults.update(ollama_parameters(values, params_file))
    return info


@functools.lru_cache(maxsize=256)
def _describe_version(path: str, mtime: float) -> ModelInfo | None:
    try:
        return describe(path)
    except (InspectError, OSError):
        return None


def describe_cached(path: str) -> ModelInfo:
    """describe(path), read once per version of the files (a listing asks often); what can be
    said of a model that cannot be read (format by its name, nothing else) where it cannot."""
    try:
        mtime = (
            max(os.path.getmtime(os.path.join(path, n)) for n in os.listdir(path))
            if os.path.isdir(path)
            else os.path.getmtime(path)
        )
    except (OSError, ValueError):
        mtime = 0.0
    found = _describe_version(path, mtime)
    return found or ModelInfo("gguf" if path.endswith(".gguf") else "safetensors", "unknown", None, "", None, 0)


# read past by a description (a 150K-token vocabulary's strings are tens of MB for a moment)
VOCABULARY_KEYS = frozenset(f"tokenizer.ggml.{k}" for k in ("tokens", "merges", "scores", "token_type"))


def _describe_gguf(path: str) -> ModelInfo:
    from treadle.model.config import ModelLoadError
    from treadle.model.loading.gguf_file import gguf_constants, open_gguf

    gguf = gguf_constants()  # the type tables: a server's front end describes its models without numpy
    try:
        f = open_gguf(path, tensors=False, skip=VOCABULARY_KEYS)
    except ModelLoadError as e:
        raise InspectError(str(e)) from None
    meta = f.metadata
    arch = str(meta.get("general.architecture", "unknown"))
    quant = ""
    file_type = meta.get("general.file_type")
    if isinstance(file_type, int):
        try:
            quant = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
        except ValueError:
            quant = ""
    if not quant:  # no file type written: the most common type among the layers' matrices (llama.cpp's meaning)
        counts: dict[str, int] = {}
        for name, dims, type_id, _ in f.infos:
            if len(dims) >= 2 and name.startswith("blk."):
                try:
                    kind = gguf.GGMLQuantizationType(type_id)
                except ValueError:
                    continue
                block, size = gguf.GGML_QUANT_SIZES[kind]
                counts[kind.name] = counts.get(kind.name, 0) + math.prod(dims) // block * size
        quant = max(counts, key=counts.get) if counts else ""
    defaults = {GGUF_SAMPLING_FIELDS[k]: v for k, v in meta.items() if k in GGUF_SAMPLING_FIELDS}
    ctx = meta.get(f"{arch}.context_length")
    return ModelInfo(
        format="gguf",
        architecture=arch,
        parameters=sum(math.prod(dims) for _, dims, _, _ in f.infos),
        quantization=quant,
        context_length=int(ctx) if isinstance(ctx, int) else None,
        size=os.path.getsize(path),
        chat_template=str(meta.get("tokenizer.chat_template") or ""),
        license=str(meta.get("general.license") or ""),
        defaults=checked_defaults(defaults, f"{path}: general.sampling"),
        vision=_mmproj_beside(path),
    )


def _mmproj_beside(path: str) -> bool:
    """Whether an mmproj file (llama.cpp's image encoder) sits beside the GGUF model: it then sees."""
    from treadle.model.loading.loader import find_mmproj

    return find_mmproj(path, None) is not None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise InspectError(f"{path}: {e}") from None
    if not isinstance(value, dict):
        raise InspectError(f"{path}: expected a JSON object")
    return value


def _safetensors_header(path: str) -> dict:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InspectError(f"{path}: truncated safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 1024 * 1024:
            raise InspectError(f"{path}: safetensors header of {n} bytes")
        try:
            return json.loads(f.read(n))
        except ValueError as e:
            raise InspectError(f"{path}: safetensors header is not JSON: {e}") from None


def _describe_folder(path: str) -> ModelInfo:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise InspectError(f"{path}: no config.json (expected a .gguf file or a Hugging Face model folder)")
    config = _read_json(config_path)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    arch = str(config.get("model_type") or (config.get("architectures") or ["unknown"])[0])
    files = sorted(os.listdir(path))
    n_params, dtypes = 0, {}
    for name in files:
        if name.endswith(".safetensors"):
            for key, t in _safetensors_header(os.path.join(path, name)).items():
                if key != "__metadata__" and isinstance(t, dict):
                    n = math.prod(t.get("shape") or [1])
                    n_params += n
                    dtypes[t.get("dtype", "?")] = dtypes.get(t.get("dtype", "?"), 0) + n
    quant_config = config.get("quantization_config")
    if isinstance(quant_config, dict):
        quant = str(quant_config.get("quant_method", "quantized"))
    elif dtypes:
        quant = max(dtypes, key=dtypes.get)
    else:
        quant = str(config.get("torch_dtype") or config.get("dtype") or "")
    defaults = {}
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        gen = _read_json(gen_path)
        if gen.get("do_sample") is False:
            defaults["temperature"] = 0.0  # greedy is the model's own choice
        for key, name in HF_GENERATION_FIELDS.items():
            value = gen.get(key)
            if value is not None and not (key == "temperature" and "temperature" in defaults):
                defaults[name] = value
    ctx = text.get("max_position_embeddings")
    return ModelInfo(
        format="safetensors",
        architecture=arch,
        parameters=n_params or None,
        quantization=quant.upper() if quant in ("BF16", "F16", "F32", "bf16", "f16", "f32") else quant,
        context_length=int(ctx) if isinstance(ctx, int) else None,
        size=sum(os.path.getsize(os.path.join(path, n)) for n in files if os.path.isfile(os.path.join(path, n))),
        chat_template=_folder_template(path),
        license=_folder_license(path),
        defaults=checked_defaults(defaults, gen_path),
        vision=isinstance(config.get("vision_config"), dict)
        and any(os.path.isfile(os.path.join(path, n)) for n in ("preprocessor_config.json", "processor_config.json")),
    )


def _folder_template(path: str) -> str:
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    tok_config = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(tok_config):
        template = _read_json(tok_config).get("chat_template")
        if isinstance(template, str):
            return template
    return ""


def _folder_license(path: str) -> str:
    """The model card's `license:` (README front matter), else the LICENSE file's first line."""
    readme = os.path.join(path, "README.md")
    if os.path.isfile(readme):
        with open(readme, encoding="utf-8", errors="replace") as f:
            text = f.read(64 * 1024)
        m = re.match(r"---\s*\n(.*?)\n---", text, re.S)
        if m:
            found = re.search(r"^license:\s*(\S.*)$", m.group(1), re.M)
            if found:
                return found.group(1).strip().strip("'\"")
    for name in ("LICENSE", "LICENSE.txt", "LICENSE.md"):
        p = os.path.join(path, name)
        if os.path.isfile(p):
            with open(p, encoding="utf-8", errors="replace") as f:
                return f.readline().strip()
    return ""
