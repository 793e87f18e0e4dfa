"""The import graph of our packages: no cycles between modules, and every import points down the layers."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.versions import imports_of

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
# The trainer's sub-packages, lowest first: each may import those before it.
TRAINER = ("model", "params", "train", "hf", "eval")


def module_names() -> list[str]:
    """Every module of our packages by dotted name (a package by its own name)."""
    names = []
    for package in ALLOWED:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return {name: imports_of(name) for name in module_names()}


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


def test_trainer_subpackages_point_down(graph: dict[str, set[str]]) -> None:
    def sub(name: str) -> str:
        return name.split(".")[1] if name.startswith("trainer.") else ""

    assert {sub(name) for name in graph if name.count(".") >= 2 and name.startswith("trainer.")} == set(TRAINER)
    wrong = sorted(f"{name} imports {target}" for name, targets in graph.items() if sub(name) for target in targets
                   if sub(target) and TRAINER.index(sub(target)) > TRAINER.index(sub(name)))
    assert not wrong, "trainer imports against its sub-package order:\n" + "\n".join(wrong)


def test_package_inits_import_nothing() -> None:
    """Importing trainer.X runs trainer/X/__init__.py: empty ones keep each step's code version to what it runs."""
    inits = [p for p in (ROOT / "trainer").rglob("__init__.py") if "import" in p.read_text()]
    assert not inits, f"{inits[0]} imports: a step's code version would then hash more than the step runs"
