"""Versions: what names a step's output, so that it changes exactly when the output would.

A version hashes the step name, the config fields the step declares as changing its output, its
inputs' versions and its code version. The code version hashes the source of the module the step's
work function lives in and of every module of ours it imports, directly or not (imports inside
functions too), so editing a module another step runs leaves this step's version alone.
`configs` is left out: its values are hashed, not its code.
"""

from __future__ import annotations

import ast
import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel

OURS = ("contract", "data_prep", "trainer", "components", "cloud", "pipelines")


def only(section: BaseModel, fields: set[str] | list[str]) -> BaseModel:
    """A copy of `section` holding only `fields`: reading any other raises AttributeError.

    A step's work gets its config this way, so nothing it reads can escape the version's hash.
    """
    return type(section).model_construct(**{name: getattr(section, name) for name in fields})


def plain(value: Any) -> Any:
    """A config value (a section, possibly built by `only`) as JSON-able data."""
    if isinstance(value, BaseModel):
        return value.model_dump(include={k for k in type(value).model_fields if k in value.__dict__})
    return value


def version_of(step: str, config: dict[str, Any], inputs: list[str], code: str) -> str:
    """The content hash that names a step's output (inputs are their versions)."""
    key = {"step": step, "config": {k: plain(v) for k, v in config.items()}, "inputs": inputs, "code": code}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


@cache
def code_version(module: str) -> str:
    """A short hash of the sources of `module` and of every module of ours it imports, transitively."""
    digest = hashlib.sha256()
    for name in modules_run(module):
        digest.update(name.encode())
        digest.update(_source(name).read_bytes())
    return digest.hexdigest()[:12]


@cache
def modules_run(module: str) -> tuple[str, ...]:
    """`module` and the modules of ours it imports, transitively, with their packages' `__init__`s; sorted."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # importing a.b runs a/__init__.py
        todo += _imports(name)
    return tuple(sorted(seen))


ROOT = Path(__file__).resolve().parents[1]  # where our packages sit side by side (the checkout, or site-packages)


def _source(name: str) -> Path:
    """The file of one of our modules, found without importing it."""
    path = ROOT.joinpath(*name.split("."))
    source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    if not source.is_file():
        raise ModuleNotFoundError(f"no module {name} under {ROOT}")
    return source


def _ours(name: str) -> bool:
    return name.split(".")[0] in OURS


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(name: str) -> list[str]:
    """The modules of ours that module `name` imports anywhere in its source."""
    source = _source(name)
    tree = ast.parse(source.read_text())
    package = name if source.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if _ours(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not _ours(base):
                continue
            found.append(base)
            found += [f"{base}.{alias.name}" for alias in node.names if _is_module(f"{base}.{alias.name}")]
    return found
