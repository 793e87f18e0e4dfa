"""Questions asked of a lineage store: which artifact a ref names, what it was made from, what was made from it."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

from configs import UserError
from pipelines.lineage_graph import Artifact, LineageView, Tree, build_view, spanning_tree
from pipelines.lineage_store import RUN_CONTEXT, LineageStore, normalize_uri


def resolve(store: LineageStore, ref: str) -> Artifact:
    """The artifact named by a version (a unique prefix will do), a path or a URI.

    A version found at several places (the same content) resolves to its newest copy.
    """
    return store.artifact(resolve_id(store, ref))


def resolve_id(store: LineageStore, ref: str) -> int:
    """The row id of the artifact named by `ref`; one UserError line when none or several match."""
    ref = ref.strip()
    if not ref:
        raise UserError("give an artifact: a version, a path or a URI")
    rows = store.by_uri(normalize_uri(ref))
    if not rows and store.path != ":memory:" and "://" not in ref:  # a path relative to the pipeline root
        rows = store.by_uri(normalize_uri(str(Path(store.path).parent / ref)))
    if rows:  # a place: the artifact indexed from its manifest (or, if it was replaced, the newest one)
        return int(rows[0]["id"])
    if ref.lower().isalnum():
        prefix = ref.lower()
        rows = store.db.execute(
            "SELECT id, kind, version, uri FROM artifacts WHERE substr(version, 1, ?) = ? "
            "ORDER BY step IS NULL, created DESC, uri",
            (len(prefix), prefix)).fetchall()
    if not rows:
        raise UserError(f"no artifact matches {ref!r} in {store.path} "
                        "(`maxpipe lineage list` shows them; `maxpipe lineage rebuild ROOT` re-indexes)")
    if len(rows) > 1 and len({r["version"] for r in rows}) > 1:
        shown = "; ".join(f"{r['kind']} {r['version']} at {r['uri']}" for r in rows[:4])
        more = f" and {len(rows) - 4} more" if len(rows) > 4 else ""
        raise UserError(f"{ref!r} matches {len(rows)} artifacts: {shown}{more}; "
                        "give more of the version, or the path")
    return int(rows[0]["id"])


def view(store: LineageStore, ref: str) -> LineageView:
    """Upstream tree, downstream users and the graph around the artifact named by `ref`."""
    graph = _Graph(store)
    return build_view(str(resolve_id(store, ref)), graph.get, graph.parents, graph.children)


def upstream(store: LineageStore, ref: str) -> Tree:
    """What the artifact was made from, back to its source files: a tree of its inputs."""
    graph = _Graph(store)
    return spanning_tree(str(resolve_id(store, ref)), graph.parents, graph.get)


def downstream(store: LineageStore, ref: str) -> list[Tree]:
    """What was made from the artifact: its users, each with what was made from it in turn."""
    graph = _Graph(store)
    return spanning_tree(str(resolve_id(store, ref)), graph.children, graph.get, repeats=False).children


def runs(store: LineageStore) -> dict[str, list[Artifact]]:
    """Each pipeline run context and its artifacts."""
    rows = store.db.execute(
        "SELECT c.name, t.artifact_id FROM contexts c JOIN attributions t ON t.context_id = c.id "
        "WHERE c.type = ? ORDER BY c.name, t.artifact_id", (RUN_CONTEXT,)).fetchall()
    found: dict[str, list[Artifact]] = defaultdict(list)
    for row in rows:
        found[row["name"]].append(store.artifact(row["artifact_id"]))
    return dict(found)


def snapshot(store: LineageStore) -> dict[str, Any]:
    """A canonical dump of nodes, edges and runs, independent of row ids and indexing order."""
    nodes = sorted([r["kind"], r["version"], r["uri"], r["step"], r["created"], json.loads(r["properties"])]
                   for r in store.db.execute("SELECT * FROM artifacts"))
    edges = sorted(tuple(r) for r in store.db.execute(
        "SELECT ai.version, ai.uri, ao.version, ao.uri, ex.step, ex.config FROM events i "
        "JOIN events o ON o.execution_id = i.execution_id AND o.type = 'OUTPUT' AND i.type = 'INPUT' "
        "JOIN artifacts ai ON ai.id = i.artifact_id JOIN artifacts ao ON ao.id = o.artifact_id "
        "JOIN executions ex ON ex.id = i.execution_id"))
    by_run = {name: sorted([a.version, a.uri] for a in arts) for name, arts in runs(store).items()}
    return {"nodes": nodes, "edges": [list(e) for e in edges], "runs": by_run}


def list_artifacts(store: LineageStore, kind: str | None = None) -> list[Artifact]:
    """Every artifact (of `kind`), newest first; external sources last."""
    where, args = ("WHERE kind = ?", (kind,)) if kind else ("", ())
    order = "ORDER BY created IS NULL, created DESC, kind, version"
    rows = store.db.execute(f"SELECT id FROM artifacts {where} {order}", args).fetchall()
    return [store.artifact(r["id"]) for r in rows]


def kinds(store: LineageStore) -> list[str]:
    """The artifact kinds in the store."""
    return [r[0] for r in store.db.execute("SELECT DISTINCT kind FROM artifacts ORDER BY kind")]


class _Graph:
    """The store's graph as the three lookups `build_view` walks, each answer read once per query."""

    def __init__(self, store: LineageStore) -> None:
        self.store = store
        self.memo: dict[tuple[str, str], Any] = {}

    def get(self, key: str) -> Artifact:
        return self._cached(("get", key), lambda: self.store.artifact(key))

    def parents(self, key: str) -> list[str]:
        return self._cached(("up", key), lambda: _unique(str(r[0]) for r in self.store.db.execute(
            "SELECT i.artifact_id FROM events o JOIN events i ON i.execution_id = o.execution_id AND i.type = 'INPUT' "
            "WHERE o.artifact_id = ? AND o.type = 'OUTPUT' ORDER BY i.position", (int(key),))))

    def children(self, key: str) -> list[str]:
        return self._cached(("down", key), lambda: _unique(str(r[0]) for r in self.store.db.execute(
            "SELECT o.artifact_id FROM events i JOIN events o ON o.execution_id = i.execution_id AND o.type = 'OUTPUT' "
            "JOIN artifacts a ON a.id = o.artifact_id WHERE i.artifact_id = ? AND i.type = 'INPUT' "
            "ORDER BY a.created, a.version", (int(key),))))

    def _cached(self, key: tuple[str, str], compute: Callable[[], Any]) -> Any:
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]


def _unique(items: Any) -> list[str]:
    return list(dict.fromkeys(items))
