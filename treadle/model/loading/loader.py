"""One entry point for every model source: None (the embedded default), a GGUF path, an HF folder.

The loaders are imported when used: `load_tokenizer` (the HTTP front end's only need) imports no torch.
"""

import os

from treadle.model.config import ModelFiles, ModelLoadError
from treadle.model.loading.default_model import default_model_path
from treadle.utils import file_key


def resolve_model_path(model: str | None) -> str:
    return default_model_path() if model is None else os.path.expanduser(model)


def find_mmproj(model: str | None, explicit: str | None) -> str | None:
    """A GGUF model's image encoder file: `explicit` (--mmproj), else the one `*mmproj*.gguf` beside
    the model (llama.cpp's converter names them so; LM Studio and Ollama keep them there, and
    `treadle pull` fetches a repository's with its model), else None."""
    if explicit is not None:
        path = os.path.expanduser(explicit)
        if not os.path.isfile(path):
            raise ModelLoadError(f"--mmproj {explicit}: no such file")
        return path
    path = resolve_model_path(model)
    if not (os.path.isfile(path) and path.endswith(".gguf")):
        return None
    folder = os.path.dirname(path) or "."
    found = sorted(n for n in os.listdir(folder) if "mmproj" in n.lower() and n.endswith(".gguf"))
    return os.path.join(folder, found[0]) if len(found) == 1 else None


def attach_mmproj(files: ModelFiles, model: str | None, explicit: str | None) -> None:
    """Give the model its mmproj file where its family reads one (`CausalLM.mmproj_projectors`); an
    explicit --mmproj the family cannot read is an error, one merely found beside it is left alone."""
    from treadle.model.families.registry import resolve_model_class

    path = find_mmproj(model, explicit)
    if path is None:
        return
    from treadle.model.loading.gguf_file import read_metadata

    kind = read_metadata(path).get("clip.projector_type")
    if kind in resolve_model_class(files.config.architecture).mmproj_projectors:
        files.config.mmproj = path
    elif explicit is not None:
        raise ModelLoadError(
            f"--mmproj {explicit}: a {kind!r} projector, which model {files.config.architecture} does not read"
        )


def _missing(path: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: no such file or folder (expected a .gguf file or a Hugging Face model folder)")


def load_model_files(model: str | None) -> ModelFiles:
    """The model's configuration, weights (a GGUF file's quantized tensors as `QuantizedTensor`s)
    and tokenizer."""
    path = resolve_model_path(model)
    if os.path.isdir(path):
        from treadle.model.loading.hf_loader import load_hf_folder

        return load_hf_folder(path)
    if os.path.isfile(path):
        from treadle.model.loading.gguf_loader import load_gguf

        return load_gguf(path)
    raise _missing(path)


_prebuilt: dict = {}  # (path, size, mtime) -> a Tokenizer built ahead of its first use (prebuild_tokenizer)


def prebuild_tokenizer(model: str | None) -> None:
    """Build the model's tokenizer now, for the next `load_tokenizer` of it to take. A server's
    front end does this before its own imports: a large vocabulary's build has a transient peak
    (Gemma 3's: ~190 MB above its result), which then rises from the process's smallest size
    rather than from its full one. Any failure is left for that `load_tokenizer` to report."""
    key = file_key(resolve_model_path(model))
    if key is None:
        return
    try:
        _prebuilt[key] = load_tokenizer(model)
    except Exception:  # noqa: BLE001 - reported where the server loads the model
        pass


def load_tokenizer(model: str | None):
    """The model's Tokenizer alone: metadata and tokenizer files are read, tensors are not."""
    path = resolve_model_path(model)
    if _prebuilt:
        ready = _prebuilt.pop(file_key(path), None)
        if ready is not None:
            return ready
    if os.path.isdir(path):
        from treadle.model.loading.hf_loader import read_config
        from treadle.text.tokenizer import tokenizer_from_hf_folder

        return tokenizer_from_hf_folder(path, read_config(path))
    if os.path.isfile(path):
        from treadle.text.tokenizer import tokenizer_from_gguf_file

        return tokenizer_from_gguf_file(path)
    raise _missing(path)
