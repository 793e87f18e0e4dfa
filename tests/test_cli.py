"""The single-step commands, their cache and errors, and `maxpipe compile`."""

from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from contract.manifest import MANIFEST
from pipelines.cli import main
from tests.helpers import small_corpus, tiny_hf_llama


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return small_corpus(tmp_path_factory.mktemp("cli") / "corpus", limit_bytes=200_000)


def maxpipe(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_steps_one_by_one_with_cache(corpus, tmp_path, capsys):
    data, run, export, report = (tmp_path / n for n in ("data", "run", "export", "report"))
    common = ["tiny", f"data.input={corpus}/*.py", "data.beam_args=[--direct_running_mode=in_memory]"]
    code, out, _ = maxpipe(capsys, "prep", *common, f"output={data}")
    assert code == 0 and "prep:" in out
    version = json.loads((data / MANIFEST).read_text())["version"]

    code, out, _ = maxpipe(capsys, "data", "inspect", str(data))
    stats = json.loads((data / MANIFEST).read_text())["stats"]
    assert code == 0 and f"{stats['tokens']['train']:,} tokens" in out and "document length" in out
    assert "val sequence 0:" in out

    code, out, _ = maxpipe(capsys, "prep", *common, f"output={data}")  # same inputs and config: a cache hit
    assert code == 0 and "cache hit" in out and version in out

    code, _, err = maxpipe(capsys, "prep", *common, "seq_len=32", f"output={data}")  # another version: refused
    assert code == 1 and "already holds version" in one_error_line(err)
    assert json.loads((data / MANIFEST).read_text())["version"] == version

    assert maxpipe(capsys, "train", *common, "steps=4", f"dataset={data}", f"output={run}")[0] == 0
    code, _, err = maxpipe(capsys, "data", "inspect", str(run))
    assert code == 1 and "not a dataset" in one_error_line(err)
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["4"]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4
    assert maxpipe(capsys, "export", *common, "steps=4", f"src={run}", f"dataset={data}", f"output={export}")[0] == 0
    assert (export / "hf" / "model.safetensors").is_file() and (export / "params").is_dir()
    assert maxpipe(capsys, "eval", *common, f"src={export}", f"dataset={data}", f"output={report}")[0] == 0
    metrics = json.loads((report / "metrics.json").read_text())
    assert metrics["val_loss"] > 0 and metrics["val_perplexity"] > 1


def test_prep_with_beam_worker_processes_prints_only_its_own_lines(corpus, tmp_path, capfd):
    common = ["tiny", f"data.input={corpus}/*.py", "data.beam_args=[--direct_num_workers=1]"]
    code, out, err = maxpipe(capfd, "prep", *common, f"output={tmp_path / 'a'}")
    assert code == 0 and "prep:" in out
    assert err == "", err  # Beam's workers' start-up lines are dropped
    # Even unfiltered (--debug) the workers log only what precedes reading the pipeline options.
    code, out, err = maxpipe(capfd, "prep", *common, f"output={tmp_path / 'b'}", "--debug")
    assert code == 0 and "INFO:apache_beam.runners.worker" not in out + err


def test_missing_corpus_and_tokenizer_are_one_line(corpus, tmp_path, capsys):
    code, _, err = maxpipe(capsys, "prep", "tiny", f"data.input={tmp_path}/none/*.txt", f"output={tmp_path / 'a'}")
    assert code == 1 and "no input files match" in one_error_line(err)
    code, _, err = maxpipe(
        capsys, "prep", "tiny", f"data.input={corpus}/*.py", f"tokenizer={tmp_path}/no-such.json", f"output={tmp_path / 'b'}"
    )
    assert code == 1 and "no-such.json" in one_error_line(err)
    assert not list(tmp_path.rglob(MANIFEST))


def test_config_error_before_any_work(tmp_path, capsys):
    code, _, err = maxpipe(capsys, "prep", "tiny", "sequence_len=3", f"output={tmp_path / 'x'}")
    assert code == 1 and "unknown config key 'sequence_len'" in one_error_line(err)
    assert not (tmp_path / "x").exists()
    code, _, err = maxpipe(capsys, "train", "tiny", f"output={tmp_path / 'y'}")
    assert code == 1 and "missing dataset=DIR" in one_error_line(err)


def test_checkpoint_that_does_not_fit_the_model(corpus, tmp_path, capsys):
    hf = tiny_hf_llama(tmp_path / "hf", corpus, mlp_dim=96)
    capsys.readouterr()  # transformers' own progress output
    code, _, err = maxpipe(capsys, "ingest", "tiny", f"src={hf}", f"output={tmp_path / 'params'}")
    assert code == 1 and "mlp_dim" in one_error_line(err) and "96" in err and "128" in err
    assert not (tmp_path / "params" / MANIFEST).exists()


def test_pickle_weights_need_an_explicit_flag(corpus, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file

    hf = tiny_hf_llama(tmp_path / "hf", corpus)
    capsys.readouterr()
    torch.save(load_file(hf / "model.safetensors"), hf / "pytorch_model.bin")
    (hf / "model.safetensors").unlink()
    code, _, err = maxpipe(capsys, "ingest", "tiny", f"src={hf}", f"output={tmp_path / 'refused'}")
    assert code == 1 and "pipeline.hf_allow_pickle=true" in one_error_line(err)
    code, out, err = maxpipe(capsys, "ingest", "tiny", f"src={hf}", f"output={tmp_path / 'params'}", "hf_allow_pickle=true")
    assert code == 0, err
    assert json.loads((tmp_path / "params" / MANIFEST).read_text())["config"]["allow_pickle"] is True


def test_compile_writes_a_spec_kfp_loads(tmp_path, capsys):
    from kfp import components

    spec = tmp_path / "pipeline.yaml"
    args = ["pipeline.hf_checkpoint=/data/llama", "resources.images.gpu=eu.gcr.io/p/maxpipe-gpu:v1",
            "resources.train.accelerator_count=8", "resources.prep.memory=48G"]
    assert maxpipe(capsys, "compile", "tiny", *args, "-o", str(spec))[0] == 0
    pipeline = components.load_component_from_file(str(spec))
    assert pipeline.name == "maxpipe"
    tasks = yaml.safe_load(spec.read_text())["root"]["dag"]["tasks"]
    assert set(tasks) == {"prep", "ingest", "train", "export", "evaluate"}
    assert tasks["train"]["inputs"]["artifacts"]["init_params"]["taskOutputArtifact"]["producerTask"] == "ingest"
    # The runner's cache would miss new data files and code inside an image: the artifact store decides.
    assert not any(task.get("cachingOptions", {}).get("enableCache") for task in tasks.values())
    executors = yaml.safe_load(spec.read_text())["deploymentSpec"]["executors"]
    train = executors["exec-train"]["container"]
    assert train["image"] == "eu.gcr.io/p/maxpipe-gpu:v1"
    assert train["resources"]["accelerator"]["type"] == "NVIDIA_H100_80GB"
    assert int(train["resources"]["accelerator"]["count"]) == 8
    prep = executors["exec-prep"]["container"]
    assert prep["image"] == "maxpipe-cpu:latest" and prep["resources"]["memoryLimit"] == 48.0
    assert "accelerator" not in prep["resources"]

    assert maxpipe(capsys, "compile", "tiny", "-o", str(spec))[0] == 0  # no checkpoint: no ingest step
    assert "ingest" not in yaml.safe_load(spec.read_text())["root"]["dag"]["tasks"]


def test_train_compile_only_reports_memory_without_data(capsys):
    code, out, err = maxpipe(capsys, "train", "tiny", "--compile-only", "train.mesh={fsdp: 4, tensor: 2}")
    assert code == 0, err
    assert "mesh {'data': 1, 'fsdp': 4, 'expert': 1, 'context': 1, 'tensor': 2}" in out and "GiB per device" in out
    code, out, err = maxpipe(capsys, "train", "tiny", "--compile-only", "train.batch_size=6", "train.mesh={data: -1}")
    assert code == 1 and "batch_size" in one_error_line(err)
    code, out, err = maxpipe(capsys, "train", "tiny", "--compile-only", "model.attention=cudnn")
    assert code == 1 and "model.attention=cudnn needs an NVIDIA GPU" in one_error_line(err)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (pip install -e '.[tpu]')")
def test_train_compile_only_for_a_tpu_slice(capsys):
    code, out, err = maxpipe(capsys, "train", "tiny", "--topology", "v5e-4", "data.seq_len=128", "--compile-only")
    assert code == 0, err
    assert "attention: splash" in out and "compiled the train step for v5e-4 (4 x TPU v5 lite)" in out and "fits" in out
    code, out, err = maxpipe(capsys, "train", "tiny", "--compile-only", "--topology=v5e-4", "model=llama3_8b",
                             "model.num_layers=2", "train.batch_size=4")
    assert code == 1 and "does not fit, needs" in out


def test_topology_needs_compile_only_and_a_known_slice(capsys):
    code, out, err = maxpipe(capsys, "train", "tiny", "--topology", "v5e-4")
    assert code == 1 and "add --compile-only" in one_error_line(err)
    code, out, err = maxpipe(capsys, "train", "tiny", "--compile-only", "--topology", "v9-8")
    assert code == 1 and "unknown TPU slice 'v9-8'" in one_error_line(err)


def test_local_run_output_keeps_the_steps_lines_and_drops_kfp_listings() -> None:
    """Without --debug, kfp.local's executor dumps and output-artifact listings are dropped; step lines and errors stay."""
    import io

    from pipelines.local import _Filter

    kfp_log = """04:27:19.550 - INFO - Executing task 'train'
04:27:19.550 - INFO - Streamed logs:
    [KFP Executor 2026-11-24 04:27:20,000 INFO]: Got executor_input:
    {
        "inputs": {}
    }
    [train] version b4ea1de5df13 -> /runs/store/train/b4ea1de5df13
    maxpipe error: something went wrong
04:27:19.548 - INFO - Task 'train' outputs:
    checkpoints: Model( name='checkpoints',
                        metadata={'config': {'model': {}}} )
--------------------------------------------------------------------------------
04:27:30.000 - INFO - Executing task 'export'
"""
    out, errors = io.StringIO(), []
    sink = _Filter(out, errors, verbose=False)
    sink.write(kfp_log)
    sink.flush()
    assert out.getvalue().splitlines() == [
        "04:27:19.550 - INFO - Executing task 'train'", "04:27:19.550 - INFO - Streamed logs:",
        "    [train] version b4ea1de5df13 -> /runs/store/train/b4ea1de5df13", "    maxpipe error: something went wrong",
        "-" * 80, "04:27:30.000 - INFO - Executing task 'export'",
    ]
    assert errors == ["something went wrong"]
