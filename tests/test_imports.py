"""The import graph of our packages: no cycles between modules, and every import points down the layers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Each package and the packages of ours it may import (besides itself), lowest layer first.
ALLOWED = {
    "configs": set(),
    "contract": {"configs"},
    "cloud": {"configs", "contract"},
    "data_prep": {"configs", "contract"},
    "trainer": {"configs", "contract"},
    "components": {"configs", "contract", "cloud", "data_prep", "trainer"},
    "pipelines": {"configs", "contract", "cloud", "data_prep", "trainer", "components"},
}


def module_names() -> dict[str, Path]:
    """Every module of our packages by dotted name (a package by its own name)."""
    modules = {}
    for package in ALLOWED:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Our modules that `name` imports anywhere in its source (at module level or inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, the module itself.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            # Importing a.b.c runs a, a.b and a.b.c: each of ours is an edge (a module's own package aside).
            found |= {m for i in range(1, len(parts) + 1) if (m := ".".join(parts[:i])) in modules}
    found.discard(name)
    return {m for m in found if not name.startswith(m + ".")}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def test_the_packages_are_found(graph: dict[str, set[str]]) -> None:
    assert {name.split(".")[0] for name in graph} == set(ALLOWED)
    assert "contract.manifest" in graph and "pipelines.cli" in graph


def test_no_import_cycles_between_modules(graph: dict[str, set[str]]) -> None:
    cycles: list[str] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        state[node] = 2
        path.pop()

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_imports_point_down_the_layers(graph: dict[str, set[str]]) -> None:
    wrong = sorted(f"{name} imports {target}" for name, targets in graph.items() for target in targets
                   if (dst := target.split(".")[0]) != (src := name.split(".")[0]) and dst not in ALLOWED[src])
    assert not wrong, "imports against the layer rule:\n" + "\n".join(wrong)
