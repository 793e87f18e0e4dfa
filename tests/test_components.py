"""The component layer's plumbing: where Beam writes when prep runs on Dataflow from the pipeline."""

from pathlib import Path
from typing import Any

import pytest

import data_prep
from components import steps
from contract import manifest as artifacts
from configs import load_config

DATAFLOW = ["--runner=DataflowRunner", "--project=p", "--region=europe-west4", "--temp_location=gs://bkt/tmp"]


@pytest.mark.parametrize("beam_args, expected", [
    ([], "/gcs/bkt/store/prep/v1"),
    (DATAFLOW, "gs://bkt/store/prep/v1"),
])
def test_prep_on_dataflow_writes_to_the_bucket_not_the_tasks_mount(
    beam_args: list[str], expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "a.txt").write_text("some text\n")
    seen: dict[str, Any] = {}
    monkeypatch.setattr(data_prep, "prepare", lambda cfg, vocab, out, log: seen.update(out=str(out), args=cfg.beam_args))
    cfg = load_config("tiny", [f"data.input=[{tmp_path}/*.txt]", f"data.beam_args={beam_args}".replace("'", "")])
    steps.plan_prep(cfg, log=lambda _: None).work(Path("/gcs/bkt/store/prep/v1"))
    assert seen == {"out": expected, "args": beam_args}


def test_mounted_url() -> None:
    assert artifacts.mounted_url("/gcs/bkt/a/b") == "gs://bkt/a/b"
    assert artifacts.mounted_url(Path("/tmp/x")) == "/tmp/x"
