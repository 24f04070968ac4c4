"""Models as a user keeps them: a store directory of named models, pulled from the Hugging Face
hub or a URL, or imported from a local path (store.py); downloads (fetch.py); what a model is,
read without its weights (inspect.py)."""

from treadle.store.inspect import ModelInfo, describe, human_bytes, human_count
from treadle.store.store import (
    ModelStore,
    NotFound,
    StoreError,
    default_models_dir,
    entry_summary,
    full_name,
    parse_ref,
)

__all__ = ["ModelInfo", "ModelStore", "NotFound", "StoreError", "default_models_dir", "describe", "entry_summary",
           "full_name", "human_bytes", "human_count", "parse_ref"]  # fmt: skip
