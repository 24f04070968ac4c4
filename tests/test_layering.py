"""The package's import graph: no module imports itself back through others (function-level imports
count: they are deferred, not gone), and the layers keep their direction."""

import ast
import os
from collections import defaultdict

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "treadle")


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


@pytest.mark.parametrize(
    "lower, upper",
    [
        ("treadle.model", "treadle.engine"),  # the model side runs steps; the engine side schedules them
        ("treadle.engine", "treadle.server"),
        ("treadle.model", "treadle.server"),
        ("treadle.server", "treadle.router"),  # the router runs in front of servers
        ("treadle.routing", "treadle.server"),
        ("treadle.routing", "treadle.router"),
    ],
)
def test_a_lower_layer_imports_nothing_from_a_higher_one(lower, upper):
    graph = import_graph()
    wrong = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if m == lower or m.startswith(lower + ".")
        for t in targets
        if t == upper or t.startswith(upper + ".")
    )
    assert wrong == []
