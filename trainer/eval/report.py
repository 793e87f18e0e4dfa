"""The eval step's report: loss curves (an SVG drawn here, no plotting library), the eval table, the training's
goodput, generated samples."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from trainer.train.goodput import GOODPUT_FILE, parts, read_totals

Series = dict[str, list[tuple[float, float]]]
_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")


def read_loss_curves(metrics_path: str | Path | None) -> Series:
    """{"train": [(step, loss)], "validation": [(step, val_loss)]} from a training metrics JSONL file (absent: empty)."""
    curves: Series = {"train": [], "validation": []}
    if metrics_path is None or not Path(metrics_path).is_file():
        return curves
    for line in Path(metrics_path).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a writer that died mid-line leaves a partial last row
        if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)):
            continue
        for key, name in (("loss", "train"), ("val_loss", "validation")):
            value = row.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                curves[name].append((float(row["step"]), float(value)))
    return curves


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if m * step >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def loss_svg(curves: Series, width: int = 640, height: int = 320) -> str:
    """An SVG line plot of loss against step, one polyline per non-empty series, with axes, ticks and a legend."""
    points = [p for series in curves.values() for p in series]
    if not points:
        return ""
    left, right, top, bottom = 56, 16, 16, 40
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    sx = lambda x: left + (x - x0) / (x1 - x0) * (width - left - right)  # noqa: E731
    sy = lambda y: height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom)  # noqa: E731
    out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
            f'font-size="11" role="img" aria-label="loss curves">'),
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="black"/>']
    for x in _ticks(x0, x1):
        out.append(f'<text x="{sx(x):.1f}" y="{height - bottom + 14}" text-anchor="middle">{x:g}</text>')
    for y in _ticks(y0, y1):
        out.append(f'<line x1="{left}" y1="{sy(y):.1f}" x2="{width - right}" y2="{sy(y):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 4}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:.4g}</text>')
    out.append(f'<text x="{(left + width - right) / 2}" y="{height - 6}" text-anchor="middle">step</text>')
    out.append(f'<text x="12" y="{(top + height - bottom) / 2}" transform="rotate(-90 12 {(top + height - bottom) / 2})" '
               f'text-anchor="middle">loss</text>')
    for i, (name, series) in enumerate((n, s) for n, s in curves.items() if s):
        colour = _COLOURS[i % len(_COLOURS)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in series)
        out.append(f'<polyline class="series" data-name="{html.escape(name)}" fill="none" stroke="{colour}" '
                   f'stroke-width="1.5" points="{coords}"/>')
        if len(series) == 1:
            out.append(f'<circle cx="{sx(series[0][0]):.1f}" cy="{sy(series[0][1]):.1f}" r="3" fill="{colour}"/>')
        out.append(f'<text x="{width - right - 90}" y="{top + 14 * (i + 1)}" fill="{colour}">{html.escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _table(results: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [(k, results[k]) for k in ("val_loss", "val_perplexity", "val_tokens") if k in results]
    for task in results.get("tasks", []):
        rows.append((f"{task['task']} accuracy ({task['examples']} examples)", task["accuracy"]))
        rows.append((f"{task['task']} accuracy_norm", task["accuracy_norm"]))
    return [(name, f"{v:.4f}" if isinstance(v, float) else str(v)) for name, v in rows]


def _samples(results: dict[str, Any]) -> list[tuple[str, str]]:
    samples = [(s["prompt"], s["sample"]) for s in results.get("samples", [])]
    if not samples and "sample" in results:
        samples = [(results.get("prompt", ""), results["sample"])]
    return samples


def _goodput(metrics_path: str | Path | None) -> tuple[str, list[tuple[str, str, str]]]:
    """A sentence and (part, seconds, share) rows from the goodput.json beside the training metrics; none if absent."""
    totals = read_totals(Path(metrics_path).with_name(GOODPUT_FILE)) if metrics_path is not None else None
    if totals is None:
        return "", []
    total = totals["goodput_total_seconds"]
    sentence = (f"{totals['goodput']:.1%} of {total:.1f} s of training was productive (goodput), over "
                f"{totals['goodput_attempts']} attempt(s); {totals['goodput_lost_steps']} step(s) were redone after "
                "restarts.")
    return sentence, [(label, f"{s:.1f}", f"{s / total:.1%}" if total > 0 else "") for label, s in parts(totals)]


def write_report(out_dir: str | Path, results: dict[str, Any], metrics_path: str | Path | None = None) -> list[Path]:
    """Write report.md (with loss.svg beside it) and report.html (SVG inline) into out_dir; returns their paths.

    `results` is what `trainer.eval.evaluate.evaluate` returns; `metrics_path` the training metrics.jsonl, if any; the
    goodput.json beside it adds a goodput section.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    curves = read_loss_curves(metrics_path)
    if "val_loss" in results and curves["train"] and not curves["validation"]:
        curves["validation"] = [(curves["train"][-1][0], float(results["val_loss"]))]  # the final eval, as a point
    svg = loss_svg(curves)
    table, samples = _table(results), _samples(results)
    goodput, goodput_rows = _goodput(metrics_path)
    written = []

    md = ["# Evaluation report", "", "## Loss", ""]
    if svg:
        (out / "loss.svg").write_text(svg + "\n")
        written.append(out / "loss.svg")
        md += ["![training and validation loss](loss.svg)", ""]
    else:
        md += ["No training metrics were available.", ""]
    md += ["## Results", "", "| metric | value |", "|---|---|"]
    md += [f"| {name} | {value} |" for name, value in table]
    if goodput_rows:
        md += ["", "## Goodput", "", goodput, "", "| time | seconds | share |", "|---|---:|---:|"]
        md += [f"| {part} | {seconds} | {share} |" for part, seconds, share in goodput_rows]
    md += ["", "## Samples", ""]
    for prompt, sample in samples:
        md += ["```", prompt + sample, "```", ""]
    (out / "report.md").write_text("\n".join(md) + "\n")

    esc = html.escape
    goodput_html = [
        "<h2>Goodput</h2>", f"<p>{esc(goodput)}</p>", "<table><tr><th>time</th><th>seconds</th><th>share</th></tr>",
        *[f"<tr><td>{esc(part)}</td><td>{seconds}</td><td>{share}</td></tr>" for part, seconds, share in goodput_rows],
        "</table>",
    ] if goodput_rows else []
    page = ["<!doctype html>", '<html><head><meta charset="utf-8"><title>Evaluation report</title>',
            ("<style>body{font-family:sans-serif;max-width:760px;margin:2em auto}td,th{padding:2px 10px;text-align:left}"
             "pre{background:#f6f6f6;padding:8px;white-space:pre-wrap}</style></head><body>"),
            "<h1>Evaluation report</h1>", "<h2>Loss</h2>", svg or "<p>No training metrics were available.</p>",
            "<h2>Results</h2>", "<table><tr><th>metric</th><th>value</th></tr>",
            *[f"<tr><td>{esc(n)}</td><td>{esc(v)}</td></tr>" for n, v in table], "</table>", *goodput_html,
            "<h2>Samples</h2>",
            *[f"<pre><b>{esc(p)}</b>{esc(s)}</pre>" for p, s in samples], "</body></html>"]
    (out / "report.html").write_text("\n".join(page) + "\n")
    return [out / "report.md", out / "report.html", *written]
