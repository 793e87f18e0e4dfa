"""Paths or fsspec URLs (gs:// through gcsfs, file://, memory://): the few file operations prep needs.

Plain local paths keep using the local disk directly. ArrayRecord's writer and reader (C++) take only
local paths, so a shard bound for a URL is written to a local temp file and then uploaded, and a shard
read from a URL is downloaded to a temp file first: Dataflow workers share no disk with the launcher.
"""

from __future__ import annotations

import builtins
import contextlib
import glob as glob_
import hashlib
import os
import posixpath
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import fsspec

from contract.records import shard_glob


def is_url(path: str | Path) -> bool:
    return "://" in str(path)


def join(base: str | Path, *names: str) -> str | Path:
    """base/names..., a URL for a URL and a Path for a path."""
    return posixpath.join(str(base), *names) if is_url(base) else Path(base, *names)


def key(path: str | Path) -> str:
    """The path part, without the protocol ("gs://b/x" -> "/b/x"), to compare names across storages."""
    return "/" + str(path).split("://", 1)[1].lstrip("/") if is_url(path) else str(path)


def _fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    options = {"auto_mkdir": True} if url.startswith("file://") else {}  # object stores have no folders to make
    fs, _, (path,) = fsspec.core.get_fs_token_paths(url, expand=False, storage_options=options)
    return fs, path


def open(path: str | Path, mode: str = "rb"):  # noqa: A001
    """A file object (a context manager) for a path or a URL."""
    return fsspec.open(str(path), mode) if is_url(path) else builtins.open(path, mode)


def glob(pattern: str) -> list[str | Path]:
    """Files (not folders) matching a glob ("**" recurses): Paths for a local pattern, URLs for a URL."""
    if not is_url(pattern):
        return [p for p in map(Path, glob_.glob(os.path.expanduser(pattern), recursive=True)) if p.is_file()]
    fs, _, paths = fsspec.core.get_fs_token_paths(pattern)
    return [fs.unstrip_protocol(p) for p in paths if fs.isfile(p)]


def size(path: str | Path) -> int:
    if not is_url(path):
        return Path(path).stat().st_size
    fs, p = _fs(str(path))
    return fs.size(p)


def sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def upload(local: str | Path, url: str) -> None:
    """Copy a local file to a URL (one object upload: on GCS it appears whole or not at all)."""
    fs, p = _fs(url)
    fs.put_file(str(local), p)


def download(url: str, local: str | Path) -> None:
    """Copy a URL's object to a local file."""
    fs, p = _fs(url)
    fs.get_file(p, str(local))


def write_bytes(path: str | Path, data: bytes) -> None:
    """A small file at a path or URL (one object upload for a URL)."""
    with open(path, "wb") as f:
        f.write(data)


def read_bytes(path: str | Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def upload_dir(local: str | Path, url: str) -> None:
    for file in sorted(Path(local).rglob("*")):
        if file.is_file():
            upload(file, posixpath.join(url, file.relative_to(local).as_posix()))


@contextlib.contextmanager
def download_to_temp(path: str | Path) -> Iterator[Path]:
    """A local path holding the file's bytes: the path itself if local, else a temp copy, removed after."""
    if not is_url(path):
        yield Path(path)
        return
    fs, p = _fs(str(path))
    with tempfile.TemporaryDirectory(prefix="maxpipe-") as tmp:
        local = Path(tmp, posixpath.basename(p))
        fs.get_file(p, str(local))
        yield local


def download_dir(url: str, local: str | Path) -> None:
    """Every file under the URL folder into the local folder (kept relative)."""
    fs, root = _fs(url)
    for file in fs.find(root):
        target = Path(local, posixpath.relpath(file, root))
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(file, str(target))


def remove(path: str | Path) -> None:
    """Delete a file or folder, recursively; missing is fine."""
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=True) if Path(path).is_dir() else Path(path).unlink(missing_ok=True)
        return
    fs, p = _fs(str(path))
    with contextlib.suppress(FileNotFoundError):
        fs.rm(p, recursive=True)


def makedirs(path: str | Path) -> None:
    """Create a local folder; object stores have none (and gcsfs's makedirs would create a missing bucket)."""
    if not is_url(path):
        Path(path).mkdir(parents=True, exist_ok=True)
    elif str(path).startswith("file://"):
        fs, p = _fs(str(path))
        fs.makedirs(p, exist_ok=True)


def publish(staging: str | Path, out: str | Path, names: list[str], folders: list[str]) -> None:
    """Move staged files `names` and folders `folders` into out, replacing earlier shards and those folders.

    Local: os.replace (atomic renames). URL: fsspec mv per file (on GCS a copy and a delete)."""
    if not is_url(out):
        out = Path(out)
        for old in [*out.glob(shard_glob("train")), *out.glob(shard_glob("val"))]:
            old.unlink()
        for name in names:
            os.replace(Path(staging, name), out / name)
        for folder in folders:
            shutil.rmtree(out / folder, ignore_errors=True)
            os.replace(Path(staging, folder), out / folder)
        return
    fs, root = _fs(str(out))
    _, stage = _fs(str(staging))
    for pattern in (shard_glob("train"), shard_glob("val")):
        for old in fs.glob(posixpath.join(root, pattern)):
            fs.rm_file(old)
    for name in names:
        fs.mv(posixpath.join(stage, name), posixpath.join(root, name))
    for folder in folders:
        remove(join(out, folder))
        src = posixpath.join(stage, folder)
        for file in fs.find(src):
            fs.mv(file, posixpath.join(root, folder, posixpath.relpath(file, src)))
