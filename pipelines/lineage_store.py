"""The local lineage store: a SQLite index over manifests with the ML-Metadata shape.

Tables: artifacts, executions, events (INPUT/OUTPUT), contexts (pipeline runs), attributions
(artifact-context) and associations (execution-context). It holds nothing that storage does not:
the artifacts, executions and events come from manifest.json files, the pipeline runs from the run
records `record_run` writes beside the store (`{root}/pipeline_runs/{run}.json`, as manifests name
no run: a cached artifact belongs to every run that reused it). `rebuild` recreates it from them.
"""

from __future__ import annotations

import builtins
import json
import os
import sqlite3
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from contract.manifest import MANIFEST
from configs import UserError

STORE_NAME = "lineage.sqlite"
EXTERNAL_KINDS = frozenset({"files", "hf_checkpoint"})  # inputs that no step produced: a fingerprint and a uri
RUN_CONTEXT = "pipeline_run"
RUNS_DIR = "pipeline_runs"  # {root}/pipeline_runs/{run}.json: the artifacts a run produced or reused
MANIFEST_KEYS = ("kind", "version", "step", "inputs")

# Stats shown beside a node (dotted paths into manifest stats), and config fields of its summary.
KEY_STATS = (
    "tokens.train", "tokens.val", "documents.train", "steps", "final_loss", "tokens_per_s", "mfu",
    "val_loss", "val_perplexity", "val_tokens", "step", "parameters", "hf.parameters", "seconds",
)
CONFIG_FIELDS = (
    "data.input", "data.tokenizer", "data.seq_len", "vocab_size", "model.name", "model.num_layers",
    "model.emb_dim", "train.steps", "train.batch_size", "train.learning_rate", "eval.batch_size",
    "eval.max_batches",
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS artifacts (
  id INTEGER PRIMARY KEY, uri TEXT NOT NULL, kind TEXT NOT NULL, version TEXT NOT NULL,
  step TEXT, created TEXT, properties TEXT NOT NULL DEFAULT '{}', UNIQUE (version, uri));
CREATE INDEX IF NOT EXISTS artifacts_by_uri ON artifacts (uri);
CREATE TABLE IF NOT EXISTS executions (
  id INTEGER PRIMARY KEY, step TEXT NOT NULL, version TEXT NOT NULL, code_version TEXT,
  config TEXT NOT NULL DEFAULT '{}', created TEXT);
CREATE TABLE IF NOT EXISTS events (
  artifact_id INTEGER NOT NULL REFERENCES artifacts (id), execution_id INTEGER NOT NULL REFERENCES executions (id),
  type TEXT NOT NULL CHECK (type IN ('INPUT', 'OUTPUT')), position INTEGER NOT NULL DEFAULT 0,
  PRIMARY KEY (artifact_id, execution_id, type));
CREATE INDEX IF NOT EXISTS events_by_execution ON events (execution_id, type);
CREATE TABLE IF NOT EXISTS contexts (
  id INTEGER PRIMARY KEY, name TEXT NOT NULL, type TEXT NOT NULL, UNIQUE (name, type));
CREATE TABLE IF NOT EXISTS attributions (
  context_id INTEGER NOT NULL REFERENCES contexts (id), artifact_id INTEGER NOT NULL REFERENCES artifacts (id),
  PRIMARY KEY (context_id, artifact_id));
CREATE TABLE IF NOT EXISTS associations (
  context_id INTEGER NOT NULL REFERENCES contexts (id), execution_id INTEGER NOT NULL REFERENCES executions (id),
  PRIMARY KEY (context_id, execution_id));
"""
TABLES = ("attributions", "associations", "events", "contexts", "executions", "artifacts")


@dataclass
class Artifact:
    """One node of the lineage graph: a step's output, or an external source (data files, a HF checkpoint)."""

    kind: str
    version: str
    uri: str
    step: str | None = None  # None: an external source, or an input whose manifest was never indexed
    created: str | None = None
    code_version: str | None = None
    config_summary: str = ""
    stats: dict[str, Any] = field(default_factory=dict)  # the key stats only
    config: dict[str, Any] = field(default_factory=dict)  # the producing step's full config
    key: str = ""  # the node's id where it is stored (SQLite row id, Vertex resource name)

    @property
    def external(self) -> bool:
        return self.kind in EXTERNAL_KINDS


@dataclass
class Tree:
    """A node and its inputs (upstream) or users (downstream); `repeat`: shown in full elsewhere in the tree."""

    artifact: Artifact
    children: list[Tree] = field(default_factory=list)
    repeat: bool = False

    def walk(self) -> Iterator[Tree]:
        yield self
        for child in self.children:
            yield from child.walk()


@dataclass
class LineageView:
    """What `lineage show` prints about one artifact: its upstream tree, what was made from it, and the graph."""

    focus: Artifact
    upstream: Tree
    downstream: list[Tree]
    nodes: list[Artifact]  # the focus first, then upstream, then downstream
    edges: list[tuple[str, str]]  # (input key, output key)


def store_path(root: str | Path) -> Path:
    """Where a pipeline root's lineage store lives."""
    return Path(root) / STORE_NAME


def normalize_uri(uri: str) -> str:
    """Local paths absolute and symlink-free (as manifests may name them either way); other URIs unchanged."""
    uri = uri.removeprefix("file://")
    return uri if "://" in uri else os.path.realpath(uri)


def key_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """The few stats worth showing beside a node (falls back to the first scalar ones)."""
    picked = {path: value for path in KEY_STATS if _is_scalar(value := _dig(stats, path))}
    if not picked:
        picked = {k: v for k, v in stats.items() if _is_scalar(v)}
        picked = dict(list(picked.items())[:6])
    return picked


def config_summary(config: dict[str, Any]) -> str:
    """A one-line summary of a step config: its most telling fields, as `name=value`."""
    parts = []
    for path in CONFIG_FIELDS:
        value = _dig(config, path)
        if isinstance(value, (list, tuple)):
            value = ",".join(map(str, value))
        if value is not None and value != "" and not isinstance(value, dict):
            parts.append(f"{path.rsplit('.', 1)[-1]}={value}")
    return " ".join(parts)


def build_view(
    key: str, get: Callable[[str], Artifact], parents: Callable[[str], list[str]], children: Callable[[str], list[str]]
) -> LineageView:
    """The upstream tree, downstream forest and graph around `key`, from any graph given as three lookups."""
    upstream = spanning_tree(key, parents, get)
    downstream = spanning_tree(key, children, get, repeats=False).children
    keys: dict[str, Artifact] = {}
    for tree in (upstream, *downstream):
        for node in tree.walk():
            keys.setdefault(node.artifact.key, node.artifact)
    edges = [(p, k) for k in keys for p in parents(k) if p in keys]
    return LineageView(get(key), upstream, downstream, list(keys.values()), edges)


def spanning_tree(
    root: str, neighbors: Callable[[str], list[str]], get: Callable[[str], Artifact], repeats: bool = True
) -> Tree:
    """The graph reachable from `root` as a tree: each node in full once, at its longest distance from root.

    So the upstream of metrics reads as the chain files -> dataset -> checkpoints -> export -> metrics, and
    the dataset's other uses (export and eval read it too) appear as short `repeat` references (if `repeats`).
    """
    depth = _longest_depths(root, neighbors)
    expanded = {root}

    def grow(key: str) -> Tree:
        tree = Tree(get(key))
        for nxt in neighbors(key):
            if nxt not in expanded and depth.get(nxt) == depth[key] + 1:
                expanded.add(nxt)
                tree.children.append(grow(nxt))
            elif repeats:
                tree.children.append(Tree(get(nxt), repeat=True))
        return tree

    return grow(root)


class LineageStore:
    """The SQLite lineage store of one pipeline root (`{root}/lineage.sqlite`), or ":memory:"."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        try:
            self.db = sqlite3.connect(self.path, timeout=30)
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA foreign_keys = ON")
            self.db.executescript(SCHEMA)
        except sqlite3.OperationalError as err:
            raise UserError(f"cannot open the lineage store {self.path}: {err}") from None
        except sqlite3.DatabaseError as err:
            raise UserError(f"cannot read the lineage store {self.path}: {err} "
                            "(delete it and run `maxpipe lineage rebuild ROOT`)") from None
        self._memo: dict[str, Any] = {}

    def __enter__(self) -> LineageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.db.close()

    # ---- writing -------------------------------------------------------------------------------

    def index(self, manifest_dir: str | Path) -> int:
        """Index one complete artifact dir (its artifact, the execution that made it, its inputs); its id."""
        manifest = load_manifest(manifest_dir)
        if manifest is None:
            raise UserError(f"{manifest_dir} is not a complete maxpipe artifact (no valid {MANIFEST})")
        with self.db:
            return self._index(manifest, normalize_uri(str(manifest_dir)))

    def index_upstream(self, manifest_dir: str | Path) -> int:
        """Index an artifact dir and, recursively, the input dirs it names that hold manifests; its id."""
        with self.db:
            return self._index_tree(manifest_dir)

    def record_run(self, run_name: str, manifest_dirs: builtins.list[str | Path]) -> builtins.list[int]:
        """Index a pipeline run's output dirs (and their inputs), put them in its run context, and write
        the run record `rebuild` reads back; the artifacts' ids."""
        if not run_name or "/" in run_name or run_name.startswith("."):
            raise UserError(f"run name {run_name!r}: give a plain name (no '/', not starting with '.')")
        with self.db:
            ids = [self._index_tree(d) for d in manifest_dirs]
            self._record(run_name, ids)
        if self.path != ":memory:":
            path = Path(self.path).parent / RUNS_DIR / f"{run_name}.json"
            refs = _run_record(path) + [{"kind": a.kind, "version": a.version, "uri": a.uri}
                                        for a in map(self._artifact, ids)]
            unique = builtins.list({(r["version"], r["uri"]): r for r in refs}.values())
            _write_json(path, {"run": run_name, "artifacts": unique})
        return ids

    def rebuild(self, root: str | Path) -> int:
        """Drop everything, then index every manifest under root and the runs recorded there; the number indexed."""
        if not Path(root).is_dir():
            raise UserError(f"{root} is not a directory")
        dirs = find_artifact_dirs(root)
        runs = {path.stem: _run_record(path) for path in sorted((Path(root) / RUNS_DIR).glob("*.json"))}
        with self.db:
            for table in TABLES:
                self.db.execute(f"DELETE FROM {table}")
            for directory in dirs:
                self._index_tree(directory)
            for run, refs in runs.items():
                self._record(run, [i for ref in refs if (i := self._recorded(ref)) is not None])
            return int(self.db.execute("SELECT count(*) FROM artifacts WHERE step IS NOT NULL").fetchone()[0])

    # ---- reading -------------------------------------------------------------------------------

    def resolve(self, ref: str) -> Artifact:
        """The artifact named by a version (a unique prefix will do), a path or a URI.

        A version found at several places (the same content) resolves to its newest copy.
        """
        return self._artifact(self.resolve_id(ref))

    def resolve_id(self, ref: str) -> int:
        """The row id of the artifact named by `ref`; one UserError line when none or several match."""
        ref = ref.strip()
        if not ref:
            raise UserError("give an artifact: a version, a path or a URI")
        rows = self._by_uri(normalize_uri(ref))
        if not rows and self.path != ":memory:" and "://" not in ref:  # a path relative to the pipeline root
            rows = self._by_uri(normalize_uri(str(Path(self.path).parent / ref)))
        if rows:  # a place: the artifact indexed from its manifest (or, if it was replaced, the newest one)
            return int(rows[0]["id"])
        if ref.lower().isalnum():
            prefix = ref.lower()
            rows = self.db.execute(
                "SELECT id, kind, version, uri FROM artifacts WHERE substr(version, 1, ?) = ? "
                "ORDER BY step IS NULL, created DESC, uri",
                (len(prefix), prefix)).fetchall()
        if not rows:
            raise UserError(f"no artifact matches {ref!r} in {self.path} "
                            "(`maxpipe lineage list` shows them; `maxpipe lineage rebuild ROOT` re-indexes)")
        if len(rows) > 1 and len({r["version"] for r in rows}) > 1:
            shown = "; ".join(f"{r['kind']} {r['version']} at {r['uri']}" for r in rows[:4])
            more = f" and {len(rows) - 4} more" if len(rows) > 4 else ""
            raise UserError(f"{ref!r} matches {len(rows)} artifacts: {shown}{more}; "
                            "give more of the version, or the path")
        return int(rows[0]["id"])

    def view(self, ref: str) -> LineageView:
        """Upstream tree, downstream users and the graph around the artifact named by `ref`."""
        self._memo.clear()
        return build_view(str(self.resolve_id(ref)), self._get, self._parents, self._children)

    def upstream(self, ref: str) -> Tree:
        """What the artifact was made from, back to its source files: a tree of its inputs."""
        self._memo.clear()
        return spanning_tree(str(self.resolve_id(ref)), self._parents, self._get)

    def downstream(self, ref: str) -> builtins.list[Tree]:
        """What was made from the artifact: its users, each with what was made from it in turn."""
        self._memo.clear()
        return spanning_tree(str(self.resolve_id(ref)), self._children, self._get, repeats=False).children

    def runs(self) -> dict[str, builtins.list[Artifact]]:
        """Each pipeline run context and its artifacts."""
        rows = self.db.execute(
            "SELECT c.name, t.artifact_id FROM contexts c JOIN attributions t ON t.context_id = c.id "
            "WHERE c.type = ? ORDER BY c.name, t.artifact_id", (RUN_CONTEXT,)).fetchall()
        runs: dict[str, builtins.list[Artifact]] = defaultdict(builtins.list)
        for row in rows:
            runs[row["name"]].append(self._artifact(row["artifact_id"]))
        return dict(runs)

    def snapshot(self) -> dict[str, Any]:
        """A canonical dump of nodes, edges and runs, independent of row ids and indexing order."""
        nodes = sorted([r["kind"], r["version"], r["uri"], r["step"], r["created"], json.loads(r["properties"])]
                       for r in self.db.execute("SELECT * FROM artifacts"))
        edges = sorted(tuple(r) for r in self.db.execute(
            "SELECT ai.version, ai.uri, ao.version, ao.uri, ex.step, ex.config FROM events i "
            "JOIN events o ON o.execution_id = i.execution_id AND o.type = 'OUTPUT' AND i.type = 'INPUT' "
            "JOIN artifacts ai ON ai.id = i.artifact_id JOIN artifacts ao ON ao.id = o.artifact_id "
            "JOIN executions ex ON ex.id = i.execution_id"))
        runs = {name: sorted([a.version, a.uri] for a in arts) for name, arts in self.runs().items()}
        return {"nodes": nodes, "edges": [builtins.list(e) for e in edges], "runs": runs}

    def list(self, kind: str | None = None) -> builtins.list[Artifact]:
        """Every artifact (of `kind`), newest first; external sources last."""
        where, args = ("WHERE kind = ?", (kind,)) if kind else ("", ())
        order = "ORDER BY created IS NULL, created DESC, kind, version"
        rows = self.db.execute(f"SELECT id FROM artifacts {where} {order}", args).fetchall()
        return [self._artifact(r["id"]) for r in rows]

    def kinds(self) -> builtins.list[str]:
        """The artifact kinds in the store."""
        return [r[0] for r in self.db.execute("SELECT DISTINCT kind FROM artifacts ORDER BY kind")]

    # ---- internals -----------------------------------------------------------------------------

    def _by_uri(self, uri: str, version: str | None = None) -> builtins.list[sqlite3.Row]:
        """Artifacts at a uri (of a version): complete ones first, newest first."""
        where, args = ("uri = ? AND version = ?", (uri, version)) if version is not None else ("uri = ?", (uri,))
        return self.db.execute(f"SELECT id, kind, version, uri FROM artifacts WHERE {where} "
                               "ORDER BY step IS NULL, created DESC", args).fetchall()

    def _require(self, directory: str | Path) -> dict[str, Any]:
        manifest = load_manifest(directory)
        if manifest is None:
            raise UserError(f"{directory} is not a complete maxpipe artifact (no valid {MANIFEST})")
        return manifest

    def _index_tree(self, manifest_dir: str | Path) -> int:
        """Index a dir, then the input dirs it names that hold manifests and are not indexed yet; its id."""
        first = normalize_uri(str(manifest_dir))
        manifest = self._require(first)
        artifact_id = self._index(manifest, first)
        pending, seen = [manifest], {first}
        while pending:
            for ref in pending.pop()["inputs"]:
                uri = normalize_uri(str(ref["uri"]))
                if ref["kind"] in EXTERNAL_KINDS or uri in seen or self._is_complete(uri, ref["version"]):
                    continue
                seen.add(uri)
                if (found := load_manifest(uri)) is not None:
                    self._index(found, uri)
                    pending.append(found)
        return artifact_id

    def _is_complete(self, uri: str, version: str) -> bool:
        """Whether the artifact of this version at uri is indexed from its manifest (not a placeholder)."""
        row = self.db.execute("SELECT step FROM artifacts WHERE uri = ? AND version = ?", (uri, version)).fetchone()
        return row is not None and row[0] is not None

    def _record(self, run_name: str, artifact_ids: builtins.list[int]) -> None:
        context = self._context(run_name)
        for artifact_id in artifact_ids:
            self._attribute(context, artifact_id)

    def _recorded(self, ref: dict[str, Any]) -> int | None:
        """A run record's artifact: indexed from its uri (a store outside root), or by kind and version
        if the root has moved; None if it is gone."""
        uri = normalize_uri(ref["uri"])
        if _holds(uri, ref["version"]) and "://" not in uri:
            return self._index_tree(uri)
        row = self.db.execute("SELECT id FROM artifacts WHERE version = ? AND kind = ? AND step IS NOT NULL "
                              "ORDER BY uri LIMIT 1", (ref["version"], ref["kind"])).fetchone()
        return int(row[0]) if row else None

    def _index(self, manifest: dict[str, Any], uri: str) -> int:
        stats = manifest.get("stats") or {}
        config = manifest.get("config") or {}
        properties = {"code_version": manifest.get("code_version"), "config_summary": config_summary(config),
                      "stats": key_stats(stats)}
        artifact_id = self.db.execute(
            "INSERT INTO artifacts (uri, kind, version, step, created, properties) VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (version, uri) DO UPDATE SET kind = excluded.kind, step = excluded.step, "
            "created = excluded.created, properties = excluded.properties RETURNING id",
            (uri, manifest["kind"], manifest["version"], manifest["step"], manifest.get("created"),
             json.dumps(properties))).fetchall()[0][0]
        self._adopt_placeholders(artifact_id, manifest["kind"], manifest["version"])
        execution = (manifest["step"], manifest["version"], manifest.get("code_version"),
                     json.dumps(config, sort_keys=True), manifest.get("created"))
        row = self.db.execute("SELECT execution_id FROM events WHERE artifact_id = ? AND type = 'OUTPUT'",
                              (artifact_id,)).fetchone()
        if row:
            execution_id = row[0]
            self.db.execute("UPDATE executions SET step = ?, version = ?, code_version = ?, config = ?, created = ? "
                            "WHERE id = ?", (*execution, execution_id))
            self.db.execute("DELETE FROM events WHERE execution_id = ? AND type = 'INPUT'", (execution_id,))
        else:
            execution_id = self.db.execute(
                "INSERT INTO executions (step, version, code_version, config, created) VALUES (?, ?, ?, ?, ?)",
                execution).lastrowid
            self.db.execute("INSERT INTO events (artifact_id, execution_id, type) VALUES (?, ?, 'OUTPUT')",
                            (artifact_id, execution_id))
        for position, ref in enumerate(manifest["inputs"]):
            input_id = self._input_artifact(ref)
            self.db.execute("INSERT OR IGNORE INTO events (artifact_id, execution_id, type, position) "
                            "VALUES (?, ?, 'INPUT', ?)", (input_id, execution_id, position))
        return int(artifact_id)

    def _input_artifact(self, ref: dict[str, Any]) -> int:
        """The node of an input: the indexed artifact, or a placeholder until its manifest is indexed.

        An input whose uri no longer holds it (the root was moved or copied, or the manifests came from a
        bucket) is the indexed artifact of the same kind and version: a version is a content hash.
        """
        external = ref["kind"] in EXTERNAL_KINDS
        uri = str(ref["uri"]) if external else normalize_uri(str(ref["uri"]))
        if rows := self._by_uri(uri, ref["version"]):
            return int(rows[0]["id"])
        if not external and not _holds(uri, ref["version"]):
            row = self.db.execute("SELECT id FROM artifacts WHERE version = ? AND kind = ? AND step IS NOT NULL "
                                  "ORDER BY uri LIMIT 1", (ref["version"], ref["kind"])).fetchone()
            if row:
                return int(row[0])
        return int(self.db.execute("INSERT INTO artifacts (uri, kind, version, properties) VALUES (?, ?, ?, '{}') "
                                   "RETURNING id", (uri, ref["kind"], ref["version"])).fetchall()[0][0])

    def _adopt_placeholders(self, artifact_id: int, kind: str, version: str) -> None:
        """Fold placeholders of this kind and version whose uri does not hold them into the indexed artifact."""
        rows = self.db.execute(
            "SELECT id, uri FROM artifacts WHERE version = ? AND kind = ? AND step IS NULL AND id != ?",
            (version, kind, artifact_id)).fetchall()
        for stub_id, uri in rows:
            if kind in EXTERNAL_KINDS or _holds(uri, version):
                continue
            for table, column in (("events", "artifact_id"), ("attributions", "artifact_id")):
                self.db.execute(f"UPDATE OR IGNORE {table} SET {column} = ? WHERE {column} = ?", (artifact_id, stub_id))
                self.db.execute(f"DELETE FROM {table} WHERE {column} = ?", (stub_id,))
            self.db.execute("DELETE FROM artifacts WHERE id = ?", (stub_id,))

    def _context(self, name: str) -> int:
        self.db.execute("INSERT OR IGNORE INTO contexts (name, type) VALUES (?, ?)", (name, RUN_CONTEXT))
        row = self.db.execute("SELECT id FROM contexts WHERE name = ? AND type = ?", (name, RUN_CONTEXT)).fetchone()
        return int(row[0])

    def _attribute(self, context_id: int, artifact_id: int) -> None:
        """Put an output, its execution and the artifacts that execution read into a run context."""
        execution_id = self.db.execute("SELECT execution_id FROM events WHERE artifact_id = ? AND type = 'OUTPUT'",
                                       (artifact_id,)).fetchone()[0]
        self.db.execute("INSERT OR IGNORE INTO associations VALUES (?, ?)", (context_id, execution_id))
        members = self.db.execute("SELECT artifact_id FROM events WHERE execution_id = ?", (execution_id,)).fetchall()
        for (member,) in members:
            self.db.execute("INSERT OR IGNORE INTO attributions VALUES (?, ?)", (context_id, member))

    def _artifact(self, artifact_id: int | str) -> Artifact:
        row = self.db.execute(
            "SELECT a.*, ex.config AS config FROM artifacts a LEFT JOIN events o ON o.artifact_id = a.id "
            "AND o.type = 'OUTPUT' LEFT JOIN executions ex ON ex.id = o.execution_id WHERE a.id = ?",
            (int(artifact_id),)).fetchone()
        props = json.loads(row["properties"])
        return Artifact(
            kind=row["kind"], version=row["version"], uri=row["uri"], step=row["step"], created=row["created"],
            code_version=props.get("code_version"), config_summary=props.get("config_summary", ""),
            stats=props.get("stats", {}), config=json.loads(row["config"] or "{}"), key=str(row["id"]),
        )

    def _get(self, key: str) -> Artifact:
        return self._cached(("get", key), lambda: self._artifact(key))

    def _parents(self, key: str) -> builtins.list[str]:
        return self._cached(("up", key), lambda: _unique(str(r[0]) for r in self.db.execute(
            "SELECT i.artifact_id FROM events o JOIN events i ON i.execution_id = o.execution_id AND i.type = 'INPUT' "
            "WHERE o.artifact_id = ? AND o.type = 'OUTPUT' ORDER BY i.position", (int(key),))))

    def _children(self, key: str) -> builtins.list[str]:
        return self._cached(("down", key), lambda: _unique(str(r[0]) for r in self.db.execute(
            "SELECT o.artifact_id FROM events i JOIN events o ON o.execution_id = i.execution_id AND o.type = 'OUTPUT' "
            "JOIN artifacts a ON a.id = o.artifact_id WHERE i.artifact_id = ? AND i.type = 'INPUT' "
            "ORDER BY a.created, a.version", (int(key),))))

    def _cached(self, key: tuple[str, str], compute: Callable[[], Any]) -> Any:
        memo_key = "\0".join(key)
        if memo_key not in self._memo:
            self._memo[memo_key] = compute()
        return self._memo[memo_key]


def load_manifest(directory: str | Path) -> dict[str, Any] | None:
    """A directory's maxpipe manifest, or None when it has none (or a file by that name that is not ours)."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or any(k not in manifest for k in MANIFEST_KEYS):
        return None
    return manifest


def _run_record(path: Path) -> list[dict[str, Any]]:
    """The artifacts (kind, version, uri) a run record lists; none if it is missing or unreadable."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    items = record.get("artifacts") if isinstance(record, dict) else None
    return [a for a in items or [] if isinstance(a, dict) and {"kind", "version", "uri"} <= a.keys()]


def _write_json(path: Path, data: Any) -> None:
    """Write atomically (temp file + rename), as manifests are."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _holds(uri: str, version: str) -> bool:
    """Whether a local uri holds the complete artifact of this version (gs:// and other URIs: not checked)."""
    if "://" in uri:
        return True
    manifest = load_manifest(uri)
    return manifest is not None and manifest["version"] == version


def find_artifact_dirs(root: str | Path) -> list[Path]:
    """Every complete artifact dir under root, sorted; an artifact's own payload is not searched."""
    found = []
    for directory, subdirs, files in os.walk(root):
        if MANIFEST in files and load_manifest(directory) is not None:
            found.append(Path(directory))
            subdirs.clear()
        subdirs.sort()
    return sorted(found)


def _longest_depths(root: str, neighbors: Callable[[str], list[str]]) -> dict[str, int]:
    """Longest path length from root to every reachable node (BFS depth for nodes on a cycle)."""
    order, seen, edges = [root], {root: 0}, []
    for key in order:
        for nxt in neighbors(key):
            edges.append((key, nxt))
            if nxt not in seen:
                seen[nxt] = seen[key] + 1
                order.append(nxt)
    indegree = Counter(dst for _, dst in edges)
    out: dict[str, list[str]] = defaultdict(list)
    for src, dst in edges:
        out[src].append(dst)
    depth, ready = {root: 0}, [root] if indegree[root] == 0 else []
    while ready:
        key = ready.pop()
        for nxt in out[key]:
            depth[nxt] = max(depth.get(nxt, 0), depth[key] + 1)
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                ready.append(nxt)
    return {key: depth[key] if indegree[key] == 0 and key in depth else seen[key] for key in order}


def _dig(tree: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float, str)) and not isinstance(value, bool) and value != ""


def _unique(items: Any) -> list[str]:
    return list(dict.fromkeys(items))
