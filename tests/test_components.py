"""The component layer's plumbing: where Beam writes when prep runs on Dataflow from the pipeline."""

from pathlib import Path

import pytest

from components import steps
from configs import load_config
from contract.manifest import mounted_url
from data_prep.pipeline import pipeline_options
from data_prep.prep import beam_target

DATAFLOW = ["--runner=DataflowRunner", "--project=p", "--region=europe-west4", "--temp_location=gs://bkt/tmp"]


@pytest.mark.parametrize("beam_args, expected", [
    ([], "/gcs/bkt/store/prep/v1"),
    (DATAFLOW, "gs://bkt/store/prep/v1"),
])
def test_prep_on_dataflow_writes_to_the_bucket_not_the_tasks_mount(beam_args: list[str], expected: str) -> None:
    assert str(beam_target(Path("/gcs/bkt/store/prep/v1"), pipeline_options(beam_args))) == expected


def test_the_prep_step_passes_beam_args_apart_from_what_versions_it(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("some text\n")
    plans = [steps.plan_prep(load_config("tiny", [f"data.input=[{tmp_path}/*.txt]", *extra]), log=lambda _: None)
             for extra in ([], [f"data.beam_args={DATAFLOW}".replace("'", "")])]
    assert plans[1].work.keywords["beam_args"] == DATAFLOW and plans[1].settings == {"beam_args": DATAFLOW}
    assert plans[0].version == plans[1].version  # where Beam runs is not what it writes
    with pytest.raises(AttributeError):
        plans[1].work.keywords["cfg"].beam_args


def test_mounted_url() -> None:
    assert mounted_url("/gcs/bkt/a/b") == "gs://bkt/a/b"
    assert mounted_url(Path("/tmp/x")) == "/tmp/x"
