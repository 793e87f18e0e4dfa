"""The eval report: loss curves as SVG from the metrics JSONL, the results table, samples, an absent metrics file."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from trainer.eval.report import loss_svg, read_loss_curves, write_report

RESULTS = {
    "val_loss": 4.5, "val_perplexity": 90.0171, "val_tokens": 1000, "prompt": "def ", "sample": "f(x): <b>&",
    "tasks": [{"task": "arc_tiny", "examples": 4, "accuracy": 0.5, "accuracy_norm": 0.75}],
}


def test_report_from_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 6.0 - s / 10, "grad_norm": 1.0} for s in range(0, 31, 5)]
    rows.insert(3, {"step": 15, "val_loss": 5.0})
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + '\n{"step": 35, "lo')  # a partial last line
    curves = read_loss_curves(metrics)
    assert curves["train"][0] == (0.0, 6.0) and len(curves["train"]) == 7 and curves["validation"] == [(15.0, 5.0)]

    paths = write_report(tmp_path / "out", RESULTS, metrics)
    assert sorted(p.name for p in paths) == ["loss.svg", "report.html", "report.md"]
    svg = ET.fromstring((tmp_path / "out" / "loss.svg").read_text())
    lines = [e for e in svg.iter() if e.tag.endswith("polyline")]
    assert [e.get("data-name") for e in lines] == ["train", "validation"]
    assert len(lines[0].get("points").split()) == 7
    xs = [float(p.split(",")[0]) for p in lines[0].get("points").split()]
    ys = [float(p.split(",")[1]) for p in lines[0].get("points").split()]
    assert xs == sorted(xs) and ys == sorted(ys)  # loss falls: SVG y grows downwards

    md = (tmp_path / "out" / "report.md").read_text()
    assert "![training and validation loss](loss.svg)" in md and "| val_perplexity | 90.0171 |" in md
    assert "| arc_tiny accuracy_norm | 0.7500 |" in md and "def f(x): <b>&" in md
    page = (tmp_path / "out" / "report.html").read_text()
    assert "<svg" in page and "f(x): &lt;b&gt;&amp;" in page and "<td>arc_tiny accuracy (4 examples)</td>" in page


def test_report_without_metrics(tmp_path):
    paths = write_report(tmp_path, RESULTS, tmp_path / "absent.jsonl")
    assert sorted(p.name for p in paths) == ["report.html", "report.md"]
    assert "No training metrics" in (tmp_path / "report.md").read_text()
    assert loss_svg({"train": [], "validation": []}) == ""
    write_report(tmp_path, {"val_loss": 3.0}, None)  # minimal results, no metrics path
