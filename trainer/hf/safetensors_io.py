"""HF checkpoint files: the safetensors (and trusted PyTorch pickle) reader and the safetensors shard writer.

Safetensors are read and written here one tensor at a time: the `safetensors` package's numpy API
cannot return bfloat16 (and its torch API needs torch, a test-only dependency), nor read part of a
gs:// file. A checkpoint directory may be any fsspec URL; a tensor, or a block of its rows, is read
straight into a caller's buffer or mapped from a local file.
PyTorch pickles are read only with allow_pickle=True, and only from a local directory.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from configs import UserError

# (HF name, shape, fetch): one tensor to write, fetched when its turn comes.
Entry = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_ST_TO_NP = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_NP_TO_ST = {v: k for k, v in _ST_TO_NP.items()}
_ST_PACKED = {"U8": "uint8"}  # quantized hub weights (MXFP4 blocks and scales)


class CheckpointDir:
    """A checkpoint directory: a local path or any fsspec URL (gs://, memory://, ...), read through fsspec."""

    def __init__(self, hf_dir: str | Path) -> None:
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        self.given = str(hf_dir)
        self.fs, self.root = fsspec.core.url_to_fs(self.given)
        self.local = isinstance(self.fs, LocalFileSystem)

    def path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def show(self, name: str = "") -> str:
        """How to name a file in messages: as the user gave the directory."""
        return f"{self.given.rstrip('/')}/{name}" if name else self.given

    def isfile(self, name: str) -> bool:
        return self.fs.isfile(self.path(name))

    def glob(self, pattern: str) -> list[str]:
        return [p.rsplit("/", 1)[-1] for p in self.fs.glob(self.path(pattern))]

    def read_json(self, name: str) -> Any:
        try:
            return json.loads(self.fs.cat_file(self.path(name)))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise UserError(f"{self.show(name)}: not valid JSON ({err})") from None


class SafetensorsFile:
    """Reads tensors, or blocks of their rows, from a .safetensors file (header: u64 length, JSON; then raw data).

    A tensor kept as it is is read straight into its place in the output. One that is transposed or cast
    goes a block of rows at a time: a memory map of just those rows for a local file (no copy before the
    transpose, and RSS holds one block of the input), a ranged read into a reused buffer for a URL.
    """

    def __init__(self, src: CheckpointDir, name: str) -> None:
        self.name, self.shown, self.local = name, src.show(name), src.local
        self.file = src.fs.open(src.path(name), "rb")
        try:
            (n,) = struct.unpack("<Q", self.file.read(8))
            header = json.loads(self.file.read(n))
        except (struct.error, json.JSONDecodeError, UnicodeDecodeError, MemoryError, OverflowError, ValueError):
            raise UserError(f"{self.shown}: not a safetensors file") from None
        self.data_start = 8 + n
        self.size = src.fs.size(src.path(name))
        self.lock = threading.Lock()  # one seek and read at a time: parts are converted in parallel
        self.tensors: dict[str, dict] = {k: v for k, v in header.items() if k != "__metadata__"}

    def dtype(self, name: str, packed: bool = False) -> np.dtype:
        """The tensor's dtype: a float dtype, or with `packed` also uint8 (quantized weights' blocks and scales)."""
        info = self.tensors[name]
        known = _ST_TO_NP | (_ST_PACKED if packed else {})
        if info["dtype"] not in known:
            raise UserError(f"{self.shown}: tensor {name} has dtype {info['dtype']}; expected a float dtype")
        return np.dtype(known[info["dtype"]])

    def _offset(self, name: str, row: int, row_size: int) -> int:
        """Where row `row` of the tensor, in rows of `row_size` elements, starts in the file (checking the tensor lies
        within it)."""
        info = self.tensors[name]
        begin, end = info["data_offsets"]
        itemsize = self.dtype(name, packed=True).itemsize
        if (end - begin) != math.prod(info["shape"]) * itemsize or self.data_start + end > self.size:
            raise UserError(f"{self.shown}: file is truncated or corrupt (tensor {name})")
        return self.data_start + begin + row * row_size * itemsize

    def rows(self, name: str, start: int, out: np.ndarray) -> np.ndarray:
        """Rows start.. of the tensor as `out`'s shape (a row: out.shape[1:]): a map of the file when local, else
        read into `out`."""
        if not self.local:
            self.read_into(name, out, start)
            return out
        offset = self._offset(name, start, math.prod(out.shape[1:]))
        aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
        mapped = mmap.mmap(self.file.fileno(), offset - aligned + out.nbytes, offset=aligned, access=mmap.ACCESS_READ)
        return np.frombuffer(mapped, out.dtype, out.size, offset=offset - aligned).reshape(out.shape)

    def read_into(self, name: str, out: np.ndarray, start: int = 0) -> None:
        """Fill `out` (contiguous, the tensor's dtype) with the tensor's bytes from row `start` (a row: out.shape[1:])."""
        if not out.flags.c_contiguous:
            raise ValueError("read_into needs a contiguous output")
        offset = self._offset(name, start, math.prod(out.shape[1:]))
        view = memoryview(as_bits(out).reshape(-1)).cast("B")
        got = 0
        with self.lock:
            self.file.seek(offset)
            while got < len(view):  # a raw or remote read may return fewer bytes than asked
                n = self.file.readinto(view[got:])
                if not n:
                    raise UserError(f"{self.shown}: file is truncated or corrupt (tensor {name})")
                got += n


class PickleFile:
    """Tensors of a PyTorch state-dict file, read with torch's restricted (weights_only) unpickler, memory-mapped."""

    def __init__(self, src: CheckpointDir, name: str) -> None:
        try:
            import torch
        except ImportError:
            raise UserError(f"{src.show(name)}: reading PyTorch pickle weights needs torch installed") from None
        self.name, self.shown = name, src.show(name)
        if not src.local:
            raise UserError(f"{self.shown}: PyTorch pickle weights are read from a local directory only")
        try:
            state = torch.load(src.path(name), map_location="cpu", weights_only=True, mmap=True)
        except Exception as err:  # noqa: BLE001 - torch raises many kinds for a bad or unsafe file
            why = f"{type(err).__name__}: {err}"
            raise UserError(f"{self.shown}: cannot read as a PyTorch state dict ({why})") from None
        self._state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        self.tensors = {k: {"shape": list(v.shape)} for k, v in self._state.items()}

    def _array(self, name: str) -> np.ndarray:
        import torch

        t = self._state[name]
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.dtype("bfloat16"))
        if not t.dtype.is_floating_point:
            raise UserError(f"{self.shown}: tensor {name} has dtype {t.dtype}; expected a float dtype")
        return t.numpy()

    def dtype(self, name: str) -> np.dtype:
        return self._array(name).dtype

    def rows(self, name: str, start: int, out: np.ndarray) -> np.ndarray:
        rows = self._array(name).reshape(-1, math.prod(out.shape[1:]))
        return rows[start : start + len(out)].reshape(out.shape)

    def read_into(self, name: str, out: np.ndarray, start: int = 0) -> None:
        np.copyto(out, self.rows(name, start, out))


