"""Model classes by architecture name (vLLM's model registry).

An architecture name is what a model file calls itself: GGUF's `general.architecture`, config.json's
`model_type`, or one of config.json's `architectures` class names. A family class declares its own
(`CausalLM.hf_model_types`, `hf_architectures`, `gguf_architectures`, as literals in its class body)
and has one line in `FAMILIES`. The registry reads those declarations from the family's source
without importing it (so the front end, which hands the table to its engine core, imports no torch),
and imports a class on its first lookup: the table is plain strings, "package.module:Class", that a
child process can be handed (`registered_architectures` -> `restore_registry`).

Plugins add architectures: a module named in TREADLE_PLUGINS (comma-separated) or an entry point of
group `treadle.plugins` calls `register_model` when imported (an entry point's object is also called,
if callable). Every lookup loads the plugins first, once per process.
"""

import ast
import functools
import importlib
import importlib.util
import os
import re
from importlib.metadata import entry_points

from treadle.model.config import ModelLoadError

PLUGINS_ENV = "TREADLE_PLUGINS"
PLUGINS_GROUP = "treadle.plugins"

# The built-in families, one line each.
FAMILIES = (
    "treadle.model.families.llama:LlamaModel",
    "treadle.model.families.llama:MistralModel",
    "treadle.model.families.llama:Qwen2Model",
    "treadle.model.families.llama:Qwen3Model",
    "treadle.model.families.gemma2:Gemma2Model",
    "treadle.model.families.gemma3:Gemma3Model",
    "treadle.model.families.gemma4:Gemma4Model",
    "treadle.model.families.qwen2_vl:Qwen25VLModel",
    "treadle.model.families.qwen2_vl:Qwen2VLModel",
    "treadle.model.families.qwen3_vl:Qwen3VLModel",
    "treadle.model.families.qwen3_vl:Qwen3VLMoeModel",
    "treadle.model.families.idefics3:Idefics3Model",
    "treadle.model.families.phi3:Phi3Model",
    "treadle.model.families.qwen_moe:Qwen3MoeModel",
    "treadle.model.families.qwen_moe:Qwen2MoeModel",
    "treadle.model.families.mixtral:MixtralModel",
    "treadle.model.families.olmoe:OlmoeModel",
    "treadle.model.families.bamba:BambaModel",
    "treadle.model.families.granite_hybrid:GraniteHybridModel",
    "treadle.model.families.qwen3_next:Qwen3NextModel",
    "treadle.model.families.qwen3_next:Qwen35Model",
    "treadle.model.families.qwen3_next:Qwen35MoeModel",
    "treadle.model.families.gpt_oss:GptOssModel",
)
NAME_FIELDS = ("hf_model_types", "hf_architectures", "gguf_architectures")


@functools.cache
def _module_source(module: str) -> tuple[str, str]:
    origin = importlib.util.find_spec(module).origin
    with open(origin) as f:
        return origin, f.read()


def declared_names(target: str) -> dict[str, tuple[str, ...]]:
    """The names a family class declares in its own body (NAME_FIELDS -> tuple; an absent field is
    empty: names are not inherited), read from its module's source without importing it: each is a
    one-line tuple literal at the class body's indentation (tests check them against the classes)."""
    module, _, qualname = target.partition(":")
    origin, source = _module_source(module)
    indent = "    " * qualname.count(".")
    head = re.search(rf"^{indent}class {re.escape(qualname.rpartition('.')[2])}\b.*:$", source, re.M)
    if head is None:
        raise ModelLoadError(f"{target}: no class {qualname} in {origin}")
    body = re.match(rf"(?:\n(?:{indent}    .*|[ \t]*))*", source[head.end() :]).group(0)
    names = dict.fromkeys(NAME_FIELDS, ())
    for m in re.finditer(rf"^{indent}    ({'|'.join(NAME_FIELDS)})\b[^=\n]*=\s*(\(.*\))", body, re.M):
        names[m.group(1)] = tuple(ast.literal_eval(m.group(2)))
    return names


class _BuiltinTable:
    """The built-in families' names, read once per process on first use."""

    def __init__(self):
        self.by_name: dict[str, str] = {}  # any architecture name -> "module:Class"
        self.gguf: set[str] = set()  # the names a GGUF file carries
        self.model_type_of_class: dict[str, str] = {}  # a config.json class name -> its family's model_type
        for target in FAMILIES:
            names = declared_names(target)
            for field in NAME_FIELDS:
                for name in names[field]:
                    if self.by_name.setdefault(name, target) != target:
                        raise ModelLoadError(f"architecture {name!r}: declared by {self.by_name[name]} and {target}")
            self.gguf.update(names["gguf_architectures"])
            for cls in names["hf_architectures"]:
                self.model_type_of_class[cls] = names["hf_model_types"][0]


_builtin: _BuiltinTable | None = None
_plugins: dict[str, str] = {}  # registered by register_model (plugins, restored snapshots)
_classes: dict[str, type] = {}  # imported targets, by "module:Class"
_plugins_loaded = False


def _table() -> _BuiltinTable:
    global _builtin
    if _builtin is None:
        _builtin = _BuiltinTable()
    return _builtin


def _lookup(arch: str) -> str | None:
    return _plugins.get(arch) or _table().by_name.get(arch)


def gguf_architectures() -> list[str]:
    """The names a GGUF file's `general.architecture` may carry: the built-in families' and every
    registered plugin's."""
    load_plugins()
    return sorted(_table().gguf | set(_plugins))


def hf_model_type(arch: str) -> str:
    """A built-in family's config.json class name -> its model_type; any other name is itself."""
    return _table().model_type_of_class.get(arch, arch)


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
    _plugins[arch] = target


def is_registered(arch: str) -> bool:
    load_plugins()
    return _lookup(arch) is not None


def registered_architectures() -> dict[str, str]:
    """A snapshot, name -> "module:Class", to hand to another process."""
    load_plugins()
    return {**_table().by_name, **_plugins}


def restore_registry(entries: dict[str, str]) -> None:
    """Apply a snapshot from `registered_architectures` (in a child process)."""
    builtin = _table().by_name
    for arch, target in entries.items():
        if builtin.get(arch) != target:
            register_model(arch, target)


def resolve_model_class(arch: str) -> type:
    load_plugins()
    target = _lookup(arch)
    if target is None:
        registered = sorted({*_table().by_name, *_plugins})
        raise ModelLoadError(f"architecture {arch!r}: not registered (registered: {', '.join(registered)})")
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
            raise ModelLoadError(
                f"architecture {arch!r}: {target} is not a subclass of treadle.model.families.interface.CausalLM"
            )
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
                raise ModelLoadError(
                    f"plugin {ep.name!r} ({ep.value}, entry point group {PLUGINS_GROUP}): failed: {e}"
                ) from e
    except BaseException:
        _plugins_loaded = False
        raise
