"""One entry point for every model source: None (the embedded default), a GGUF path, an HF folder."""

import os

from .config import ModelFiles, ModelLoadError
from .default_model import default_model_path
from .gguf_loader import load_gguf
from .hf_loader import load_hf_folder


def resolve_model_path(model: str | None) -> str:
    return default_model_path() if model is None else os.path.expanduser(model)


def load_model_files(model: str | None, keep_int4: bool = False) -> ModelFiles:
    """keep_int4: also return a GGUF's Q4_0/Q4_1 weights as 4-bit blocks (only when they will be used)."""
    path = resolve_model_path(model)
    if os.path.isdir(path):
        return load_hf_folder(path)
    if os.path.isfile(path):
        return load_gguf(path, keep_int4)
    raise ModelLoadError(f"{path}: no such file or folder (expected a .gguf file or a Hugging Face model folder)")
