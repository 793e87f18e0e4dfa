"""HF ingest from fsspec URLs, block-wise conversion, sharded restore, and the lazy Orbax write's memory bound."""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import shutil
import threading
import time
from pathlib import Path

import flax.linen as nn
import fsspec
import jax
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from configs import UserError
from trainer import checkpoint, hf
from trainer.checkpoint import LazyParam, abstract_params, load_params, save_lazy_params
from trainer.hf import ingest, load_hf_params, model_config_from_hf, read_hf_config
from trainer.model import Transformer


def _hf_model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=192, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms away from 1, attention far from uniform
            p.normal_(1.0, 0.2) if p.ndim == 1 else p.normal_(0, 1.0 if "embed" in name else 0.15)
    return model


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> Path:
    """A bfloat16 checkpoint in several safetensors shards with model.safetensors.index.json."""
    path = tmp_path_factory.mktemp("hf")
    _hf_model().to(torch.bfloat16).save_pretrained(path, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path


def _cfg(path: str | Path, dtype: str = "bfloat16"):
    return model_config_from_hf(read_hf_config(path)).model_copy(update={"param_dtype": dtype})


def _assert_trees_equal(a, b) -> None:
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_ingest_reads_an_fsspec_url(sharded_dir, tmp_path, scheme, monkeypatch):
    monkeypatch.setattr(hf, "_BLOCK_BYTES", 11 * 64 * 2)  # transposed tensors are read in many ranges
    if scheme == "memory":
        fs = fsspec.filesystem("memory")
        fs.put(str(sharded_dir) + "/", "/ckpt/", recursive=True)
        url = "memory://ckpt"
    else:
        url = sharded_dir.as_uri()
    cfg = _cfg(sharded_dir)
    stats = ingest(url, tmp_path / "out", cfg, log=lambda _: None)
    assert stats["source"] == url
    _assert_trees_equal(load_params(tmp_path / "out"), load_hf_params(sharded_dir, cfg))


def test_url_errors_name_the_url(sharded_dir):
    fs = fsspec.filesystem("memory")
    fs.pipe("/empty/config.json", b"{not json")
    with pytest.raises(UserError, match=r"memory://empty/config\.json: not valid JSON"):
        read_hf_config("memory://empty")
    with pytest.raises(UserError, match=r"no HF config at memory://nothing/config\.json"):
        read_hf_config("memory://nothing")
    fs.pipe("/pickled/pytorch_model.bin", b"")
    with pytest.raises(UserError, match=r"memory://pickled/pytorch_model\.bin: .* local directory only"):
        load_hf_params("memory://pickled", _cfg(sharded_dir), allow_pickle=True)


@pytest.mark.parametrize("by_layer", [True, False])
def test_conversion_in_small_blocks_matches_transformers(sharded_dir, tmp_path, monkeypatch, by_layer):
    # Blocks of 11 rows: transposes and the bfloat16 -> float32 cast cross many block edges. The
    # embedding and head are written in blocks of vocabulary rows; the layers one by one or stacked whole.
    monkeypatch.setattr(hf, "_BLOCK_BYTES", 11 * 64 * 2)
    monkeypatch.setattr(hf, "_SPLIT_BYTES", 0 if by_layer else 1 << 40)
    cfg = _cfg(sharded_dir, "float32")
    ingest(sharded_dir, tmp_path / "out", cfg, log=lambda _: None)
    chunks = lambda name: json.loads((tmp_path / "out" / "params" / name / ".zarray").read_text())["chunks"]  # noqa: E731
    assert chunks("layers.mlp.gate_proj.kernel") == ([1, 64, 192] if by_layer else [2, 64, 192])
    assert chunks("embed.embedding")[0] < 300 and chunks("lm_head.kernel")[1] < 300
    params = load_params(tmp_path / "out", abstract_params(cfg))
    tokens = np.random.default_rng(0).integers(0, 300, (1, 64))
    ours = np.asarray(Transformer(cfg).apply({"params": params}, tokens))
    reference = _hf_model()
    with torch.no_grad():
        for p in reference.parameters():  # the checkpoint's bfloat16 weights, computed in float32
            p.copy_(p.to(torch.bfloat16))
        ref = reference(torch.tensor(tokens)).logits.numpy()
    assert np.abs(ours - ref).max() <= 2e-5 * np.abs(ref).max()


def test_ingested_params_restore_onto_a_sharded_mesh(sharded_dir, tmp_path):
    from trainer.sharding import logical_shardings, make_mesh

    cfg = _cfg(sharded_dir)
    ingest(sharded_dir, tmp_path / "out", cfg, log=lambda _: None)
    mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 2}, jax.devices()[:4])
    tokens = jax.ShapeDtypeStruct((1, 8), np.int32)
    boxed = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tokens)["params"]
    shardings = logical_shardings(boxed, mesh)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(boxed), shardings)
    params = load_params(tmp_path / "out", abstract)
    jax.tree.map(lambda p, s: p.sharding.is_equivalent_to(s, p.ndim) or pytest.fail(f"{p.sharding} != {s}"),
                 params, shardings)
    assert any(not p.sharding.is_fully_replicated for p in jax.tree.leaves(params))
    _assert_trees_equal(params, load_hf_params(sharded_dir, cfg))


