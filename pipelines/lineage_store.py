"""The local lineage store: a SQLite index over manifests with the ML-Metadata shape, and how it is written.

Tables: artifacts, executions, events (INPUT/OUTPUT), contexts (pipeline runs), attributions
(artifact-context) and associations (execution-context). It holds nothing that storage does not:
the artifacts, executions and events come from manifest.json files, the pipeline runs from the run
records `record_run` writes beside the store (a cached artifact belongs to every run that reused it);
`rebuild` recreates it from them (pipelines/lineage_storage.py). Queries: pipelines/lineage_queries.py.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from configs import UserError
from pipelines.lineage_graph import EXTERNAL_KINDS, Artifact, config_summary, key_stats
from pipelines.lineage_storage import (
    add_to_run_record, find_artifact_dirs, holds, indexable_manifest, required_manifest, run_record_path, run_records,
)

STORE_NAME = "lineage.sqlite"
RUN_CONTEXT = "pipeline_run"

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


def store_path(root: str | Path) -> Path:
    """Where a pipeline root's lineage store lives."""
    return Path(root) / STORE_NAME


def normalize_uri(uri: str) -> str:
    """Local paths absolute and symlink-free (as manifests may name them either way); other URIs unchanged."""
    uri = uri.removeprefix("file://")
    return uri if "://" in uri else os.path.realpath(uri)


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

    def __enter__(self) -> LineageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection."""
        self.db.close()

    # ---- writing -------------------------------------------------------------------------------

    def index(self, manifest_dir: str | Path) -> int:
        """Index one complete artifact dir (its artifact, the execution that made it, its inputs); its id."""
        manifest = required_manifest(manifest_dir)
        with self.db:
            return self._index(manifest, normalize_uri(str(manifest_dir)))

    def index_upstream(self, manifest_dir: str | Path) -> int:
        """Index an artifact dir and, recursively, the input dirs it names that hold manifests; its id."""
        with self.db:
            return self._index_tree(manifest_dir)

    def record_run(self, run_name: str, manifest_dirs: list[str | Path]) -> list[int]:
        """Index a pipeline run's output dirs (and their inputs), put them in its run context, and write
        the run record `rebuild` reads back; the artifacts' ids."""
        record = run_record_path(Path(self.path).parent, run_name)
        with self.db:
            ids = [self._index_tree(d) for d in manifest_dirs]
            self._record(run_name, ids)
        if self.path != ":memory:":
            add_to_run_record(record, run_name, [{"kind": a.kind, "version": a.version, "uri": a.uri}
                                                 for a in map(self.artifact, ids)])
        return ids

    def rebuild(self, root: str | Path) -> int:
        """Drop everything, then index every manifest under root and the runs recorded there; the number indexed."""
        if not Path(root).is_dir():
            raise UserError(f"{root} is not a directory")
        dirs, runs = find_artifact_dirs(root), run_records(root)
        with self.db:
            for table in TABLES:
                self.db.execute(f"DELETE FROM {table}")
            for directory in dirs:
                self._index_tree(directory)
            for run, refs in runs.items():
                self._record(run, [i for ref in refs if (i := self._recorded(ref)) is not None])
            return int(self.db.execute("SELECT count(*) FROM artifacts WHERE step IS NOT NULL").fetchone()[0])

    # ---- rows ----------------------------------------------------------------------------------

    def artifact(self, artifact_id: int | str) -> Artifact:
        """The artifact of a row id, with the config its producing execution recorded."""
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

    def by_uri(self, uri: str, version: str | None = None) -> list[sqlite3.Row]:
        """Artifacts at a uri (of a version): complete ones first, newest first."""
        where, args = ("uri = ? AND version = ?", (uri, version)) if version is not None else ("uri = ?", (uri,))
        return self.db.execute(f"SELECT id, kind, version, uri FROM artifacts WHERE {where} "
                               "ORDER BY step IS NULL, created DESC", args).fetchall()

    def _indexed_copy(self, kind: str, version: str) -> int | None:
        """An artifact of this kind and version indexed from its manifest, wherever it is (a version is a content hash)."""
        row = self.db.execute("SELECT id FROM artifacts WHERE version = ? AND kind = ? AND step IS NOT NULL "
                              "ORDER BY uri LIMIT 1", (version, kind)).fetchone()
        return int(row[0]) if row else None

    # ---- internals -----------------------------------------------------------------------------

    def _index_tree(self, manifest_dir: str | Path) -> int:
        """Index a dir, then the input dirs it names that hold manifests and are not indexed yet; its id."""
        first = normalize_uri(str(manifest_dir))
        manifest = required_manifest(first)
        artifact_id = self._index(manifest, first)
        pending, seen = [manifest], {first}
        while pending:
            for ref in pending.pop()["inputs"]:
                uri = normalize_uri(str(ref["uri"]))
                if ref["kind"] in EXTERNAL_KINDS or uri in seen or self._is_complete(uri, ref["version"]):
                    continue
                seen.add(uri)
                if (found := indexable_manifest(uri)) is not None:
                    self._index(found, uri)
                    pending.append(found)
        return artifact_id

    def _is_complete(self, uri: str, version: str) -> bool:
        """Whether the artifact of this version at uri is indexed from its manifest (not a placeholder)."""
        row = self.db.execute("SELECT step FROM artifacts WHERE uri = ? AND version = ?", (uri, version)).fetchone()
        return row is not None and row[0] is not None

    def _record(self, run_name: str, artifact_ids: list[int]) -> None:
        context = self._context(run_name)
        for artifact_id in artifact_ids:
            self._attribute(context, artifact_id)

    def _recorded(self, ref: dict[str, Any]) -> int | None:
        """A run record's artifact: indexed from its uri (a store outside root), or by kind and version
        if the root has moved; None if it is gone."""
        uri = normalize_uri(ref["uri"])
        if holds(uri, ref["version"]) and "://" not in uri:
            return self._index_tree(uri)
        return self._indexed_copy(ref["kind"], ref["version"])

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
        if rows := self.by_uri(uri, ref["version"]):
            return int(rows[0]["id"])
        if not external and not holds(uri, ref["version"]):
            if (copy := self._indexed_copy(ref["kind"], ref["version"])) is not None:
                return copy
        return int(self.db.execute("INSERT INTO artifacts (uri, kind, version, properties) VALUES (?, ?, ?, '{}') "
                                   "RETURNING id", (uri, ref["kind"], ref["version"])).fetchall()[0][0])

    def _adopt_placeholders(self, artifact_id: int, kind: str, version: str) -> None:
        """Fold placeholders of this kind and version whose uri does not hold them into the indexed artifact."""
        rows = self.db.execute(
            "SELECT id, uri FROM artifacts WHERE version = ? AND kind = ? AND step IS NULL AND id != ?",
            (version, kind, artifact_id)).fetchall()
        for stub_id, uri in rows:
            if kind in EXTERNAL_KINDS or holds(uri, version):
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
