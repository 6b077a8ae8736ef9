"""fp8plug's own modules import one another without a cycle.

Why: a cycle makes import order matter (a module half-initialised when its partner reads it), and
it hides a layering mistake: something shared sits too high. Function-local imports, imports under
`typing.TYPE_CHECKING` and `from . import x` all count, since each one is a dependency even where
it does not run at import time. Imports of other packages (torch, accelerate, the engines'
packages) are not edges here. See docs/architecture.md for the layers.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = Path(__file__).resolve().parents[2] / "fp8plug"


def _modules() -> Dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(module: str, path: Path, modules: Dict[str, Path]) -> Set[str]:
    """The fp8plug modules `module` imports anywhere in its source. A package's own __init__
    counts only where a name is taken from it, not as the parent every submodule import loads."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                edges.add(submodule if submodule in modules else base)
    return {name for name in edges if name in modules and name != module}


def import_graph() -> Dict[str, Set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """One import cycle of `graph` as [a, b, ..., a], or [] when there is none."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_sees_relative_function_local_and_type_checking_imports():
    graph = import_graph()
    assert "fp8plug.backends.base" in graph["fp8plug.backends"]  # from .base import ...
    assert "fp8plug.backends.native.engine" not in graph["fp8plug.backends"]  # imported by name, at run time
    assert "fp8plug.layers.rules" in graph["fp8plug.backends.native.engine"]  # from ..convert import ...


def test_fp8plug_modules_import_one_another_without_a_cycle():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)
