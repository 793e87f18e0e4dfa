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

OURS = ("configs", "contract", "data_prep", "trainer", "components", "cloud", "pipelines")
UNHASHED = "configs"  # its values are hashed, not its code


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
    parts = module.split(".")
    seen: set[str] = set()
    todo = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]  # importing a.b runs a/__init__.py
    while todo:
        name = todo.pop()
        if name not in seen and not name.startswith(UNHASHED):
            seen.add(name)
            todo += imports_of(name)
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


def imports_of(name: str) -> set[str]:
    """The modules of ours that module `name` imports anywhere in its source (inside functions too), with the
    packages that importing them runs; not `name` itself nor its own packages."""
    source = _source(name)
    package = name if source.name == "__init__.py" else name.rpartition(".")[0]
    targets: list[str] = []
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, the module itself.
            targets += [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in node.names]
    found = set()
    for target in targets:
        if _ours(target):
            parts = target.split(".")
            found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {m for m in found if m != name and not name.startswith(m + ".")}
