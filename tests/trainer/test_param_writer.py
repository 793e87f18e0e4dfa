"""The param writer: the lazy writer's small ring of parts and O_DIRECT fallbacks, whole chunks, nothing published
on failure, and the plain-Orbax fallback where Orbax's internals are missing."""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint import type_handlers

from configs import UserError
from trainer.params import writer as param_writer
from trainer.params import scan_layers
from trainer.params.reader import load_params
from trainer.params.writer import LazyParam, lazy_copies, save_lazy_params


def _break_orbax_internals(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Make building the lazy writer's handler fail as an Orbax without (or with changed) internals would."""
    if how == "no NumpyHandler":  # AttributeError
        monkeypatch.delattr(type_handlers, "NumpyHandler")
    elif how == "NumpyHandler not a class":  # TypeError when subclassed
        monkeypatch.setattr(type_handlers, "NumpyHandler", object())
    elif how == "no future module":  # ImportError
        monkeypatch.delattr(ocp, "future")
        monkeypatch.setitem(sys.modules, "orbax.checkpoint.future", None)
    else:
        raise AssertionError(how)


BREAKAGES = ["no NumpyHandler", "NumpyHandler not a class", "no future module"]


@pytest.mark.parametrize("o_direct", ["allowed", "flag refused", "write refused"])
def test_lazy_save_writes_parts_through_a_small_ring_and_never_overwrites_one_in_flight(tmp_path, monkeypatch, o_direct):
    spans: list[tuple[int, int]] = []
    if o_direct == "flag refused":  # as a file system without O_DIRECT: everything goes through the page cache
        real_fcntl = fcntl.fcntl

        def setfl(fd: int, cmd: int, arg: int = 0) -> int:
            if cmd == fcntl.F_SETFL and arg & param_writer._O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_fcntl(fd, cmd, arg)

        monkeypatch.setattr(param_writer.fcntl, "fcntl", setfl)
    real_write_all, rng, lock = param_writer._write_all, np.random.default_rng(0), threading.Lock()

    def pause() -> None:  # parts finish filling and writing in shuffled order
        with lock:
            seconds = rng.random() * 0.003
        time.sleep(seconds)

    def write_all(fd: int, view: memoryview) -> None:
        pause()
        if o_direct == "write refused" and fcntl.fcntl(fd, fcntl.F_GETFL) & param_writer._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # as a disk whose blocks are larger than a page
        real_write_all(fd, view)

    monkeypatch.setattr(param_writer, "_write_all", write_all)

    def fill_with(k: int):
        def fill(out: np.ndarray, part: int) -> None:
            assert out.flags.c_contiguous
            spans.append((out.ctypes.data, out.ctypes.data + out.nbytes))
            out[...] = 100 * k + part
            pause()
        return fill

    f32 = np.dtype("float32")
    sizes = [2000 if k % 2 else 1000 for k in range(6)]  # 8000 and 4000 bytes, alternating
    tree = {f"p{k}": LazyParam((n,), f32, fill_with(k)) for k, n in enumerate(sizes)}
    tree["layers"] = LazyParam((4, 300), f32, fill_with(6), axis=0, parts=4)  # a stacked parameter, by layer
    tree["head"] = LazyParam((50, 40), f32, fill_with(7), axis=1, parts=4)  # column blocks
    save_lazy_params(tmp_path, tree)
    # Every part went into one reused ring of a few slots of the largest part (rounded up to a page) ...
    slot = -(-8000 // mmap.PAGESIZE) * mmap.PAGESIZE
    assert max(e for _, e in spans) - min(s for s, _ in spans) <= param_writer._RING_SLOTS * slot
    # ... and none was filled over one still being filled or written: each restores to its own value.
    restored = load_params(tmp_path)
    for k, n in enumerate(sizes):
        np.testing.assert_array_equal(restored[f"p{k}"], np.full(n, 100 * k, np.float32))
    np.testing.assert_array_equal(restored["layers"], np.repeat(600 + np.arange(4, dtype=np.float32)[:, None], 300, 1))
    np.testing.assert_array_equal(restored["head"], np.repeat(700 + np.arange(4, dtype=np.float32), 10)[None].repeat(50, 0))
    # Stored one chunk per part, so that each part is written on its own.
    chunks = {name: json.loads((tmp_path / "params" / name / ".zarray").read_text())["chunks"] for name in ("layers", "head")}
    assert chunks == {"layers": [1, 300], "head": [50, 10]}


def test_a_lazy_param_is_cut_into_whole_chunks():
    LazyParam((4, 6), np.dtype("float32"), lambda out, k: None, axis=1, parts=3)
    for axis, parts in ((0, 3), (2, 1), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="cannot be cut"):
            LazyParam((4, 6), np.dtype("float32"), lambda out, k: None, axis=axis, parts=parts)


def _tree() -> tuple[dict, dict]:
    """LazyParams of each kind (whole, by rows, by columns, cast, copies of a tree), and their values."""
    rng = np.random.default_rng(0)
    head = rng.standard_normal((6, 40), np.float32)
    stacked = rng.standard_normal((3, 8, 5), np.float32)
    copied = {"layers": {"w": rng.standard_normal((3, 4, 6), np.float32)},
              "embed": rng.standard_normal((7, 4), np.float32)}

    def columns(out: np.ndarray, k: int) -> None:
        out[...] = head[:, 10 * k : 10 * (k + 1)]

    def layers(out: np.ndarray, k: int) -> None:
        np.copyto(out, stacked[k : k + 1], casting="unsafe")

    tree = {
        "head": LazyParam(head.shape, np.dtype("float32"), columns, axis=1, parts=4),
        "layers": LazyParam(stacked.shape, np.dtype("bfloat16"), layers, parts=3),
        "scale": LazyParam((5,), np.dtype("float32"), lambda out, k: out.fill(0.5)),
        "copies": lazy_copies(copied, "bfloat16", unscanned=True, part_bytes=24),
    }
    values = {
        "head": head,
        "layers": stacked.astype("bfloat16"),
        "scale": np.full(5, 0.5, np.float32),
        "copies": scan_layers.cast(scan_layers.unscan(copied), "bfloat16"),
    }
    return tree, values


@pytest.mark.parametrize("how", BREAKAGES)
def test_without_orbax_internals_the_fallback_writes_the_same_checkpoint(tmp_path, monkeypatch, how):
    lines: list[str] = []
    save_lazy_params(tmp_path / "direct", _tree()[0], log=lines.append)
    assert not lines
    with monkeypatch.context() as patch:
        _break_orbax_internals(patch, how)
        tree, values = _tree()
        save_lazy_params(tmp_path / "fallback", tree, log=lines.append)
    assert len(lines) == 1 and "StandardCheckpointer" in lines[0], lines
    direct, fallback = load_params(tmp_path / "direct"), load_params(tmp_path / "fallback")
    for name, value in (("direct", direct), ("fallback", fallback)):  # the same arrays, bit for bit, in the same dtypes
        assert jax.tree.structure(value) == jax.tree.structure(values), name
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b, strict=True), value, values)


@pytest.mark.parametrize("fallback", [False, True])
def test_a_failed_fill_publishes_nothing_on_either_path(tmp_path, monkeypatch, fallback):
    if fallback:
        _break_orbax_internals(monkeypatch, "no NumpyHandler")

    def fill(out: np.ndarray, part: int) -> None:
        if part == 2:
            raise UserError("bad tensor")
        out[...] = part

    with pytest.raises(UserError, match="bad tensor"):
        save_lazy_params(tmp_path, {"w": LazyParam((4, 1000), np.dtype("float32"), fill, parts=4)}, log=lambda _: None)
    assert not (tmp_path / "params").exists()
