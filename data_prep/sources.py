"""Input files: resolve globs, fingerprint them, and read them as documents (text, JSON lines, Parquet)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import sysconfig
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from configs import UserError
from data_prep import storage

STDLIB = "stdlib"
_SKIP_DIRS = {"site-packages", "dist-packages"}
_CHUNK = 1 << 20
PARQUET_BATCH_ROWS = 1024  # rows decoded at a time, so a large row group is never held whole as Python strings

# Why a record is bad; each bad record is counted and written to the dataset's dead-letter file.
BAD_REASONS = (
    "unreadable_file", "binary", "invalid_utf8", "empty", "bad_json", "missing_text_field", "too_large", "no_tokens",
)
DEAD_LETTER = "dead_letter.jsonl"  # in the dataset: one JSON line per bad record, {"source", "line", "reason"}
Skip = Callable[[str, int], None]  # skip(reason, line): line 0 = the whole file


def stdlib_files() -> list[Path]:
    """All `.py` files of this Python's standard library (third-party packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in root.rglob("*.py") if _SKIP_DIRS.isdisjoint(p.relative_to(root).parts) and p.is_file()]


def resolve_sources(patterns: list[str]) -> list[tuple[Path | str, int]]:
    """(file, index of the first pattern matching it), sorted by file and deduplicated; see resolve_inputs."""
    owner: dict[Path | str, int] = {}
    for index, pattern in enumerate(patterns):
        if pattern == STDLIB:
            matched = stdlib_files()
        else:
            try:
                matched = storage.glob(pattern)
            except Exception as e:  # an unreachable bucket, missing credentials, an unknown protocol
                raise UserError(f"no input files match {pattern!r}: cannot list it ({type(e).__name__}: {e})") from e
        if not matched:
            raise UserError(f"no input files match {pattern!r}")
        for p in matched:
            owner.setdefault(p if storage.is_url(p) else Path(p).resolve(), index)
    return sorted(owner.items(), key=lambda item: str(item[0]))


def resolve_inputs(patterns: list[str]) -> list[Path | str]:
    """Expand globs into sorted, deduplicated files: local paths (resolved Paths), or fsspec URLs
    (`gs://bucket/dir/*.jsonl`, `file:///...`, kept as URL strings). "stdlib" = the standard library's .py files."""
    return [file for file, _ in resolve_sources(patterns)]


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
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def file_format(path: str | Path) -> str:
    """"jsonl" (`.jsonl`, `.jsonl.gz`), "parquet" or "text" (any other file is one plain-text document)."""
    name = str(path).lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    return "parquet" if name.endswith(".parquet") else "text"


def read_documents(path: str | Path, text_field: str, skip: Skip, max_bytes: int = 1 << 40) -> Iterator[tuple[int, str]]:
    """Yield (line, text): one document per text file (line 0), per JSON line, or per Parquet row (1-based).

    Bad records go to `skip(reason, line)` (see BAD_REASONS). Files are streamed: a document or line over
    max_bytes is skipped as too_large without being held in memory."""
    reader = {"jsonl": _jsonl, "parquet": _parquet, "text": _text}[file_format(path)]
    try:
        with storage.open(path, "rb") as f:
            yield from reader(path, f, text_field, skip, max_bytes)
    # A vanished or unreadable file, a truncated or corrupt gzip stream, a corrupt Parquet file.
    except (OSError, EOFError, ValueError, zlib.error):
        skip("unreadable_file", 0)


def _text(path, f, text_field: str, skip: Skip, max_bytes: int) -> Iterator[tuple[int, str]]:
    chunks, size = [], 0
    while size <= max_bytes and (chunk := f.read(min(_CHUNK, max_bytes + 1 - size))):
        chunks.append(chunk)
        size += len(chunk)
    data = b"".join(chunks)
    if size > max_bytes:
        skip("too_large", 0)
    elif b"\0" in data:  # UTF-8 text never holds NUL; binary files nearly always do
        skip("binary", 0)
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skip("invalid_utf8", 0)
            return
        if text.strip():
            yield 0, text
        else:
            skip("empty", 0)


def _jsonl(path, f, text_field: str, skip: Skip, max_bytes: int) -> Iterator[tuple[int, str]]:
    if str(path).lower().endswith(".gz"):
        f = gzip.GzipFile(fileobj=f)
    number = 0
    while raw := f.readline(max_bytes + 1):
        number += 1
        if len(raw) > max_bytes and not raw.endswith(b"\n"):
            while (rest := f.readline(_CHUNK)) and not rest.endswith(b"\n"):  # drain the long line, chunk by chunk
                pass
            skip("too_large", number)
            continue
        if not raw.strip():
            skip("empty", number)
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            skip("invalid_utf8", number)
            continue
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's limit
            skip("bad_json", number)
            continue
        text = record.get(text_field) if isinstance(record, dict) else None
        yield from _checked(text, number, skip)


def _parquet(path, f, text_field: str, skip: Skip, max_bytes: int) -> Iterator[tuple[int, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(f)
    except pa.ArrowException:
        skip("unreadable_file", 0)
        return
    field = parquet.schema_arrow.field(text_field) if text_field in parquet.schema_arrow.names else None
    if field is None or not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
        skip("missing_text_field", 0)  # no string column of that name: the whole file is one bad record
        return
    number = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            number += 1
            if text is not None and len(text) > max_bytes // 4 and len(text.encode()) > max_bytes:
                skip("too_large", number)
                continue
            yield from _checked(text, number, skip)


def _checked(text: object, number: int, skip: Skip) -> Iterator[tuple[int, str]]:
    if not isinstance(text, str):
        skip("missing_text_field", number)
    elif not text.strip():
        skip("empty", number)
    else:
        yield number, text
