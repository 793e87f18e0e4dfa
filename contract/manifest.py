"""Manifests: one directory per step output, its payload first and `manifest.json` last.

A manifest is `{kind, version, step, created, code_version, config, settings, inputs, stats}`:
`config` holds the fields that version the output (contract/versions.py), `settings` the run
settings that did not, `inputs` the `{kind, version, uri}` of each input. A directory without a
manifest is incomplete and is never used.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
from pathlib import Path
from typing import Any

from configs import UserError

MANIFEST = "manifest.json"
GCS_MOUNT = "/gcs/"  # where Vertex AI mounts Cloud Storage (Cloud Storage FUSE) inside every step and job


def mounted_url(path: str | Path) -> str:
    """The gs:// URL of a path under the Cloud Storage mount; other paths unchanged."""
    path = str(path)
    return "gs://" + path.removeprefix(GCS_MOUNT) if path.startswith(GCS_MOUNT) else path


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


def check_output(directory: str | Path, version: str) -> dict[str, Any] | None:
    """The manifest if `directory` holds this version complete; an error if it holds another; else None."""
    manifest = read_manifest(directory)
    if manifest is not None and manifest["version"] != version:
        raise UserError(
            f"{directory} already holds version {manifest['version']} of {manifest['kind']}; "
            "choose another output directory or delete it"
        )
    return manifest


def clear_partial(directory: str | Path, keep: str) -> None:
    """Remove what an unfinished attempt left in `directory`, except the entry `keep` (the caller's lease)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for entry in directory.iterdir():
        if entry.name != keep:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def publish(
    directory: str | Path, *, kind: str, step: str, version: str, code: str, config: dict[str, Any],
    settings: dict[str, Any], inputs: list[dict[str, Any]], stats: dict[str, Any],
) -> dict[str, Any]:
    """Write the manifest last and atomically (temp file + rename): the artifact is now complete."""
    manifest = {
        "kind": kind, "version": version, "step": step,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "code_version": code, "config": config, "settings": settings, "inputs": inputs, "stats": stats,
    }
    path = Path(directory) / MANIFEST
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return manifest