def test_a_missing_tensor_is_refused_before_anything_is_written(sharded_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    shutil.copytree(sharded_dir, tmp_path / "hf")
    shard = tmp_path / "hf" / json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())[
        "weight_map"]["model.norm.weight"]
    tensors = load_file(shard)
    del tensors["model.norm.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"lacks tensor model\.norm\.weight \(the model expects \(64,\)\)"):
        ingest(tmp_path / "hf", tmp_path / "out", _cfg(tmp_path / "hf"), log=lambda _: None)
    assert not (tmp_path / "out").exists()


def test_truncated_shard_fails_the_ingest(sharded_dir, tmp_path):
    shutil.copytree(sharded_dir, tmp_path / "hf")
    last = max((tmp_path / "hf").glob("*.safetensors"))
    last.write_bytes(last.read_bytes()[:-100])
    with pytest.raises(UserError, match="truncated"):
        ingest(tmp_path / "hf", tmp_path / "out", _cfg(tmp_path / "hf"), log=lambda _: None)
    assert not (tmp_path / "out" / "params").exists()


@pytest.mark.parametrize("o_direct", ["allowed", "flag refused", "write refused"])
def test_lazy_save_writes_parts_through_a_small_ring_and_never_overwrites_one_in_flight(tmp_path, monkeypatch, o_direct):
    spans: list[tuple[int, int]] = []
    if o_direct == "flag refused":  # as a file system without O_DIRECT: everything goes through the page cache
        real_fcntl = fcntl.fcntl

        def setfl(fd: int, cmd: int, arg: int = 0) -> int:
            if cmd == fcntl.F_SETFL and arg & checkpoint._O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_fcntl(fd, cmd, arg)

        monkeypatch.setattr(checkpoint.fcntl, "fcntl", setfl)
    real_write_all, rng, lock = checkpoint._write_all, np.random.default_rng(0), threading.Lock()

    def pause() -> None:  # parts finish filling and writing in shuffled order
        with lock:
            seconds = rng.random() * 0.003
        time.sleep(seconds)

    def write_all(fd: int, view: memoryview) -> None:
        pause()
        if o_direct == "write refused" and fcntl.fcntl(fd, fcntl.F_GETFL) & checkpoint._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # as a disk whose blocks are larger than a page
        real_write_all(fd, view)

    monkeypatch.setattr(checkpoint, "_write_all", write_all)

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
    assert max(e for _, e in spans) - min(s for s, _ in spans) <= checkpoint._RING_SLOTS * slot
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


def test_a_failed_fill_publishes_nothing(tmp_path):
    def fill(out: np.ndarray, part: int) -> None:
        if part == 2:
            raise UserError("bad tensor")
        out[...] = part

    with pytest.raises(UserError, match="bad tensor"):
        save_lazy_params(tmp_path, {"w": LazyParam((4, 1000), np.dtype("float32"), fill, parts=4)})
    assert not (tmp_path / "params").exists()
