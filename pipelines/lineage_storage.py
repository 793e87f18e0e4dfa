"""What the lineage store indexes and is rebuilt from: manifests in storage, and the run records beside the store.

Manifests are read through `contract.manifest` only. A run record (`{root}/pipeline_runs/{run}.json`)
lists the artifacts a pipeline run produced or reused, as manifests name no run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from configs import UserError
from contract.manifest import MANIFEST, read_manifest

RUNS_DIR = "pipeline_runs"  # {root}/pipeline_runs/{run}.json: the artifacts a run produced or reused
MANIFEST_KEYS = ("kind", "version", "step", "inputs")  # what indexing needs of a manifest


def indexable_manifest(directory: str | Path) -> dict[str, Any] | None:
    """A directory's manifest, or None when it has none (or a file by that name that is not a maxpipe manifest)."""
    try:
        manifest = read_manifest(directory)
    except (OSError, ValueError, UserError):
        return None
    if not isinstance(manifest, dict) or any(k not in manifest for k in MANIFEST_KEYS):
        return None
    return manifest


def required_manifest(directory: str | Path) -> dict[str, Any]:
    """A directory's manifest, or one UserError line saying it is not a complete maxpipe artifact."""
    manifest = indexable_manifest(directory)
    if manifest is None:
        raise UserError(f"{directory} is not a complete maxpipe artifact (no valid {MANIFEST})")
    return manifest


def holds(uri: str, version: str) -> bool:
    """Whether a local uri holds the complete artifact of this version (gs:// and other URIs: not checked)."""
    if "://" in uri:
        return True
    manifest = indexable_manifest(uri)
    return manifest is not None and manifest["version"] == version


def find_artifact_dirs(root: str | Path) -> list[Path]:
    """Every complete artifact dir under root, sorted; an artifact's own payload is not searched."""
    found = []
    for directory, subdirs, files in os.walk(root):
        if MANIFEST in files and indexable_manifest(directory) is not None:
            found.append(Path(directory))
            subdirs.clear()
        subdirs.sort()
    return sorted(found)


def run_record_path(root: str | Path, run_name: str) -> Path:
    """Where the record of a pipeline run lives under a pipeline root."""
    if not run_name or "/" in run_name or run_name.startswith("."):
        raise UserError(f"run name {run_name!r}: give a plain name (no '/', not starting with '.')")
    return Path(root) / RUNS_DIR / f"{run_name}.json"


def run_records(root: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Each run recorded under a pipeline root and the artifacts (kind, version, uri) its record lists."""
    return {path.stem: read_run_record(path) for path in sorted((Path(root) / RUNS_DIR).glob("*.json"))}


def read_run_record(path: Path) -> list[dict[str, Any]]:
    """The artifacts (kind, version, uri) a run record lists; none if it is missing or unreadable."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    items = record.get("artifacts") if isinstance(record, dict) else None
    return [a for a in items or [] if isinstance(a, dict) and {"kind", "version", "uri"} <= a.keys()]


def add_to_run_record(path: Path, run_name: str, refs: list[dict[str, Any]]) -> None:
    """Add artifacts (kind, version, uri) to a run's record, once each; written atomically, as manifests are."""
    merged = {(r["version"], r["uri"]): r for r in read_run_record(path) + refs}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"run": run_name, "artifacts": list(merged.values())}, indent=2))
    os.replace(tmp, path)
