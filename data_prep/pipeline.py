"""The Beam graph: read -> tokenize -> split -> group per shard -> pack -> write."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import apache_beam as beam
import numpy as np
from apache_beam.metrics.metric import Metrics, MetricsFilter
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions

from configs import DataConfig
from data_prep import storage
from data_prep.pack import DTYPE, pack, shard_name, write_shard
from data_prep.sources import read_documents
from data_prep.tokenizer import Encoder

NAMESPACE = "maxpipe.prep"
# Workers log at ERROR: at INFO/WARNING every worker process prints a screenful of start-up chatter.
DEFAULT_ARGS = ["--direct_running_mode=multi_processing", "--direct_num_workers=0", "--default_sdk_harness_log_level=ERROR"]
TOKENIZE_BATCH_CHARS = 1 << 20  # documents per encode_batch call: about 1 MB of text
_HASH_BITS = 56  # two 56-bit keys from a document's sha256: one picks the split, one the shard


def pipeline_options(beam_args: list[str]) -> PipelineOptions:
    """DirectRunner on all cores by default; `beam_args` come last and win."""
    return PipelineOptions([*DEFAULT_ARGS, *beam_args])


def is_direct(options: PipelineOptions) -> bool:
    """True for the DirectRunner (this machine), False for Dataflow and other remote runners."""
    return (options.view_as(StandardOptions).runner or "DirectRunner").endswith("DirectRunner")


def runs_in_worker_processes(options: PipelineOptions) -> bool:
    """True when DoFns run in separate worker processes (the multi-processing DirectRunner)."""
    runner = options.view_as(StandardOptions).runner or "DirectRunner"
    return runner.endswith("DirectRunner") and options.view_as(DirectOptions).direct_running_mode == "multi_processing"


def describe(options: PipelineOptions) -> str:
    """The runner in a few words, e.g. "DirectRunner, multi_processing, 2 workers"."""
    runner = options.view_as(StandardOptions).runner or "DirectRunner"
    if not runner.endswith("DirectRunner"):
        return runner
    direct = options.view_as(DirectOptions)
    workers = direct.direct_num_workers or os.cpu_count()
    return f"{runner}, {direct.direct_running_mode}, {workers} worker{'s' * (workers != 1)}"


def _count(name: str, n: int = 1) -> None:
    Metrics.counter(NAMESPACE, name).inc(n)


class ReadFn(beam.DoFn):
    """A file -> (path, line, split key, shard key, text) per document; skips are counted."""

    def __init__(self, text_field: str):
        self.text_field = text_field

    def process(self, path: str):
        for line, text in read_documents(path, self.text_field, lambda reason: _count(f"skipped.{reason}")):
            digest = hashlib.sha256(text.encode()).digest()
            yield path, line, int.from_bytes(digest[:7], "big"), int.from_bytes(digest[7:14], "big"), text


class TokenizeFn(beam.DoFn):
    """A batch of documents -> the same documents with their text replaced by int32 token ids (bytes)."""

    def __init__(self, tokenizer_dir: str):
        self.tokenizer_dir = tokenizer_dir

    def setup(self):
        if storage.is_url(self.tokenizer_dir):  # the staged tokenizer, copied to this worker's disk
            self._local = tempfile.TemporaryDirectory(prefix="maxpipe-tokenizer-")
            storage.download_dir(self.tokenizer_dir, self._local.name)
            self.encoder = Encoder(self._local.name)
        else:
            self.encoder = Encoder(self.tokenizer_dir)

    def teardown(self):
        if hasattr(self, "_local"):
            self._local.cleanup()

    def process(self, batch: list[tuple]):
        for doc, ids in zip(batch, self.encoder.encode_batch([doc[-1] for doc in batch])):
            if len(ids) <= self.encoder.frame_len:  # nothing but BOS/EOS: the tokenizer found no tokens in it
                _count("skipped.no_tokens")
                continue
            yield doc[:-1] + (ids.tobytes(),)


def _assign(doc: tuple, smallest: list[int], threshold: int, train_shards: int, val_shards: int) -> tuple:
    """(shard name, ((path, line), ids)). Val if the split key is below the threshold; the document with
    the smallest key always goes to val, so val is never empty."""
    path, line, split_key, shard_key, ids = doc
    split = "val" if split_key < threshold or [split_key] == smallest else "train"
    count = val_shards if split == "val" else train_shards
    _count(f"documents.{split}")
    return shard_name(split, shard_key % count, count), ((path, line), ids)


class WriteShardFn(beam.DoFn):
    """(shard name, documents) -> one ArrayRecord file: documents ordered by (path, line), packed.

    For a URL out_dir the shard is written to a local temp file on the worker, then uploaded:
    ArrayRecordWriter takes only local paths, and workers share no disk with the launcher."""

    def __init__(self, out_dir: str, seq_len: int):
        self.out_dir, self.seq_len = out_dir, seq_len

    def process(self, element: tuple[str, list]):
        name, docs = element
        docs = sorted(docs, key=lambda doc: doc[0])
        rows = pack([np.frombuffer(ids, DTYPE) for _, ids in docs], self.seq_len)
        if storage.is_url(self.out_dir):
            with tempfile.TemporaryDirectory(prefix="maxpipe-shard-") as tmp:
                write_shard(os.path.join(tmp, name), rows)
                storage.upload(os.path.join(tmp, name), storage.join(self.out_dir, name))
        else:
            write_shard(os.path.join(self.out_dir, name), rows)
        yield name


def _direct_runner(options: PipelineOptions) -> beam.runners.PipelineRunner | None:
    """FnApiRunner for the DirectRunner, None (the options decide) for any other runner.

    Beam's DirectRunner first tries the Prism runner, which downloads a binary from GitHub (offline
    that fails and is logged; online the job would run elsewhere than configured). FnApiRunner is
    what it falls back to, and it honours direct_running_mode and direct_num_workers.
    """
    runner = options.view_as(StandardOptions).runner or "DirectRunner"
    if not runner.endswith("DirectRunner"):
        return None
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    return FnApiRunner()


def shard_names(cfg: DataConfig) -> list[str]:
    """Every shard file the step writes, train first."""
    return [shard_name("train", i, cfg.train_shards) for i in range(cfg.train_shards)] + [
        shard_name("val", i, cfg.val_shards) for i in range(cfg.val_shards)
    ]


def run(
    files: list[Path | str], cfg: DataConfig, tokenizer_dir: Path | str, out_dir: Path | str, options: PipelineOptions
) -> dict[str, int]:
    """Run the graph, writing every shard of `shard_names(cfg)` into out_dir; returns its counters."""
    threshold = int(cfg.val_fraction * 2**_HASH_BITS)
    p = beam.Pipeline(runner=_direct_runner(options), options=options)
    docs = (
        p
        | "Files" >> beam.Create([str(f) for f in files])
        | "Read" >> beam.ParDo(ReadFn(cfg.text_field))
        | "Batch" >> beam.BatchElements(
            min_batch_size=TOKENIZE_BATCH_CHARS, max_batch_size=TOKENIZE_BATCH_CHARS, element_size_fn=lambda d: len(d[-1])
        )
        | "Tokenize" >> beam.ParDo(TokenizeFn(str(tokenizer_dir)))
    )
    smallest = docs | "SplitKeys" >> beam.Map(lambda d: d[2]) | "Smallest" >> beam.combiners.Top.Smallest(1)
    keyed = docs | "Split" >> beam.Map(
        _assign, beam.pvalue.AsSingleton(smallest), threshold, cfg.train_shards, cfg.val_shards
    )
    # An empty placeholder per shard, so that every shard file is written even if no document lands in it.
    placeholders = p | "AllShards" >> beam.Create([(name, (("", -1), b"")) for name in shard_names(cfg)])
    (
        (keyed, placeholders)
        | "Merge" >> beam.Flatten()
        | "PerShard" >> beam.GroupByKey()
        | "Write" >> beam.ParDo(WriteShardFn(str(out_dir), cfg.seq_len))
    )
    result = p.run()
    state = result.wait_until_finish()
    if state != "DONE":
        raise RuntimeError(f"the Beam pipeline ended in state {state}")
    totals: dict[str, int] = defaultdict(int)
    for counter in result.metrics().query(MetricsFilter().with_namespace(NAMESPACE))["counters"]:
        value = counter.committed if counter.committed is not None else counter.attempted
        totals[counter.key.metric.name] += value or 0
    return dict(totals)
