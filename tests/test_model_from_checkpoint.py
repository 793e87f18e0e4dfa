"""Without a model file named, commands take the model config from the HF checkpoint or the artifact they start from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from configs import load_config, names_model, setting
from contract.manifest import MANIFEST
from pipelines.cli import main
from tests.helpers import small_corpus, tiny_hf_llama
from trainer.hf.config import model_config_from_hf, read_hf_config


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny HF Llama (vocab 512) that fits no model file: its MLP is 96 wide, models/tiny.yml's 128."""
    tmp = tmp_path_factory.mktemp("hf_model")
    corpus = small_corpus(tmp / "corpus", limit_bytes=100_000)
    return tiny_hf_llama(tmp / "llama-96", corpus, mlp_dim=96), corpus


def maxpipe(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def config_model(directory) -> dict:
    return json.loads((directory / MANIFEST).read_text())["config"]["model"]


def test_the_command_line_or_a_named_preset_names_a_model():
    assert not names_model(None, ["train.steps=3", "model.dtype=bfloat16"])
    assert names_model(None, ["model=tiny"]) and names_model(None, ["model.name=tiny"])
    assert names_model("tiny", [])  # presets/tiny.yml picks models/tiny.yml
    assert setting(None, ["pipeline.hf_checkpoint=/ckpt"], "pipeline.hf_checkpoint") == "/ckpt"


def test_a_given_model_section_stands_in_for_the_model_file():
    model = load_config("tiny").model.model_dump() | {"name": "mine", "mlp_dim": 96}
    cfg = load_config("tiny", ["model.dtype=bfloat16"], model=model)
    assert cfg.model.name == "mine" and cfg.model.mlp_dim == 96 and cfg.model.dtype == "bfloat16"
    assert cfg.data.seq_len == 64  # the preset still applies
    old = {k: v for k, v in model.items() if k != "attention"}  # a manifest from before a field existed
    assert load_config(None, [], model=old).model.attention == "auto"  # base.yml fills it in


def test_ingest_without_a_model_derives_it_from_config_json(hf, tmp_path, capsys):
    hf_dir, _ = hf
    code, out, err = maxpipe(capsys, "ingest", f"src={hf_dir}", f"output={tmp_path / 'params'}")
    assert code == 0, err
    assert "model llama-96: derived from" in out and "llama, 2 layers" in out
    derived = model_config_from_hf(read_hf_config(hf_dir), name="llama-96")
    assert config_model(tmp_path / "params") == derived.model_dump()

    code, out, err = maxpipe(capsys, "ingest", f"src={hf_dir}", f"output={tmp_path / 'bf16'}", "model.dtype=bfloat16")
    assert code == 0, err
    assert config_model(tmp_path / "bf16") == derived.model_dump() | {"dtype": "bfloat16"}


def test_a_named_model_is_still_checked_against_the_checkpoint(hf, tmp_path, capsys):
    hf_dir, _ = hf
    code, _, err = maxpipe(capsys, "ingest", "model=demo", f"src={hf_dir}", f"output={tmp_path / 'params'}")
    assert code == 1 and err.count("\n") == 1 and "model.vocab_size is 4096" in err and "512" in err, err
    code, _, err = maxpipe(capsys, "ingest", "tiny", f"src={hf_dir}", f"output={tmp_path / 'params'}")
    assert code == 1 and "model.mlp_dim is 128" in err, err
    assert not (tmp_path / "params" / MANIFEST).exists()


def test_single_steps_take_the_model_of_their_input(hf, tmp_path, capsys):
    """prep sizes its vocabulary by the checkpoint, train by its init, export by its training run."""
    hf_dir, corpus = hf
    data, params, run, export = (tmp_path / n for n in ("data", "params", "run", "export"))
    common = ["data.seq_len=64"]
    code, _, err = maxpipe(capsys, "prep", *common, f"pipeline.hf_checkpoint={hf_dir}", f"data.input={corpus}/*.py",
                           "data.beam_args=[--direct_running_mode=in_memory]", f"output={data}")
    assert code == 0, err
    manifest = json.loads((data / MANIFEST).read_text())
    assert manifest["config"]["vocab_size"] == 512 and manifest["stats"]["tokenizer"]["source"] == str(hf_dir)
    assert maxpipe(capsys, "ingest", f"src={hf_dir}", f"output={params}")[0] == 0
    code, out, err = maxpipe(capsys, "train", *common, "train.steps=2", "warmup_steps=0", "train.batch_size=8",
                             "eval_every=0", f"dataset={data}", f"init={params}", f"output={run}")
    assert code == 0, err
    assert f"the model config of {params}" in out
    assert config_model(run) == config_model(params)
    code, _, err = maxpipe(capsys, "export", f"src={run}", f"dataset={data}", f"output={export}")
    assert code == 0, err
    assert config_model(export) == config_model(params)
    assert json.loads((export / "hf" / "config.json").read_text())["intermediate_size"] == 96


def test_compile_and_submit_without_a_model_bake_in_the_checkpoints(hf, tmp_path, capsys, monkeypatch):
    hf_dir, _ = hf

    def baked_model(spec: str) -> dict:
        tasks = yaml.safe_load(Path(spec).read_text())["root"]["dag"]["tasks"]
        return json.loads(tasks["ingest"]["inputs"]["parameters"]["config"]["runtimeValue"]["constant"])["model"]

    spec = tmp_path / "pipeline.yaml"
    code, out, err = maxpipe(capsys, "compile", f"pipeline.hf_checkpoint={hf_dir}", "-o", str(spec))
    assert code == 0, err
    assert baked_model(str(spec))["mlp_dim"] == 96 and baked_model(str(spec))["name"] == "llama-96"

    submitted = []
    monkeypatch.setattr("pipelines.vertex.submit", lambda spec, **_: submitted.append(baked_model(spec)))
    code, out, err = maxpipe(capsys, "submit", f"pipeline.hf_checkpoint={hf_dir}", "model.dtype=bfloat16",
                             "--project", "p", "--region", "r", "--pipeline-root", "gs://b/runs")
    assert code == 0, err
    assert submitted[0]["mlp_dim"] == 96 and submitted[0]["dtype"] == "bfloat16"


def test_errors_are_one_line(hf, tmp_path, capsys):
    hf_dir, corpus = hf
    code, _, err = maxpipe(capsys, "ingest", f"src={tmp_path / 'nothing'}", f"output={tmp_path / 'params'}")
    assert code == 1 and err.count("\n") == 1 and "no HF config at" in err and "model=NAME" in err, err
    # A checkpoint without tokenizer files: refused before the run starts, the key and the fix named.
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(hf_dir / name, bare / name)
    code, _, err = maxpipe(capsys, "run", f"pipeline.hf_checkpoint={bare}", f"data.input={corpus}/*.py",
                           f"pipeline.root={tmp_path / 'runs'}")
    assert code == 1 and err.count("\n") == 1, err
    assert f"pipeline.hf_checkpoint: {bare} holds no tokenizer" in err and "data.tokenizer=" in err
    code, _, err = maxpipe(capsys, "train", "dataset=x", f"output={tmp_path / 'run'}", f"init={tmp_path / 'nothing'}")
    assert code == 1 and "not a complete maxpipe artifact" in err, err
