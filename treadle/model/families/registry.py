"""Model classes by architecture name (vLLM's model registry).

An architecture name is what a model file calls itself: GGUF's `general.architecture`, config.json's
`model_type`, or one of config.json's `architectures` class names. Each maps to "package.module:Class",
imported on first use, so the registry is plain strings that a child process can be handed
(`registered_architectures` -> `restore_registry`).

A family is one module with a subclass of `interface.CausalLM` and one line here (`_registry`);
plugins add architectures: a module named in TREADLE_PLUGINS (comma-separated) or an entry point of
group `treadle.plugins` calls `register_model` when imported (an entry point's object is also called,
if callable). Every lookup loads the plugins first, once per process.
"""

import importlib
import os
from importlib.metadata import entry_points

from treadle.model.config import ModelLoadError

PLUGINS_ENV = "TREADLE_PLUGINS"
PLUGINS_GROUP = "treadle.plugins"

# The built-in families: architecture name -> model class (each reads its own config: CausalLM).
BUILTIN = {
    "llama": "treadle.model.families.llama:LlamaModel",
    "mistral": "treadle.model.families.llama:MistralModel",
    "qwen2": "treadle.model.families.llama:Qwen2Model",
    "qwen3": "treadle.model.families.llama:Qwen3Model",
    "gemma2": "treadle.model.families.gemma2:Gemma2Model",
    "gemma3": "treadle.model.families.gemma3:Gemma3Model",
    "gemma3_text": "treadle.model.families.gemma3:Gemma3Model",
    "phi3": "treadle.model.families.phi3:Phi3Model",
    "qwen3_moe": "treadle.model.families.qwen_moe:Qwen3MoeModel",
    "qwen3moe": "treadle.model.families.qwen_moe:Qwen3MoeModel",
    "qwen2_moe": "treadle.model.families.qwen_moe:Qwen2MoeModel",
    "qwen2moe": "treadle.model.families.qwen_moe:Qwen2MoeModel",
    "mixtral": "treadle.model.families.mixtral:MixtralModel",
    "olmoe": "treadle.model.families.olmoe:OlmoeModel",
    "bamba": "treadle.model.families.bamba:BambaModel",
    "granitemoehybrid": "treadle.model.families.granite_hybrid:GraniteHybridModel",
    "granitehybrid": "treadle.model.families.granite_hybrid:GraniteHybridModel",  # llama.cpp's name for both hybrids' files
}
# config.json `architectures` class names of the built-in families -> their model_type.
HF_CLASS_NAMES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "BambaForCausalLM": "bamba",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
}
# Registered names no GGUF file carries: llama.cpp writes Mistral and Mixtral models as "llama",
# Gemma 3's text model as "gemma3", the Qwen MoEs as "qwen2moe" / "qwen3moe", and class names are
# config.json's.
NOT_GGUF_ARCHITECTURES = (
    "mistral",
    "mixtral",
    "gemma3_text",
    "qwen2_moe",
    "qwen3_moe",
    "bamba",  # llama.cpp writes both as "granitehybrid"
    "granitemoehybrid",
    *HF_CLASS_NAMES,
)

_registry: dict[str, str] = {**BUILTIN, **{cls: BUILTIN[arch] for cls, arch in HF_CLASS_NAMES.items()}}
_classes: dict[str, type] = {}  # imported targets, by "module:Class"
_plugins_loaded = False


def register_model(arch: str, target: str | type) -> None:
    """target: "package.module:Class" (imported on first use) or the class itself."""
    if isinstance(target, type):
        if target.__module__ == "__main__" or "<locals>" in target.__qualname__:
            # the engine core process imports the class by name: it must be importable there
            raise ValueError(
                f"register_model({arch!r}, {target.__qualname__}): the class must be importable by name "
                "(defined at the top level of a module other than __main__); or pass 'package.module:Class'"
            )
        target = f"{target.__module__}:{target.__qualname__}"
    elif ":" not in target:
        raise ValueError(f"register_model({arch!r}, {target!r}): expected 'package.module:Class'")
    _registry[arch] = target


def is_registered(arch: str) -> bool:
    load_plugins()
    return arch in _registry


def registered_architectures() -> dict[str, str]:
    """A snapshot, name -> "module:Class", to hand to another process."""
    load_plugins()
    return dict(_registry)


def restore_registry(entries: dict[str, str]) -> None:
    """Apply a snapshot from `registered_architectures` (in a child process)."""
    for arch, target in entries.items():
        register_model(arch, target)


def resolve_model_class(arch: str) -> type:
    load_plugins()
    target = _registry.get(arch)
    if target is None:
        raise ModelLoadError(f"architecture {arch!r}: not registered (registered: {', '.join(sorted(_registry))})")
    if target not in _classes:
        module_name, _, qualname = target.partition(":")
        try:
            obj = importlib.import_module(module_name)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ModelLoadError(f"architecture {arch!r}: cannot import {target}: {e}") from e
        from treadle.model.families.interface import CausalLM  # torch: only once a model is built

        if not (isinstance(obj, type) and issubclass(obj, CausalLM)):
            raise ModelLoadError(f"architecture {arch!r}: {target} is not a subclass of treadle.model.families.interface.CausalLM")
        _classes[target] = obj
    return _classes[target]


def load_plugins() -> None:
    """Import every plugin once; a failing plugin raises (naming it) on every call until fixed."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True  # a plugin that looks up the registry while importing must not recurse
    try:
        for name in filter(None, (n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(","))):
            try:
                importlib.import_module(name)
            except Exception as e:
                raise ModelLoadError(f"plugin {name!r} (from {PLUGINS_ENV}): cannot import: {e}") from e
        for ep in entry_points(group=PLUGINS_GROUP):
            try:
                obj = ep.load()
                if callable(obj):
                    obj()
            except Exception as e:
                raise ModelLoadError(f"plugin {ep.name!r} ({ep.value}, entry point group {PLUGINS_GROUP}): failed: {e}") from e
    except BaseException:
        _plugins_loaded = False
        raise
