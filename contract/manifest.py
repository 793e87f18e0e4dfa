"""The artifact contract: one directory per step output, its payload first and `manifest.json` last.

A manifest is `{kind, version, step, created, code_version, config, inputs, stats}`. `version` is a
short content hash of the step name, the config fields that change the output, the input versions
and the step's code version. A directory without a manifest is incomplete and is never used.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import shutil
from functools import cache
from importlib import import_module
from pathlib import Path
from typing import Any

from configs import UserError

MANIFEST = "manifest.json"


GCS_MOUNT = "/gcs/"  # where Vertex AI mounts Cloud Storage (Cloud Storage FUSE) inside every step and job


def mounted_url(path: str | Path) -> str:
    """The gs:// URL of a path under the Cloud Storage mount; other paths unchanged."""
    path = str(path)
    return "gs://" + path.removeprefix(GCS_MOUNT) if path.startswith(GCS_MOUNT) else path


@cache
def code_version(*packages: str) -> str:
    """A short hash of the Python sources of our packages: a code change gives a new version."""
    digest = hashlib.sha256()
    for package in sorted(packages):
        root = Path(import_module(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def version_of(step: str, config: dict[str, Any], inputs: list[dict[str, Any]], code: str) -> str:
    """The content hash that names a step's output."""
    key = {"step": step, "config": config, "inputs": [i["version"] for i in inputs], "code": code}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def read_manifest(directory: str | Path) -> dict[str, Any] | None:
    """The manifest of a complete artifact, or None when the directory is absent or incomplete."""
    path = Path(directory) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def require_manifest(directory: str | Path, kind: str | None = None) -> dict[str, Any]:
    """The manifest of a complete artifact (of `kind`), or one UserError line saying what is wrong."""
    manifest = read_manifest(directory)
    if manifest is None:
        raise UserError(f"{directory} is not a complete maxpipe artifact (no {MANIFEST})")
    if kind and manifest["kind"] != kind:
        raise UserError(f"{directory} holds a {manifest['kind']} artifact, expected {kind}")
    return manifest


def reference(directory: str | Path) -> dict[str, Any]:
    """How a downstream manifest names an input: kind, version, uri."""
    manifest = require_manifest(directory)
    return {"kind": manifest["kind"], "version": manifest["version"], "uri": str(Path(directory).absolute())}


def prepare_output(directory: str | Path, version: str, keep_partial: bool = False) -> dict[str, Any] | None:
    """Get `directory` ready for a step: the manifest if this version is already complete (a cache hit).

    A complete artifact of another version is never overwritten. An incomplete directory is cleared,
    unless `keep_partial` (training resumes from the checkpoints it holds).
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is not None:
        if manifest["version"] == version:
            return manifest
        raise UserError(
            f"{directory} already holds version {manifest['version']} of {manifest['kind']}; "
            "choose another output directory or delete it"
        )
    if directory.exists() and any(directory.iterdir()) and not keep_partial:
        shutil.rmtree(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return None


def publish(
    directory: str | Path, *, kind: str, step: str, version: str, code: str,
    config: dict[str, Any], inputs: list[dict[str, Any]], stats: dict[str, Any],
) -> dict[str, Any]:
    """Write the manifest last and atomically (temp file + rename): the artifact is now complete."""
    manifest = {
        "kind": kind, "version": version, "step": step,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "code_version": code, "config": config, "inputs": inputs, "stats": stats,
    }
    path = Path(directory) / MANIFEST
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return manifest
