"""Lineage for people: an indented tree, JSON, mermaid and Graphviz dot text, an SVG, and a self-contained HTML page."""

from __future__ import annotations

import html
import json
from dataclasses import asdict
from typing import Any

from pipelines.lineage_graph import Artifact, LineageView, Tree

FORMATS = ("tree", "json", "mermaid", "dot", "html")
SHORT = 16  # characters of a version shown (data fingerprints are 64)
_CHAR_W, _LINE_H, _PAD, _BOX_CHARS = 6.7, 15, 8, 44  # the SVG's monospace metrics at 11px, in px; widest label


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


def svg(view: LineageView) -> str:
    """The graph as an SVG drawn here (no script, no fetch): boxes in columns by depth, sources on the left."""
    ids = {a.key: i for i, a in enumerate(view.nodes)}
    columns, chains = _layers(len(view.nodes), [(ids[s], ids[d]) for s, d in view.edges if s in ids and d in ids])
    labels = [_label_parts(a) for a in view.nodes]
    chars = min(max(len(line) for parts in labels for line in parts), _BOX_CHARS)
    box_w, box_h = round(chars * _CHAR_W) + 2 * _PAD, max(len(p) for p in labels) * _LINE_H + 2 * _PAD
    col_w, gap = box_w + 56, 20
    size = {n: box_h if n < len(labels) else _PAD for column in columns for n in column}  # a box, or a waypoint
    tall = [sum(size[n] + gap for n in column) - gap for column in columns]
    height, width = max(tall), len(columns) * col_w - 56
    x, mid = {}, {}  # each box's left side and vertical centre, and each waypoint's
    for depth, column in enumerate(columns):
        y = (height - tall[depth]) / 2
        for n in column:
            x[n], mid[n], y = depth * col_w, y + size[n] / 2, y + size[n] + gap
    aria = html.escape(f"lineage graph of {view.focus.kind} {_short(view.focus.version)}")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="lineage" width="{width + 16}" height="{height + 16}" '
           f'viewBox="-8 -8 {width + 16} {height + 16}" font-family="ui-monospace, monospace" font-size="11" '
           f'role="img" aria-label="{aria}">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
           'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#57606a"/></marker></defs>']
    for chain in chains:  # a curve between columns, a straight line through a column it crosses
        d = f"M{x[chain[0]] + box_w},{mid[chain[0]]:.1f}"
        for i, n in enumerate(chain[1:], 1):
            x0, y0, x1, y1 = x[chain[i - 1]] + box_w, mid[chain[i - 1]], x[n], mid[n]
            bend = max((x1 - x0) / 2, 24)
            d += f" C{x0 + bend},{y0:.1f} {x1 - bend},{y1:.1f} {x1},{y1:.1f}"
            if i < len(chain) - 1:
                d += f" L{x1 + box_w},{y1:.1f}"
        out.append(f'<path class="edge" d="{d}" fill="none" stroke="#57606a" stroke-width="1.3" '
                   'marker-end="url(#arrow)"/>')
    missing = {a.key for a in _missing(view)}
    for i, a in enumerate(view.nodes):
        fill, stroke, extra = "#ffffff", "#7a8ca5", ""
        if a.key == view.focus.key:
            fill, stroke, extra = "#ffe8a3", "#b07d00", ' stroke-width="2"'
        elif a.external:
            fill = "#eef2f7"
        elif a.key in missing:
            extra = ' stroke-dasharray="4 3"'
        top = mid[i] - box_h / 2
        out.append(f'<g class="node" data-version="{html.escape(a.version)}"><title>{html.escape(a.uri)}</title>'
                   f'<rect x="{x[i]}" y="{top:.1f}" width="{box_w}" height="{box_h}" rx="6" fill="{fill}" '
                   f'stroke="{stroke}"{extra}/>')
        for n, line in enumerate(labels[i]):
            weight = ' font-weight="bold"' if n == 0 else ""
            out.append(f'<text x="{x[i] + _PAD}" y="{top + _PAD + (n + 0.8) * _LINE_H:.1f}"{weight}>'
                       f"{html.escape(_clip(line, _BOX_CHARS))}</text>")
        out.append("</g>")
    return "\n".join(out + ["</svg>"])


def html_page(view: LineageView) -> str:
    """A self-contained page (no script, nothing fetched): the graph as inline SVG, the tree and a table."""
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
  .graph {{ overflow-x: auto; }}
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
<div class="graph">
{svg(view)}
</div>
<p class="note">Arrows go from inputs to what was made from them; the highlighted box is this artifact;
hover a box for its uri.</p>
<details><summary class="note">mermaid source (for documents that render mermaid)</summary>
<pre class="mermaid">{html.escape(mermaid(view))}</pre>
</details>
<h2>Upstream and downstream</h2>
<pre class="tree">{html.escape(tree_text(view))}</pre>
<h2>Artifacts</h2>
<table>
<tr><th>kind</th><th>version</th><th>step</th><th>created</th><th>key stats</th><th>config</th><th>uri</th></tr>
{rows}
</table>
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


def _layers(count: int, edges: list[tuple[int, int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Columns by longest-path depth, each ordered near its neighbours' rows, and each edge as a chain of nodes:
    an edge that skips columns gets a waypoint (a node numbered from `count` on) in each column it crosses."""
    parents: list[list[int]] = [[] for _ in range(count)]
    for src, dst in edges:
        parents[dst].append(src)
    depth: dict[int, int] = {}

    def place(node: int, path: frozenset[int]) -> int:
        if node not in depth:  # `path` guards against a cycle, which a lineage graph should never have
            depth[node] = 1 + max((place(p, path | {node}) for p in parents[node] if p not in path), default=-1)
        return depth[node]

    for node in range(count):
        place(node, frozenset())
    chains = []
    for src, dst in edges:
        waypoints = range(len(depth), len(depth) + max(depth[dst] - depth[src] - 1, 0))
        depth.update((w, depth[src] + 1 + i) for i, w in enumerate(waypoints))
        chains.append([src, *waypoints, dst])
    links: dict[str, list[list[int]]] = {"in": [[] for _ in depth], "out": [[] for _ in depth]}
    for chain in chains:
        for a, b in zip(chain, chain[1:]):
            links["in"][b].append(a)
            links["out"][a].append(b)
    columns: list[list[int]] = [[] for _ in range(max(depth.values(), default=0) + 1)]
    for node in sorted(depth):
        columns[depth[node]].append(node)
    row = {n: float(i) for column in columns for i, n in enumerate(column)}
    for sweep, side in ((columns[1:], "in"), (columns[-2::-1], "out"), (columns[1:], "in")):
        for column in sweep:  # barycentre sweeps, right, left, right: fewer crossings
            column.sort(key=lambda n: (sum(row[m] for m in links[side][n]) / len(links[side][n])
                                       if links[side][n] else row[n], n))
            row.update((n, float(i)) for i, n in enumerate(column))
    return columns, chains


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


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
