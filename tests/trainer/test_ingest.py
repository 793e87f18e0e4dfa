"""HF ingest from fsspec URLs, block-wise conversion, sharded restore, and refusals before anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import flax.linen as nn
import fsspec
import jax
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from configs import UserError
from trainer.hf.config import model_config_from_hf, read_hf_config
from trainer.hf.ingest import ingest, load_hf_params
from trainer.model.decoder import Transformer
from trainer.params.reader import abstract_params, load_params


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
    monkeypatch.setattr("trainer.hf.ingest._BLOCK_BYTES", 11 * 64 * 2)  # transposed tensors are read in many ranges
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
    monkeypatch.setattr("trainer.hf.ingest._BLOCK_BYTES", 11 * 64 * 2)
    monkeypatch.setattr("trainer.hf.ingest._SPLIT_BYTES", 0 if by_layer else 1 << 40)
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
    from trainer.model.sharding import logical_shardings, make_mesh

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


def test_ingest_without_orbax_internals_writes_the_same_params(sharded_dir, tmp_path, monkeypatch):
    from orbax.checkpoint import type_handlers

    monkeypatch.delattr(type_handlers, "NumpyHandler")  # as an Orbax whose internals moved: the plain-Orbax fallback
    lines: list[str] = []
    cfg = _cfg(sharded_dir)
    ingest(sharded_dir, tmp_path / "out", cfg, log=lines.append)
    assert sum("StandardCheckpointer" in line for line in lines) == 1
    _assert_trees_equal(load_params(tmp_path / "out", abstract_params(cfg)), load_hf_params(sharded_dir, cfg))
