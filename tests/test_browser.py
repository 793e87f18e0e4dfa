"""The pages people open (lineage graph, eval report) in headless Chromium, offline: their DOM after layout,
their network log and a screenshot. Skipped only where no Chromium is installed (`apt-get install chromium`)."""

from __future__ import annotations

import hashlib
import html
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from contract import manifest as artifacts
from pipelines.lineage import lineage_main
from trainer.eval.report import write_report

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="no chromium, chromium-browser or google-chrome on PATH "
                                 "(Debian: apt-get install chromium)"),
              pytest.mark.timeout(180)]
WINDOW = (1900, 1200)
CODE = "c0de00000001"

# Appended to a copy of the page: the geometry the browser laid out, as JSON in <pre id="measured">.
MEASURE = """<script>
const box = (e) => { const r = e.getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; };
const svg = document.querySelector("svg");
const out = {window: [innerWidth, innerHeight, devicePixelRatio], svg: svg && box(svg),
  texts: [...document.querySelectorAll("svg text")].map((t) => ({text: t.textContent, box: box(t)})),
  nodes: [...document.querySelectorAll("svg g.node")].map((g) => ({version: g.dataset.version,
    rect: box(g.querySelector("rect")), texts: [...g.querySelectorAll("text")].map((t) => [t.textContent, box(t)])})),
  edges: [...document.querySelectorAll("svg path.edge")].map((p) => p.getTotalLength()),
  lines: [...document.querySelectorAll("svg polyline")].map((p) => ({name: p.dataset.name, box: box(p),
    points: p.points.numberOfItems}))};
const pre = document.createElement("pre");
pre.id = "measured";
pre.textContent = JSON.stringify(out);
document.body.append(pre);
</script>
"""


class _Elements(HTMLParser):
    """Every start tag of a document with its attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}))


def elements(page: str) -> list[tuple[str, dict[str, str]]]:
    parser = _Elements()
    parser.feed(page)
    return parser.elements


def external_references(page: str) -> list[str]:
    """Attributes and CSS that would make a browser fetch from another host (`xmlns` names, never fetches)."""
    refs = [f"<{tag} {k}={v}>" for tag, attrs in elements(page) for k, v in attrs.items()
            if k in ("src", "href", "xlink:href", "srcset", "poster", "data", "action", "background")
            and re.match(r"\s*(https?:|wss?:|ftp:)?//", v)]
    return refs + re.findall(r"(?:url\(|@import)\s*['\"]?\s*(?:https?:)?//[^)'\"\s]*", page)


def browse(page: Path, out: Path) -> tuple[dict[str, Any], str, list[str], Image.Image]:
    """Open a measuring copy of `page`: (its geometry, the DOM after scripts ran, URLs it requested, the screenshot)."""
    out.mkdir(parents=True, exist_ok=True)
    head, end, tail = page.read_text().rpartition("</body>")
    assert end, f"{page}: no </body>"
    copy = out / page.name
    copy.write_text(head + MEASURE + end + tail)
    netlog, shot = out / "netlog.json", out / "screenshot.png"
    proc = subprocess.run(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", f"--user-data-dir={out / 'profile'}",
         "--no-first-run", "--no-default-browser-check", "--disable-background-networking", "--disable-sync",
         "--disable-component-update", "--disable-extensions", "--host-resolver-rules=MAP * ~NOTFOUND",
         f"--window-size={WINDOW[0]},{WINDOW[1]}", "--force-device-scale-factor=1", "--hide-scrollbars",
         "--virtual-time-budget=5000", f"--log-net-log={netlog}", f"--screenshot={shot}", "--dump-dom",
         copy.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-3000:]
    dom = proc.stdout
    found = re.search(r'<pre id="measured">(.*?)</pre>', dom, re.S)
    assert found, f"the measuring script did not run: {dom[-500:]}"
    measured = json.loads(html.unescape(found.group(1)))
    return measured, dom, page_requests(netlog), Image.open(shot).convert("RGB")


def page_requests(netlog: Path) -> list[str]:
    """URLs the page asked the network for (requests in a file:// page's context, not the browser's own)."""
    log = json.loads(netlog.read_text())
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    return [e["params"]["url"] for e in log["events"] if e["type"] == start
            and "file://" in e["params"].get("network_isolation_key", "")
            and not e["params"]["url"].startswith(("file:", "data:", "blob:", "about:"))]


def pixels(image: Image.Image, box: list[float], colour: tuple[int, int, int] | None = None,
           dark: int | None = None) -> int:
    """How many pixels in `box` (x, y, w, h, clipped to the image) are near `colour`, or darker than `dark`."""
    x0, y0 = max(int(box[0]), 0), max(int(box[1]), 0)
    x1, y1 = min(int(box[0] + box[2]), image.width), min(int(box[1] + box[3]), image.height)
    if x1 <= x0 or y1 <= y0:
        return 0
    rgb = np.asarray(image.crop((x0, y0, x1, y1)), dtype=int)
    if colour is not None:
        return int((np.abs(rgb - colour).max(axis=-1) <= 24).sum())
    return int((rgb.mean(axis=-1) < dark).sum())


def area(box: list[float]) -> float:
    return box[2] * box[3]


def overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[0] + b[2] and b[0] < a[0] + a[2] and a[1] < b[1] + b[3] and b[1] < a[1] + a[3]


def publish(store: Path, kind: str, step: str, config: dict, inputs: list[dict], stats: dict) -> Path:
    """A complete artifact dir `{store}/{step}/{version}`: a payload, then the manifest."""
    key = json.dumps([step, config, [i["version"] for i in inputs], CODE], sort_keys=True)
    version = hashlib.sha256(key.encode()).hexdigest()[:12]  # any content hash names a version here
    directory = store / step / version
    directory.mkdir(parents=True)
    (directory / "payload.bin").write_bytes(b"\0")
    artifacts.publish(directory, kind=kind, step=step, version=version, code=CODE, config=config, settings={},
                      inputs=inputs, stats=stats)
    return directory


@pytest.fixture
def lineage_page(tmp_path, capsys) -> tuple[Path, dict[str, Any]]:
    """Two runs sharing one dataset (prep, then train -> export -> eval twice), as `maxpipe lineage show --format html`
    writes them for the dataset; and the same view as `--json`."""
    root, store = tmp_path / "runs", tmp_path / "runs" / "store"
    corpus = {"kind": "files", "version": hashlib.sha256(b"corpus").hexdigest(), "uri": "corpus/*.txt"}
    dataset = publish(store, "dataset", "prep", {"data": {"seq_len": 64}}, [corpus],
                      {"documents": {"train": 10, "val": 1}, "tokens": {"train": 138913, "val": 5656}})
    for steps in (8, 12):
        ckpt = publish(store, "checkpoints", "train", {"train": {"steps": steps}}, [artifacts.reference(dataset)],
                       {"steps": steps, "final_loss": 6.2448})
        model = publish(store, "exported_model", "export", {"model": {"steps": steps}},
                        [artifacts.reference(ckpt), artifacts.reference(dataset)], {"hf": {"parameters": 139584}})
        publish(store, "metrics", "eval", {"eval": {"steps": steps}},
                [artifacts.reference(model), artifacts.reference(dataset)], {"val_loss": 6.2467})
    assert lineage_main(["rebuild", str(root)]) == 0
    page = tmp_path / "lineage.html"
    assert lineage_main(["show", str(dataset), "--root", str(root), "--format", "html", "-o", str(page)]) == 0
    capsys.readouterr()
    assert lineage_main(["show", str(dataset), "--root", str(root), "--json"]) == 0
    return page, json.loads(capsys.readouterr().out)


def test_network_check_sees_a_page_fetch(tmp_path):
    """The network-log reading below catches a page that fetches (so that its silence elsewhere means something)."""
    page = tmp_path / "fetches.html"
    page.write_text('<!doctype html><html><body><img src="https://cdn.example.invalid/x.png">'
                    '<svg width="10" height="10"></svg></body></html>')
    assert external_references(page.read_text()) == ['<img src=https://cdn.example.invalid/x.png>']
    _, _, requested, _ = browse(page, tmp_path / "browser")
    assert requested == ["https://cdn.example.invalid/x.png"]


def test_lineage_page_draws_its_graph_without_the_network(lineage_page, tmp_path):
    page, view = lineage_page
    text = page.read_text()
    assert "<script" not in text and external_references(text) == []
    measured, dom, requested, shot = browse(page, tmp_path / "browser")
    assert requested == [] and external_references(dom) == []

    # one box per artifact, labelled with its kind, short version and step, inside the box it belongs to
    nodes, graph = measured["nodes"], view["graph"]
    assert sorted(n["version"] for n in nodes) == sorted(a["version"] for a in graph["nodes"])
    for artifact in graph["nodes"]:
        node = next(n for n in nodes if n["version"] == artifact["version"])
        labels = [t for t, _ in node["texts"]]
        step = artifact["step"] or ("source" if artifact["external"] else "not indexed")
        assert labels[0] == artifact["kind"] and labels[1] == artifact["version"][:16] + (
            "…" if len(artifact["version"]) > 16 else "") and labels[2] == step, labels
        rect = node["rect"]
        for label, box in node["texts"]:
            assert box[2] > 0 and rect[0] < box[0] and box[0] + box[2] < rect[0] + rect[2], (label, box, rect)
            assert rect[1] < box[1] and box[1] + box[3] < rect[1] + rect[3], (label, box, rect)
    assert "tokens.train=138,913  tokens.val=5,656" in [t for n in nodes for t, _ in n["texts"]]
    assert not [(a["version"], b["version"]) for i, a in enumerate(nodes) for b in nodes[i + 1:]
                if overlap(a["rect"], b["rect"])]
    # one drawn path per edge, sources on the left of what was made from them
    assert len(measured["edges"]) == len(graph["edges"]) == 11 and all(length > 20 for length in measured["edges"])
    left = {n["version"]: n["rect"][0] for n in nodes}
    by_key = {a["key"]: a["version"] for a in graph["nodes"]}
    assert all(left[by_key[e["from"]]] < left[by_key[e["to"]]] for e in graph["edges"])

    # the screenshot: the whole graph in view, the focus box filled, every box with its text, edges between
    width, _, scale = measured["window"]  # the screenshot is the page's top, at the layout's width and scale
    assert (shot.width, width, scale) == (WINDOW[0], WINDOW[0], 1)
    svg = measured["svg"]
    assert svg[0] >= 0 and svg[0] + svg[2] <= shot.width and svg[1] >= 0 and svg[1] + svg[3] <= shot.height, svg
    focus = next(n for n in nodes if n["version"] == view["artifact"]["version"])
    assert pixels(shot, focus["rect"], colour=(0xFF, 0xE8, 0xA3)) > 0.5 * area(focus["rect"])
    for node in nodes:
        assert pixels(shot, node["rect"], dark=110) > 100, node["version"]
    boxes = sum(pixels(shot, n["rect"], dark=200) for n in nodes)
    assert pixels(shot, svg, dark=200) - boxes > 500  # the edges' strokes and arrowheads


def test_eval_report_draws_its_loss_plot_without_the_network(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 6.0 - s / 10} for s in range(0, 31, 5)] + [{"step": 30, "val_loss": 3.4}]
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    results = {"val_loss": 3.4, "val_perplexity": 29.96, "val_tokens": 1000, "prompt": "def ", "sample": "f(x):"}
    write_report(tmp_path / "eval", results, metrics)
    page = tmp_path / "eval" / "report.html"
    assert "<script" not in page.read_text() and external_references(page.read_text()) == []
    measured, dom, requested, shot = browse(page, tmp_path / "browser")
    assert requested == [] and external_references(dom) == []
    assert "<td>val_perplexity</td>" in dom and "def f(x):" in re.sub(r"</?b>", "", dom)

    texts = [t["text"] for t in measured["texts"]]
    assert {"step", "loss", "train", "validation", "30"} <= set(texts), texts
    assert all(t["box"][2] > 0 for t in measured["texts"])
    lines = {line["name"]: line for line in measured["lines"]}
    assert lines["train"]["points"] == 7 and lines["validation"]["points"] == 1
    svg = measured["svg"]
    assert lines["train"]["box"][2] > 0.8 * (svg[2] - 56 - 16)  # the curve spans the x axis (less the margins)
    # the screenshot: the train curve in its colour, the validation point in its colour, axes and labels in black
    assert pixels(shot, svg, colour=(0x1F, 0x77, 0xB4)) > 300
    assert pixels(shot, svg, colour=(0xD6, 0x27, 0x28)) > 10
    assert pixels(shot, svg, dark=160) > 500
