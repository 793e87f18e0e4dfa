"""Export options: HF safetensors in shards with an index, bfloat16 weights, unscanned Orbax params."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from trainer.params import reader as param_reader
from trainer.params import writer as param_writer
from trainer.params import scan_layers
from trainer.hf.export import export_hf
from trainer.hf.config import model_config_from_hf, read_hf_config
from trainer.hf.ingest import load_hf_params

TOKENS = np.random.default_rng(0).integers(0, 512, (1, 300))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=512)
    path = tmp_path_factory.mktemp("hf")
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


def logits(path: Path) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float().numpy(), model.dtype


def test_large_exports_are_sharded_with_an_index_transformers_reads(hf_dir: Path, tmp_path: Path) -> None:
    cfg = model_config_from_hf(read_hf_config(hf_dir))
    params = load_hf_params(hf_dir, cfg)
    stats = export_hf(params, cfg, None, tmp_path / "out", log=lambda _: None, max_shard_bytes=100_000)
    shards = sorted(p.name for p in (tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards and index["metadata"]["total_size"] == stats["bytes"]
    assert not (tmp_path / "out" / "model.safetensors").exists()
    ours, dtype = logits(tmp_path / "out")
    reference, _ = logits(hf_dir)
    np.testing.assert_array_equal(ours, reference)  # the same float32 weights, so bitwise the same logits
    assert dtype == torch.float32


def test_bfloat16_export(hf_dir: Path, tmp_path: Path) -> None:
    cfg = model_config_from_hf(read_hf_config(hf_dir))
    export_hf(load_hf_params(hf_dir, cfg), cfg, None, tmp_path / "bf16", log=lambda _: None, dtype="bfloat16")
    ours, dtype = logits(tmp_path / "bf16")
    reference, _ = logits(hf_dir)
    assert dtype == torch.bfloat16
    # bfloat16 keeps 8 bits of mantissa (relative rounding 2^-9 per weight and per op): a few percent
    # of the logits' range; a wrong or transposed weight would be off by the whole range.
    assert np.abs(ours - reference).max() < 0.05 * np.abs(reference).max()


def test_unscanned_params_round_trip_exactly(hf_dir: Path, tmp_path: Path) -> None:
    cfg = model_config_from_hf(read_hf_config(hf_dir))
    params = load_hf_params(hf_dir, cfg)
    flat = scan_layers.unscan(params)
    assert "layers" not in flat and sorted(k for k in flat if k.startswith("layers_")) == ["layers_0", "layers_1", "layers_2"]
    up = params["layers"]["mlp"]["up_proj"]["kernel"]
    np.testing.assert_array_equal(flat["layers_1"]["mlp"]["up_proj"]["kernel"], up[1])
    param_writer.save_params(tmp_path, flat)
    back = scan_layers.rescan(param_reader.load_params(tmp_path))
    jax.tree.map(np.testing.assert_array_equal, back, params)
    assert scan_layers.rescan(params) is params
    halves = scan_layers.cast(params, "bfloat16")
    assert {x.dtype.name for x in jax.tree.leaves(halves)} == {"bfloat16"}


def test_eval_and_training_read_an_unscanned_bfloat16_export(tmp_path: Path) -> None:
    """The pipeline's export with every option on: eval and continued training read it back."""
    from components import steps
    from configs import load_config
    from tests.helpers import small_corpus

    corpus = small_corpus(tmp_path / "corpus", 120_000)
    cfg = load_config("tiny", [f"data.input=[{corpus}/*.py]", "train.steps=4", "train.checkpoint_every=2",
                               "export.unscanned=true", "export.dtype=bfloat16", "export.max_shard_bytes=50000"])
    quiet = {"log": lambda _: None}
    steps.prep(cfg, tmp_path / "data", **quiet)
    steps.train(cfg, tmp_path / "data", tmp_path / "train", **quiet)
    export = steps.export(cfg, tmp_path / "train", tmp_path / "data", tmp_path / "export", **quiet)
    assert export["stats"]["unscanned"] and export["stats"]["dtype"] == "bfloat16"
    assert (tmp_path / "export" / "hf" / "model.safetensors.index.json").is_file()
    # Streamed layer by layer from the checkpoint, both exports hold exactly its weights (in bfloat16),
    # against Orbax's own restore of the whole checkpoint.
    import orbax.checkpoint as ocp
    from safetensors.numpy import load_file

    with ocp.StandardCheckpointer() as ckptr:
        trained = scan_layers.cast(ckptr.restore(tmp_path / "train" / "checkpoints" / "4" / "params"), "bfloat16")
    exported = param_reader.load_params(tmp_path / "export", param_reader.abstract_params(cfg.model.model_copy(
        update={"param_dtype": "bfloat16"})))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), exported, trained)
    weights = {}
    for shard in (tmp_path / "export" / "hf").glob("*.safetensors"):
        weights.update(load_file(shard))
    up = np.asarray(trained["layers"]["mlp"]["up_proj"]["kernel"][1])
    np.testing.assert_array_equal(weights["model.layers.1.mlp.up_proj.weight"], up.T)
    report = steps.evaluate(cfg, tmp_path / "export", tmp_path / "data", tmp_path / "eval", **quiet)
    assert report["stats"]["val_loss"] > 0
    again = steps.train(cfg, tmp_path / "data", tmp_path / "continued", tmp_path / "export", **quiet)
    assert again["stats"]["steps"] == 4 and again["inputs"][1]["version"] == export["version"]


@pytest.mark.parametrize("part_bytes", [16 << 20, 24])  # whole arrays; parts of a few rows
def test_lazy_copies_read_each_array_once_also_unscanned(tmp_path: Path, part_bytes: int) -> None:
    reads: list[tuple[int, ...]] = []

    class Counted:
        def __init__(self, value: np.ndarray) -> None:
            self.value, self.shape, self.dtype = value, value.shape, value.dtype

        def __array__(self, dtype=None, copy=None) -> np.ndarray:
            reads.append(self.shape)
            return self.value

    rng = np.random.default_rng(0)
    tree = {"layers": {"w": rng.standard_normal((3, 4, 5), np.float32), "b": rng.standard_normal((3, 5), np.float32)},
            "embed": rng.standard_normal((7, 4), np.float32)}
    copies = param_writer.lazy_copies(jax.tree.map(Counted, tree), "bfloat16", unscanned=True, part_bytes=part_bytes)
    parts = {p.parts for p in jax.tree.leaves(copies, is_leaf=lambda x: isinstance(x, param_writer.LazyParam))}
    assert parts == ({1} if part_bytes > 1000 else {1, 2, 7})  # a layer's [4, 5] in 2, the embedding by row
    param_writer.save_lazy_params(tmp_path, copies)
    assert sorted(reads) == sorted([(3, 4, 5), (3, 5), (7, 4)])  # once per array, not once per layer or part
    expected = scan_layers.cast(scan_layers.unscan(tree), "bfloat16")
    jax.tree.map(np.testing.assert_array_equal, param_reader.load_params(tmp_path), expected)
