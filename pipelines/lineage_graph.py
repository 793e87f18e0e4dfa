"""The lineage graph as people read it: nodes (artifacts), the trees around one of them, and their summaries.

Built from any graph given as three lookups (node, inputs, users): the SQLite store's or Vertex ML Metadata's.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

EXTERNAL_KINDS = frozenset({"files", "hf_checkpoint"})  # inputs that no step produced: a fingerprint and a uri

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
SUMMARY_FALLBACK = 6  # scalars shown when none of the telling fields (or stats) are there


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
    config: dict[str, Any] = field(default_factory=dict)  # the config its manifest records (what versions it)
    key: str = ""  # the node's id where it is stored (SQLite row id, Vertex resource name)

    @property
    def external(self) -> bool:
        """Whether no step produced it (data files, a HF checkpoint)."""
        return self.kind in EXTERNAL_KINDS


@dataclass
class Tree:
    """A node and its inputs (upstream) or users (downstream); `repeat`: shown in full elsewhere in the tree."""

    artifact: Artifact
    children: list[Tree] = field(default_factory=list)
    repeat: bool = False

    def walk(self) -> Iterator[Tree]:
        """This node, then every node below it, depth first."""
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


def key_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """The few stats worth showing beside a node (falls back to the first scalar ones)."""
    picked = {path: value for path in KEY_STATS if _is_scalar(value := _dig(stats, path))}
    if not picked:
        picked = {k: v for k, v in stats.items() if _is_scalar(v)}
        picked = dict(list(picked.items())[:SUMMARY_FALLBACK])
    return picked


def config_summary(config: dict[str, Any]) -> str:
    """A one-line summary of the config a manifest records: its most telling fields (else its first), as `name=value`."""
    paths = [p for p in CONFIG_FIELDS if _dig(config, p) is not None] or list(_flat(config))[:SUMMARY_FALLBACK]
    parts = []
    for path in paths:
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
    """The value at a dotted path, nested (`{"data": {"seq_len": ..}}`) or flat (`{"data.seq_len": ..}`)."""
    if path in tree:
        return tree[path]
    for part in path.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level of dotted paths."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float, str)) and not isinstance(value, bool) and value != ""