def open_checkpoint(src: CheckpointDir, allow_pickle: bool = False) -> dict[str, SafetensorsFile | PickleFile]:
    """Map every tensor name in the checkpoint to the file holding it (safetensors; pickles only when allowed)."""
    names = _weight_files(src, "model.safetensors", ("*.safetensors",))
    reader: type[SafetensorsFile | PickleFile] = SafetensorsFile
    if not names:
        pickles = _weight_files(src, "pytorch_model.bin", tuple(f"*{s}" for s in _PICKLE_SUFFIXES))
        if pickles and not allow_pickle:
            raise UserError(
                f"{src.show()} holds only PyTorch pickle weights ({', '.join(pickles)}); maxpipe reads "
                f"safetensors only, since unpickling can run arbitrary code: convert them to safetensors in a trusted "
                f"environment, or set pipeline.hf_allow_pickle=true for a checkpoint you trust"
            )
        if not pickles:
            raise UserError(f"no safetensors weights in {src.show()}")
        names, reader = pickles, PickleFile
    files: dict[str, SafetensorsFile | PickleFile] = {}
    for name in names:
        st = reader(src, name)
        for tensor in st.tensors:
            if tensor in files:
                raise UserError(f"tensor {tensor} appears in both {files[tensor].name} and {name}")
            files[tensor] = st
    return files


def _weight_files(src: CheckpointDir, single: str, patterns: tuple[str, ...]) -> list[str]:
    """The files of a sharded checkpoint's `{single}.index.json`, else `single`, else every file matching patterns."""
    index = f"{single}.index.json"
    if src.isfile(index):
        names = sorted(set(src.read_json(index).get("weight_map", {}).values()))
        missing = [n for n in names if not src.isfile(n)]
        if missing:
            raise UserError(f"{src.show(index)} lists {missing[0]}, which is missing from {src.show()}")
        return names
    if src.isfile(single):
        return [single]
    return sorted({n for pattern in patterns for n in src.glob(pattern)})


def as_bits(x: np.ndarray) -> np.ndarray:
    """The same memory viewed as unsigned ints of the item size."""
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def write_safetensors(path: Path, entries: list[Entry], dtype: np.dtype) -> int:
    """Write tensors (name, shape, fetch) one at a time; returns the data size in bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _NP_TO_ST[dtype.name], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned, as the safetensors library does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, fetch in entries:
            x = np.ascontiguousarray(fetch(), dtype=dtype)
            assert x.shape == shape, (name, x.shape, shape)
            x.tofile(f)
    return offset


def write_shards(out: Path, entries: list[Entry], dtype: np.dtype, max_shard_bytes: int) -> int:
    """`model.safetensors`, or HF's `model-0000i-of-0000n.safetensors` + index when over `max_shard_bytes`."""
    shards: list[list] = [[]]
    filled = 0
    for entry in entries:
        size = math.prod(entry[1]) * dtype.itemsize
        if shards[-1] and filled + size > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(entry)
        filled += size
    if len(shards) == 1:
        return write_safetensors(out / "model.safetensors", entries, dtype)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = sum(write_safetensors(out / name, shard, dtype) for name, shard in zip(names, shards))
    weight_map = {entry[0]: name for name, shard in zip(names, shards) for entry in shard}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total

