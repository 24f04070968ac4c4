"""The package's import graph: no module imports itself back through others (function-level imports
count: they are deferred, not gone), and the layers keep their direction."""

import ast
import functools
import os
from collections import defaultdict

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "treadle")


@functools.cache
def import_graph(root: str = ROOT) -> dict[str, set[str]]:
    """Module name -> the treadle modules it imports anywhere in its file."""
    modules = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path[:-3], os.path.dirname(root)).replace(os.sep, ".")
                modules[module.removesuffix(".__init__")] = path
    graph = defaultdict(set)
    for module, path in modules.items():
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # a name imported from a module: the module
                    target = target.rpartition(".")[0]
                if target and target != module:
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_circle_remains():
    assert cycles(import_graph()) == []


def imports_of(prefix: str, graph: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """The treadle modules that the modules under `prefix` import, by importing module."""
    graph = import_graph() if graph is None else graph  # (cached: callers must not change it)
    return {m: targets for m, targets in graph.items() if m == prefix or m.startswith(prefix + ".")}


def under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize(
    "lower, upper",
    [
        ("treadle.model", "treadle.engine"),  # the model side runs steps; the engine side schedules them
        ("treadle.engine", "treadle.server"),
        ("treadle.model", "treadle.server"),
        ("treadle.server", "treadle.routing.router"),  # the standalone router runs in front of servers
        ("treadle.server", "treadle.routing.prompts"),
        ("treadle.routing.policy", "treadle.server"),  # the policy and KV index: shared by both
        ("treadle.routing.kv_index", "treadle.server"),
        ("treadle.routing.policy", "treadle.routing.router"),
        ("treadle.routing.kv_index", "treadle.routing.router"),
        ("treadle.text", "treadle.engine"),
        ("treadle.model.families", "treadle.model.execution"),
        ("treadle.model.layers", "treadle.model.execution"),
        ("treadle.model.loading", "treadle.model.execution"),
    ],
)
def test_a_lower_layer_imports_nothing_from_a_higher_one(lower, upper):
    wrong = sorted(f"{m} -> {t}" for m, targets in imports_of(lower).items() for t in targets if under(t, upper))
    assert wrong == []


def imports_outside(prefix: str, into: str, allowed: tuple[str, ...], graph=None) -> list[str]:
    """ "module -> target" for each import by a module under `prefix` of a module under `into` that is
    under none of `allowed`."""
    return sorted(
        f"{m} -> {t}"
        for m, targets in imports_of(prefix, graph).items()
        for t in targets
        if under(t, into) and not under(t, *allowed)
    )


FAMILIES_MAY_IMPORT = (
    "treadle.model.families",
    "treadle.model.layers",
    "treadle.model.kernels",
    "treadle.model.config",
    "treadle.model.loading.gguf_names",
    "treadle.model.loading.gguf_file",  # the GGUF reader: a companion file of the family's (an mmproj)
    "treadle.kv_layout",
)


def test_families_import_layers_the_interface_the_config_and_the_gguf_names_only():
    assert imports_outside("treadle.model.families", "treadle", FAMILIES_MAY_IMPORT) == []


def test_loading_reaches_a_family_only_through_the_registry_and_the_interface():
    gateway = ("treadle.model.families.registry", "treadle.model.families.interface")
    assert imports_outside("treadle.model.loading", "treadle.model.families", gateway) == []


def test_text_imports_of_the_model_only_the_gguf_reader_and_the_load_error():
    allowed = ("treadle.model.loading.gguf_file", "treadle.model.config")
    assert imports_outside("treadle.text", "treadle.model", allowed) == []


def test_the_rules_find_a_wrong_import():
    graph = {
        "treadle.model.families.llama": {"treadle.model.execution.runner", "treadle.model.layers.norm"},
        "treadle.text.tokenizer": {"treadle.engine.core", "treadle.model.loading.loader"},
    }
    wrong = ["treadle.model.families.llama -> treadle.model.execution.runner"]
    assert imports_outside("treadle.model.families", "treadle", FAMILIES_MAY_IMPORT, graph) == wrong
    allowed = ("treadle.model.loading.gguf_file",)
    assert imports_outside("treadle.text", "treadle.model", allowed, graph) == [
        "treadle.text.tokenizer -> treadle.model.loading.loader"
    ]
    assert under("treadle.engine.core", "treadle.engine") and not under("treadle.engine_config", "treadle.engine")


def test_no_two_modules_share_a_base_name():
    """A reader who opens `protocol.py` finds the one there is."""
    names = defaultdict(list)
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py") and name != "__init__.py":
                names[name].append(os.path.relpath(os.path.join(folder, name), os.path.dirname(ROOT)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}


def test_no_function_in_the_server_or_the_cli_is_longer_than_80_lines():
    """Handlers and parsers stay findable and readable: one screen each."""
    paths = [os.path.join(ROOT, "cli.py")] + [
        os.path.join(folder, name)
        for folder, _, files in os.walk(os.path.join(ROOT, "server"))
        for name in files
        if name.endswith(".py")
    ]
    long = []
    for path in paths:
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80:
                long.append(f"{os.path.relpath(path, ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []
