"""Lineage for people: an indented tree, JSON, mermaid and Graphviz dot text, and a self-contained HTML page."""

from __future__ import annotations

import html
import json
from dataclasses import asdict
from typing import Any

from pipelines.lineage_store import Artifact, LineageView, Tree

FORMATS = ("tree", "json", "mermaid", "dot", "html")
MERMAID_JS = "https://cdn.jsdelivr.net/npm/mermaid@11/dist/mermaid.esm.min.mjs"
SHORT = 16  # characters of a version shown (data fingerprints are 64)


def render(view: LineageView, fmt: str = "tree") -> str:
    """The view in one of FORMATS."""
    renderers = {"tree": tree_text, "json": view_json, "mermaid": mermaid, "dot": dot, "html": html_page}
    return renderers[fmt](view)


def tree_text(view: LineageView) -> str:
    """The upstream tree of the focus (each node with its step, time, key stats, config and uri), then its users."""
    lines = _tree_lines(view.upstream, "", "", set())
    lines.append("")
    if view.downstream:
        count = len({n.artifact.key for t in view.downstream for n in t.walk()})
        lines.append(f"used by ({count} artifact{'s' if count != 1 else ''} downstream):")
        shown: set[str] = {view.focus.key}
        for i, tree in enumerate(view.downstream):
            last = i == len(view.downstream) - 1
            lines += _tree_lines(tree, "└─ " if last else "├─ ", "   " if last else "│  ", shown)
    else:
        lines.append("used by: nothing yet")
    return "\n".join(lines)


def view_dict(view: LineageView) -> dict[str, Any]:
    """The view as plain data: the focus, upstream tree (`inputs`), downstream forest (`used_by`), the graph."""
    return {
        "artifact": artifact_dict(view.focus),
        "upstream": _tree_dict(view.upstream, "inputs"),
        "downstream": [_tree_dict(t, "used_by") for t in view.downstream],
        "graph": {"nodes": [artifact_dict(a) for a in view.nodes],
                  "edges": [{"from": src, "to": dst} for src, dst in view.edges]},
    }


def view_json(view: LineageView) -> str:
    """`lineage show --json`."""
    return json.dumps(view_dict(view), indent=2)


def artifact_dict(artifact: Artifact) -> dict[str, Any]:
    """An artifact as plain data (with `external` spelled out)."""
    return {**asdict(artifact), "external": artifact.external}


def mermaid(view: LineageView) -> str:
    """A mermaid flowchart of the graph, sources on the left; the focus highlighted."""
    ids = {a.key: f"n{i}" for i, a in enumerate(view.nodes)}
    lines = ["flowchart LR"]
    for a in view.nodes:
        label = "<br/>".join(_mermaid_escape(part) for part in _label_parts(a))
        lines.append(f'  {ids[a.key]}["{label}"]')
    lines += [f"  {ids[src]} --> {ids[dst]}" for src, dst in view.edges]
    lines += [
        "  classDef focus fill:#ffe8a3,stroke:#b07d00,stroke-width:2px",
        "  classDef source fill:#eef2f7,stroke:#7a8ca5",
        "  classDef missing stroke-dasharray:4 3",
        f"  class {ids[view.focus.key]} focus",
    ]
    for cls, members in (("source", [a for a in view.nodes if a.external]), ("missing", _missing(view))):
        if members:
            lines.append(f"  class {','.join(ids[a.key] for a in members)} {cls}")
    return "\n".join(lines) + "\n"


def dot(view: LineageView) -> str:
    """The graph in Graphviz dot (`dot -Tsvg`), sources on the left; the focus highlighted."""
    ids = {a.key: f"n{i}" for i, a in enumerate(view.nodes)}
    missing = {a.key for a in _missing(view)}
    lines = ["digraph lineage {", "  rankdir=LR;",
             '  node [shape=box, style="rounded", fontname="Helvetica", fontsize=10];']
    for a in view.nodes:
        label = "\\n".join(_dot_escape(part) for part in _label_parts(a))
        attrs = [f'label="{label}"']
        if a.key == view.focus.key:
            attrs.append('style="rounded,filled,bold", fillcolor="#ffe8a3"')
        elif a.external:
            attrs.append('shape=folder, style="filled", fillcolor="#eef2f7"')
        elif a.key in missing:
            attrs.append('style="rounded,dashed"')
        attrs.append(f'tooltip="{_dot_escape(a.uri)}"')
        lines.append(f"  {ids[a.key]} [{', '.join(attrs)}];")
    lines += [f"  {ids[src]} -> {ids[dst]};" for src, dst in view.edges]
    return "\n".join(lines + ["}"]) + "\n"


def html_page(view: LineageView) -> str:
    """A page a browser opens: the mermaid graph (mermaid.js from a CDN draws it), and the tree and a table (no JS)."""
    focus = view.focus
    title = f"lineage of {focus.kind} {_short(focus.version)}"
    rows = "\n".join(
        "<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in (
            a.kind, a.version, _step(a), _time(a.created), _stats_text(a.stats), a.config_summary, a.uri)) + "</tr>"
        for a in view.nodes)
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{html.escape(title)}</title>
<style>
  body {{ font: 14px/1.45 system-ui, sans-serif; margin: 2em; color: #1d232b; }}
  pre {{ background: #f6f8fa; padding: 1em; overflow-x: auto; }}
  pre.mermaid {{ background: none; }}
  table {{ border-collapse: collapse; font-size: 13px; }}
  th, td {{ border: 1px solid #d0d7de; padding: 4px 8px; text-align: left; vertical-align: top; }}
  th {{ background: #f6f8fa; }}
  .note {{ color: #57606a; font-size: 12px; }}
</style>
</head>
<body>
<h1>{html.escape(title)}</h1>
<p><code>{html.escape(focus.uri)}</code></p>
<h2>Graph</h2>
<pre class="mermaid">{html.escape(mermaid(view))}</pre>
<p class="note">Drawn by mermaid.js from {html.escape(MERMAID_JS)}; offline, the text above is the graph's source.</p>
<h2>Upstream and downstream</h2>
<pre class="tree">{html.escape(tree_text(view))}</pre>
<h2>Artifacts</h2>
<table>
<tr><th>kind</th><th>version</th><th>step</th><th>created</th><th>key stats</th><th>config</th><th>uri</th></tr>
{rows}
</table>
<script type="module">
  import mermaid from "{MERMAID_JS}";
  mermaid.initialize({{ startOnLoad: false, securityLevel: "strict" }});
  const box = document.querySelector("pre.mermaid");
  const {{ svg }} = await mermaid.render("lineage-graph", box.textContent);
  box.innerHTML = svg;
</script>
</body>
</html>
"""


def list_text(artifacts: list[Artifact]) -> str:
    """`lineage list`: one row per artifact."""
    header = ("KIND", "VERSION", "STEP", "CREATED", "KEY STATS", "URI")
    rows = [header] + [(a.kind, _short(a.version), _step(a), _time(a.created), _stats_text(a.stats, 3), a.uri)
                       for a in artifacts]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows)


def list_json(artifacts: list[Artifact]) -> str:
    """`lineage list --json`."""
    return json.dumps([artifact_dict(a) for a in artifacts], indent=2)


def _tree_lines(tree: Tree, first: str, rest: str, shown: set[str]) -> list[str]:
    """A node's lines (header, details) under tree guides, then its children's."""
    a = tree.artifact
    if tree.repeat:
        where = "above" if a.key in shown else "below"
        return [f"{first}{a.kind} {_short(a.version)}  (shown {where})"]
    shown.add(a.key)
    lines = [f"{first}{a.kind} {_short(a.version)}  {_step(a)}" + (f" · {_time(a.created)}" if a.created else "")]
    guide = rest + ("│  " if tree.children else "   ")
    details = [_stats_text(a.stats), f"config: {a.config_summary}" if a.config_summary else "", a.uri]
    lines += [guide + d for d in details if d]
    for i, child in enumerate(tree.children):
        last = i == len(tree.children) - 1
        lines += _tree_lines(child, rest + ("└─ " if last else "├─ "), rest + ("   " if last else "│  "), shown)
    return lines


def _tree_dict(tree: Tree, children: str) -> dict[str, Any]:
    if tree.repeat:
        a = tree.artifact
        return {"kind": a.kind, "version": a.version, "uri": a.uri, "key": a.key, "repeat": True}
    return {**artifact_dict(tree.artifact), children: [_tree_dict(c, children) for c in tree.children]}


def _label_parts(a: Artifact) -> list[str]:
    stats = _stats_text(dict(list(a.stats.items())[:2]))
    return [a.kind, _short(a.version), _step(a)] + ([stats] if stats else [])


def _missing(view: LineageView) -> list[Artifact]:
    """Artifacts known only as someone's input: no manifest of theirs was indexed."""
    return [a for a in view.nodes if a.step is None and not a.external]


def _step(a: Artifact) -> str:
    return a.step or ("source" if a.external else "not indexed")


def _short(version: str) -> str:
    return version if len(version) <= SHORT else version[:SHORT] + "…"


def _time(created: str | None) -> str:
    return (created or "").replace("T", " ").replace("+00:00", " UTC")


def _stats_text(stats: dict[str, Any], limit: int | None = None) -> str:
    items = list(stats.items())[:limit]
    return "  ".join(f"{k}={_number(v)}" for k, v in items)


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if value.is_integer() and abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _mermaid_escape(text: str) -> str:
    """Mermaid's entity codes for what would end a label or read as markup."""
    return text.replace("#", "#35;").replace('"', "#quot;").replace("<", "#lt;").replace(">", "#gt;")


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')
