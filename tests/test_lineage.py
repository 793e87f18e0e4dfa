"""Lineage over real artifact dirs: the SQLite store, its queries, rebuild, renderings, the CLI, Vertex conversion."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from contract import manifest as artifacts
from components.kfp_support import artifact_metadata
from configs import UserError, load_config
from pipelines import lineage_queries as queries
from pipelines.lineage import lineage_main
from pipelines.lineage_graph import Tree
from pipelines.lineage_render import dot, html_page, mermaid, render, tree_text, view_dict
from pipelines.lineage_store import LineageStore, store_path
from pipelines.lineage_vertex import vertex_view, view_from_subgraph

CODE = "c0de00000001"
FILES_FINGERPRINT = hashlib.sha256(b"the corpus").hexdigest()


def publish(store: Path, kind: str, step: str, config: dict, inputs: list[dict], stats: dict) -> Path:
    """A complete artifact dir `{store}/{step}/{version}`: a payload, then the manifest (as components.steps does)."""
    key = json.dumps([step, config, [i["version"] for i in inputs], CODE], sort_keys=True)
    version = hashlib.sha256(key.encode()).hexdigest()[:12]  # any content hash names a version here
    directory = store / step / version
    directory.mkdir(parents=True)
    (directory / "payload.bin").write_bytes(b"\0" * 16)
    artifacts.publish(directory, kind=kind, step=step, version=version, code=CODE, config=config, settings={},
                      inputs=inputs, stats=stats)
    return directory


def run_dirs(store: Path, dataset: Path | None, steps: int) -> dict[str, Path]:
    """The outputs of one pipeline run: prep (or a dataset reused from the store), train, export, eval."""
    cfg = load_config("tiny", [f"train.steps={steps}"])
    if dataset is None:
        dataset = publish(
            store, "dataset", "prep", {"data": cfg.data.model_dump(exclude={"beam_args"}), "vocab_size": 512},
            [{"kind": "files", "version": FILES_FINGERPRINT, "uri": "corpus/*.py"}],
            {"documents": {"train": 10, "val": 1}, "tokens": {"train": 138913, "val": 5656}, "seq_len": 64})
    train_cfg = {"model": cfg.model.model_dump(), "train": cfg.train.model_dump()}
    ckpt = publish(store, "checkpoints", "train", train_cfg, [artifacts.reference(dataset)],
                   {"steps": steps, "final_loss": 6.2448, "tokens_per_s": 135.3, "mfu": 0.00039})
    model = publish(store, "exported_model", "export", {"model": cfg.model.model_dump()},
                    [artifacts.reference(ckpt), artifacts.reference(dataset)],
                    {"step": steps, "hf": {"parameters": 139584}})
    report = publish(store, "metrics", "eval", {"eval": cfg.eval.model_dump()},
                     [artifacts.reference(model), artifacts.reference(dataset)],
                     {"val_loss": 6.2467, "val_perplexity": 516.32, "val_tokens": 2016, "sample": "def "})
    return {"dataset": dataset, "checkpoints": ckpt, "model": model, "report": report}


@pytest.fixture
def chain(tmp_path):
    """Run a (prep -> train -> export -> eval) and run b (train -> export -> eval, reusing a's dataset), recorded.

    Laid out as pipelines lay out their outputs: a content-addressed store `{root}/store/{step}/{version}`.
    """
    root = tmp_path / "runs"
    a = run_dirs(root / "store", None, steps=8)
    b = run_dirs(root / "store", a["dataset"], steps=12)
    (root / "store" / "train" / "0123456789ab").mkdir(parents=True)  # a crashed step: payload, no manifest
    (root / "store" / "train" / "0123456789ab" / "partial.bin").write_bytes(b"x")
    store = LineageStore(store_path(root))
    store.record_run("run-a", [str(p) for p in a.values()])
    store.record_run("run-b", [str(p) for p in b.values()])
    version = {f"{run}.{name}": artifacts.read_manifest(p)["version"]
               for run, dirs in (("a", a), ("b", b)) for name, p in dirs.items()}
    yield SimpleNamespace(root=root, a=a, b=b, store=store, v=version)
    store.close()


def full_nodes(tree: Tree) -> list[Tree]:
    return [n for n in tree.walk() if not n.repeat]


def test_upstream_of_metrics_goes_back_to_the_data_files(chain):
    tree = queries.upstream(chain.store, chain.v["a.report"])
    spine, node = [], tree
    while True:  # follow the fully shown child: the longest chain back to the source
        spine.append((node.artifact.kind, node.artifact.version, node.artifact.step))
        full = [c for c in node.children if not c.repeat]
        if not full:
            break
        node = full[0]
    assert spine == [
        ("metrics", chain.v["a.report"], "eval"), ("exported_model", chain.v["a.model"], "export"),
        ("checkpoints", chain.v["a.checkpoints"], "train"), ("dataset", chain.v["a.dataset"], "prep"),
        ("files", FILES_FINGERPRINT, None),
    ]
    source = node.artifact
    assert source.external and source.uri == "corpus/*.py"
    # The dataset is also read directly by export and eval: shown once in full, referenced elsewhere.
    assert [n.artifact.kind for n in full_nodes(tree)].count("dataset") == 1
    repeats = [n.artifact.version for n in tree.walk() if n.repeat]
    assert repeats == [chain.v["a.dataset"], chain.v["a.dataset"]]
    metrics = tree.artifact
    assert metrics.stats["val_loss"] == 6.2467 and metrics.stats["val_perplexity"] == 516.32
    assert metrics.created and metrics.uri == str(chain.a["report"]) and metrics.config["eval"]["batch_size"]
    train = tree.children[0].children[0].artifact
    assert train.stats["final_loss"] == 6.2448 and "steps=8" in train.config_summary and "name=tiny" in train.config_summary


def test_downstream_of_the_dataset_lists_both_trainings(chain):
    users = queries.downstream(chain.store, chain.v["a.dataset"])
    # Both were made in the same second: their order is by version, a hash.
    assert sorted((t.artifact.kind, t.artifact.version) for t in users) == sorted([
        ("checkpoints", chain.v["a.checkpoints"]), ("checkpoints", chain.v["b.checkpoints"])])
    (a_tree,) = [t for t in users if t.artifact.version == chain.v["a.checkpoints"]]
    below_a = [n.artifact.version for n in a_tree.walk()]
    assert below_a == [chain.v["a.checkpoints"], chain.v["a.model"], chain.v["a.report"]]
    assert queries.downstream(chain.store, chain.v["a.report"]) == []


def test_resolve_by_version_prefix_path_and_uri(chain, monkeypatch):
    store, version = chain.store, chain.v["a.checkpoints"]
    assert queries.resolve(store, version).version == version
    assert queries.resolve(store, version[:7]).uri == str(chain.a["checkpoints"])
    assert queries.resolve(store, str(chain.a["checkpoints"])).version == version
    assert queries.resolve(store, f"file://{chain.a['checkpoints']}").version == version
    assert queries.resolve(store, f"store/train/{version}").version == version  # relative to the pipeline root
    monkeypatch.chdir(chain.root / "store")
    assert queries.resolve(store, f"train/{version}/").version == version  # relative to the working directory


def test_unknown_and_ambiguous_refs_are_one_line_errors(chain):
    with pytest.raises(UserError, match="no artifact matches 'ffffffff'.*lineage rebuild"):
        queries.resolve(chain.store, "ffffffff")
    with pytest.raises(UserError, match="no artifact matches"):
        queries.resolve(chain.store, str(chain.root / "store" / "train" / "0123456789ab"))
    for suffix in ("1", "2"):  # two versions that share a prefix
        directory = chain.root / f"odd{suffix}"
        directory.mkdir()
        artifacts.publish(directory, kind="metrics", step="eval", version=f"abcd{suffix}0000000", code=CODE,
                          config={}, settings={}, inputs=[], stats={})
        chain.store.index(directory)
    with pytest.raises(UserError) as err:
        queries.resolve(chain.store, "abcd")
    assert "matches 2 artifacts" in str(err.value) and "\n" not in str(err.value)
    assert queries.resolve(chain.store, "abcd2").version == "abcd20000000"
    with pytest.raises(UserError, match="not a complete maxpipe artifact"):
        chain.store.index(chain.root / "store" / "train" / "0123456789ab")


def test_indexing_is_idempotent_and_rebuild_gives_the_same_graph(chain, tmp_path):
    before = queries.snapshot(chain.store)
    assert len(before["nodes"]) == 8 and len(before["edges"]) == 11  # 7 step outputs + the files source
    assert sorted(before["runs"]) == ["run-a", "run-b"]
    assert [a.version for a in queries.runs(chain.store)["run-b"]].count(chain.v["a.dataset"]) == 1  # b read a's dataset
    for path in [*chain.b.values(), *chain.a.values()]:
        chain.store.index(path)
    chain.store.record_run("run-a", [str(p) for p in chain.a.values()])
    assert queries.snapshot(chain.store) == before

    assert chain.store.rebuild(chain.root) == 7  # the crashed step's manifest-less dir is ignored
    assert queries.snapshot(chain.store) == before
    with LineageStore(tmp_path / "fresh.sqlite") as fresh:  # a store built from the manifests alone
        fresh.rebuild(chain.root)
        assert queries.snapshot(fresh) == before
    with LineageStore(":memory:") as reverse:  # inputs indexed after their users: same graph
        for path in sorted([*chain.a.values(), *chain.b.values()], reverse=True):
            reverse.index(path)
        assert {k: v for k, v in queries.snapshot(reverse).items() if k != "runs"} == \
               {k: v for k, v in before.items() if k != "runs"}


def test_a_moved_root_still_links_inputs_by_version(chain, tmp_path):
    chain.store.close()
    moved = tmp_path / "elsewhere"
    shutil.move(chain.root, moved)  # manifests still name the old input paths
    with LineageStore(store_path(moved)) as store:
        assert store.rebuild(moved) == 7
        kinds = [n.artifact.kind for n in full_nodes(queries.upstream(store, chain.v["a.report"]))]
        assert kinds == ["metrics", "exported_model", "checkpoints", "dataset", "files"]
        assert all(a.step or a.external for a in queries.list_artifacts(store))  # no dangling placeholders
        assert len(queries.downstream(store, chain.v["a.dataset"])) == 2
        runs = queries.runs(store)  # the run records name the old paths: matched by kind and version
        assert sorted(runs) == ["run-a", "run-b"] and len(runs["run-b"]) == 5
    chain.store = LineageStore(":memory:")


def test_renderings_show_every_node(chain):
    view = queries.view(chain.store, chain.v["a.checkpoints"])
    versions = {a.version for a in view.nodes}
    assert versions == {chain.v[k] for k in ("a.dataset", "a.checkpoints", "a.model", "a.report")} | {FILES_FINGERPRINT}
    text = tree_text(view)
    assert text.splitlines()[0].startswith(f"checkpoints {chain.v['a.checkpoints']}  train · ")
    assert "used by (2 artifacts downstream):" in text and "final_loss=6.245" in text and "tokens.train=138,913" in text
    for a in view.nodes:
        assert a.version[:16] in text and a.uri in text
    graph = mermaid(view)
    assert graph.startswith("flowchart LR") and graph.count(" --> ") == len(view.edges) == 6
    assert all(f'n{i}["{a.kind}<br/>' in graph for i, a in enumerate(view.nodes))
    graph_dot = dot(view)
    assert graph_dot.startswith("digraph lineage {") and graph_dot.count(" -> ") == 6
    assert all(a.version[:16] in graph_dot for a in view.nodes)
    page = html_page(view)
    assert page.startswith("<!doctype html>") and '<pre class="mermaid">flowchart LR' in page
    assert "<script" not in page and "cdn.jsdelivr" not in page  # drawn offline: tests/test_browser.py looks at it
    assert '<svg xmlns="http://www.w3.org/2000/svg" class="lineage"' in page
    assert page.count('<g class="node"') == len(view.nodes) and page.count('<path class="edge"') == len(view.edges)
    assert all(a.version[:16] in page and a.uri in page for a in view.nodes)
    data = json.loads(render(view, "json"))
    assert data == json.loads(json.dumps(view_dict(view)))
    assert data["artifact"]["version"] == chain.v["a.checkpoints"]
    assert data["upstream"]["inputs"][0]["kind"] == "dataset"
    assert data["upstream"]["inputs"][0]["inputs"][0]["version"] == FILES_FINGERPRINT
    assert data["downstream"][0]["used_by"][0]["kind"] == "metrics"
    assert len(data["graph"]["nodes"]) == 5 and len(data["graph"]["edges"]) == 6


def test_lineage_main_end_to_end(chain, tmp_path, capsys, monkeypatch):
    chain.store.close()
    store_path(chain.root).unlink()
    root = str(chain.root)
    with pytest.raises(UserError, match="no lineage store at .*maxpipe lineage rebuild"):
        lineage_main(["show", chain.v["a.report"], "--root", root])
    assert lineage_main(["rebuild", root]) == 0
    assert "indexed 7 artifacts" in capsys.readouterr().out

    assert lineage_main(["show", chain.v["a.report"][:6], "--root", root]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"metrics {chain.v['a.report']}  eval") and f"files {FILES_FINGERPRINT[:16]}" in out
    assert lineage_main(["show", chain.v["a.dataset"], "--root", root, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert sorted(t["version"] for t in shown["downstream"]) == sorted([chain.v["a.checkpoints"], chain.v["b.checkpoints"]])
    page = tmp_path / "lineage.html"
    assert lineage_main(["show", str(chain.a["model"]), "--root", root, "--format", "html", "-o", str(page)]) == 0
    assert capsys.readouterr().out == f"wrote {page}\n" and '<pre class="mermaid">' in page.read_text()
    assert lineage_main(["show", chain.v["a.model"], "--root", root, "--format", "mermaid"]) == 0
    assert capsys.readouterr().out.startswith("flowchart LR")

    assert lineage_main(["list", "--root", root, "--kind", "checkpoints", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["version"] for r in rows) == sorted([chain.v["a.checkpoints"], chain.v["b.checkpoints"]])
    assert lineage_main(["list", "--root", root, "--debug"]) == 0
    assert capsys.readouterr().out.count("\n") == 1 + 8  # header + every node
    with pytest.raises(UserError, match="no nothing artifacts .*kinds there: checkpoints, dataset"):
        lineage_main(["list", "--root", root, "--kind", "nothing"])
    with pytest.raises(UserError, match="no artifact matches 'feedface'"):
        lineage_main(["show", "feedface", "--root", root])
    with pytest.raises(UserError, match="needs a gs:// REF, --project and --region"):
        lineage_main(["show", "gs://b/x", "--project", "p"])
    with pytest.raises(UserError, match="is not a directory"):
        lineage_main(["rebuild", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit) as usage:
        lineage_main(["show", "x", "--format", "png"])
    assert usage.value.code == 2

    # An artifact dir given by path needs no store: it and its inputs are read from their manifests.
    monkeypatch.chdir(tmp_path)
    assert lineage_main(["show", str(chain.b["report"]), "--root", "no-such-root"]) == 0
    out = capsys.readouterr().out
    assert all(chain.v[k] in out for k in ("b.report", "b.model", "b.checkpoints", "a.dataset"))
    assert not Path("no-such-root").exists()


# ---- Vertex ML Metadata --------------------------------------------------------------------------


def vertex_subgraph(chain, stamp_config: bool = True):
    """The LineageSubgraph Vertex would return for run a: KFP artifacts stamped by components.kfp_support,
    with the config their manifests record (`stamp_config`), executions with the run's whole config."""
    from google.cloud import aiplatform_v1 as v1

    store = "projects/p/locations/us-central1/metadataStores/default"
    cfg = load_config("tiny").model_dump_json()
    arts, execs, events = [], [], []
    for i, (name, task) in enumerate((("dataset", "prep"), ("checkpoints", "train"), ("model", "export"),
                                      ("report", "evaluate"))):
        manifest = artifacts.read_manifest(chain.a[name])
        metadata = artifact_metadata(manifest)
        if stamp_config:
            metadata.setdefault("config", manifest["config"])
        else:
            metadata.pop("config", None)
        arts.append(v1.Artifact(
            name=f"{store}/artifacts/{i}", uri=f"gs://bucket/root/run-a/{task}/{name}", schema_title="system.Model",
            metadata=metadata, create_time=manifest["created"].replace("+00:00", "Z")))
        execs.append(v1.Execution(name=f"{store}/executions/{i}", display_name=task, metadata={"input:config": cfg}))
        events.append(v1.Event(artifact=arts[-1].name, execution=execs[-1].name, type_=v1.Event.Type.OUTPUT))
    for execution, read in ((1, [0]), (2, [1, 0]), (3, [2, 0])):
        events += [v1.Event(artifact=arts[r].name, execution=execs[execution].name, type_=v1.Event.Type.INPUT)
                   for r in read]
    return v1.LineageSubgraph(artifacts=arts, executions=execs, events=events)


def test_vertex_lineage_subgraph_converts_to_the_same_tree(chain):
    subgraph = vertex_subgraph(chain)
    view = view_from_subgraph(subgraph, subgraph.artifacts[3].name)
    spine = [(n.artifact.kind, n.artifact.version, n.artifact.step) for n in full_nodes(view.upstream)]
    assert spine == [("metrics", chain.v["a.report"], "eval"), ("exported_model", chain.v["a.model"], "export"),
                     ("checkpoints", chain.v["a.checkpoints"], "train"), ("dataset", chain.v["a.dataset"], "prep")]
    metrics = view.focus
    assert metrics.uri == "gs://bucket/root/run-a/evaluate/report" and metrics.code_version == CODE
    assert metrics.stats["val_tokens"] == 2016 and isinstance(metrics.stats["val_tokens"], int)
    assert metrics.created == artifacts.read_manifest(chain.a["report"])["created"]
    # The config the eval manifest records, as stamped on the artifact: eval's fields only.
    assert metrics.config == artifacts.read_manifest(chain.a["report"])["config"]
    assert "batch_size=" in metrics.config_summary and "steps=" not in metrics.config_summary
    dataset_view = view_from_subgraph(subgraph, subgraph.artifacts[0].name)
    assert [t.artifact.kind for t in dataset_view.downstream] == ["checkpoints"]
    assert "flowchart LR" in render(dataset_view, "html") and len(dataset_view.edges) == 5


def test_vertex_nodes_without_a_stamped_config_show_the_runs_config(chain):
    subgraph = vertex_subgraph(chain, stamp_config=False)
    metrics = view_from_subgraph(subgraph, subgraph.artifacts[3].name).focus
    assert metrics.config == load_config("tiny").model_dump(mode="json")
    assert "config" not in metrics.stats


def test_vertex_view_queries_the_metadata_service(chain):
    from google.api_core import exceptions

    subgraph = vertex_subgraph(chain)
    calls = []

    class FakeClient:  # stands in for aiplatform_v1.MetadataServiceClient
        def list_artifacts(self, request):
            calls.append(("list", request))
            return [subgraph.artifacts[3]]

        def query_artifact_lineage_subgraph(self, request):
            calls.append(("query", request))
            return subgraph

    uri = subgraph.artifacts[3].uri
    view = vertex_view(uri, "p", "us-central1", max_hops=3, client=FakeClient())
    assert view.focus.version == chain.v["a.report"]
    assert calls == [("list", {"parent": "projects/p/locations/us-central1/metadataStores/default",
                               "filter": f'uri="{uri}"'}),
                     ("query", {"artifact": subgraph.artifacts[3].name, "max_hops": 3})]

    class Denied(FakeClient):
        def list_artifacts(self, request):
            raise exceptions.PermissionDenied("caller lacks aiplatform.artifacts.list")

    with pytest.raises(UserError, match="Vertex ML Metadata: 403 Forbidden|PERMISSION_DENIED|FORBIDDEN"):
        vertex_view(uri, "p", "us-central1", client=Denied())

    class Empty(FakeClient):
        def list_artifacts(self, request):
            return []

    with pytest.raises(UserError, match="no artifact with uri gs://"):
        vertex_view(uri, "p", "us-central1", client=Empty())


def test_a_store_outside_the_root_is_rebuilt_from_the_run_records(tmp_path):
    root, elsewhere = tmp_path / "runs", tmp_path / "bucket" / "store"  # pipeline.store=... outside root
    a = run_dirs(elsewhere, None, steps=8)
    root.mkdir()
    with LineageStore(store_path(root)) as store:
        store.record_run("nightly-1", list(a.values()))
        before = queries.snapshot(store)
        record = json.loads((root / "pipeline_runs" / "nightly-1.json").read_text())
        assert [r["uri"] for r in record["artifacts"]] == [str(p) for p in a.values()]
        assert store.rebuild(root) == 4
        assert queries.snapshot(store) == before
        assert sorted(queries.runs(store)) == ["nightly-1"] and len(queries.runs(store)["nightly-1"]) == 5  # + the files source
    with pytest.raises(UserError, match="run name"):
        LineageStore(":memory:").record_run("../x", [])
