"""Input files: resolve globs, fingerprint them, and read them as documents."""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

from configs import UserError
from data_prep import storage

STDLIB = "stdlib"
_SKIP_DIRS = {"site-packages", "dist-packages"}


def stdlib_files() -> list[Path]:
    """All `.py` files of this Python's standard library (third-party packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in root.rglob("*.py") if _SKIP_DIRS.isdisjoint(p.relative_to(root).parts) and p.is_file()]


def resolve_inputs(patterns: list[str]) -> list[Path | str]:
    """Expand globs into sorted, deduplicated files: local paths (resolved Paths), or fsspec URLs
    (`gs://bucket/dir/*.jsonl`, `file:///...`, kept as URL strings). "stdlib" = the standard library's .py files."""
    files: set[Path | str] = set()
    for pattern in patterns:
        if pattern == STDLIB:
            matched = stdlib_files()
        else:
            try:
                matched = storage.glob(pattern)
            except Exception as e:  # an unreachable bucket, missing credentials, an unknown protocol
                raise UserError(f"no input files match {pattern!r}: cannot list it ({type(e).__name__}: {e})") from e
        if not matched:
            raise UserError(f"no input files match {pattern!r}")
        files.update(p if storage.is_url(p) else Path(p).resolve() for p in matched)
    return sorted(files, key=str)


def relative_names(files: list[Path | str]) -> list[str]:
    """Names relative to the files' common folder, so a moved corpus keeps its fingerprint."""
    if not files:
        return []
    keys = [storage.key(f) for f in files]
    root = os.path.commonpath([os.path.dirname(k) for k in keys])
    return [os.path.relpath(k, root) for k in keys]


def fingerprint(files: list[Path | str]) -> str:
    """sha256 over each file's relative name, size and content, streamed."""
    digest = hashlib.sha256()
    for name, path in zip(relative_names(files), files):
        digest.update(name.encode() + b"\0" + storage.size(path).to_bytes(8, "little"))
        with storage.open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def read_documents(path: str | Path, text_field: str, skip: Callable[[str], None]) -> Iterator[tuple[int, str]]:
    """Yield (line number, text): one document per file, or per line for `.jsonl` (0 for whole files).

    Unreadable or non-UTF-8 input, bad JSON lines and empty documents are reported through `skip(reason)`.
    """
    try:
        with storage.open(path, "rb") as f:
            data = f.read()
    except OSError:
        skip("unreadable_file")
        return
    if not str(path).endswith(".jsonl"):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skip("invalid_utf8")
            return
        if text.strip():
            yield 0, text
        else:
            skip("empty")
        return
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            skip("empty")
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            skip("invalid_utf8")
            continue
        except ValueError:
            skip("bad_json")
            continue
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            skip("missing_text_field")
        elif not text.strip():
            skip("empty")
        else:
            yield number, text
