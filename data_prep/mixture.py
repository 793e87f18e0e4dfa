"""Mixture weights: how many times each train document of a weighted input glob is kept.

A document of a glob with weight w is kept floor(w) times, plus once more if a number drawn from its
content hash is below frac(w): deterministic, and about w copies on average. Weights apply to the
train split only; val holds each of its documents once, so it measures the sources as they are. With
dedup, a text found in several globs is kept once, with the weight of its first occurrence (by file
path, then line).
"""

from __future__ import annotations

from configs import DataConfig

_DRAW_BYTES = slice(14, 21)  # bytes 0-13 of the hash pick the split and the shard; these are independent of them


def copies(weight: float, digest: bytes) -> int:
    """How many times a train document with this content hash is written."""
    whole = int(weight)
    draw = int.from_bytes(digest[_DRAW_BYTES], "big") / 2.0 ** (8 * (_DRAW_BYTES.stop - _DRAW_BYTES.start))
    return whole + (draw < weight - whole)


def weights(cfg: DataConfig) -> list[float]:
    """One weight per input glob (1 when data.weights is empty)."""
    return list(cfg.weights) or [1.0] * len(cfg.input)


def mixture_stats(cfg: DataConfig, files_per_source: list[int], counters: dict[str, int]) -> list[dict]:
    """Per input glob: its weight, files, documents read, duplicates dropped, and what each split got."""
    out = []
    for i, (pattern, weight) in enumerate(zip(cfg.input, weights(cfg))):
        names = ("documents", "duplicates", "train_documents", "train_tokens", "val_documents", "val_tokens")
        got = {name: counters.get(f"source.{i}.{name}", 0) for name in names}
        out.append({
            "input": pattern, "weight": weight, "files": files_per_source[i], "documents_read": got.pop("documents"), **got,
        })
    return out
