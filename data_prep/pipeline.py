"""The Beam graph: read -> tokenize (ids spilled to disk) -> split -> group per shard -> dedup, pack -> write.

Bad records go to a side output, counted and written, sorted, to the dead-letter file. Only small
per-document entries (a few hundred bytes: where the document came from, its hash, where its ids were
spilled) travel through the per-shard GroupByKey (see spill.py), so the launcher's memory grows with
the number of documents, not with their text or tokens. Document counts in the stats count what was
written: a document its mixture weight repeats counts once per copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import apache_beam as beam
from apache_beam.metrics.metric import Metrics, MetricsFilter
from apache_beam.options.pipeline_options import (
    DirectOptions,
    PipelineOptions,
    StandardOptions,
)

from configs import DataConfig
from data_prep import mixture, storage
from contract.records import shard_name
from data_prep.pack import PACKERS, ShardWriter
from data_prep.sources import DEAD_LETTER, read_documents
from data_prep.spill import SpillReader, SpillWriter
from data_prep.tokenizer import Encoder

NAMESPACE = "maxpipe.prep"
# Workers log at ERROR: at INFO/WARNING every worker process prints a screenful of start-up chatter.
DEFAULT_ARGS = ["--direct_running_mode=multi_processing", "--direct_num_workers=0", "--default_sdk_harness_log_level=ERROR"]
TOKENIZE_BATCH_CHARS = 1 << 20  # documents per encode_batch call: about 1 MB of text
_HASH_BITS = 56  # 56-bit keys from a document's sha256: bytes 0-6 pick the split, 7-13 the shard
SPILL, STATS = ".spill", ".stats"  # folders inside the staging folder


def pipeline_options(beam_args: list[str]) -> PipelineOptions:
    """DirectRunner on all cores by default; `beam_args` come last and win."""
    return PipelineOptions([*DEFAULT_ARGS, *beam_args])


def is_direct(options: PipelineOptions) -> bool:
    """True for the DirectRunner (this machine), False for Dataflow and other remote runners."""
    return (options.view_as(StandardOptions).runner or "DirectRunner").endswith("DirectRunner")


def runs_in_worker_processes(options: PipelineOptions) -> bool:
    """True when DoFns run in separate worker processes (the multi-processing DirectRunner)."""
    return is_direct(options) and options.view_as(DirectOptions).direct_running_mode == "multi_processing"


def describe(options: PipelineOptions) -> str:
    """The runner in a few words, e.g. "DirectRunner, multi_processing, 2 workers"."""
    runner = options.view_as(StandardOptions).runner or "DirectRunner"
    if not is_direct(options):
        return runner
    direct = options.view_as(DirectOptions)
    workers = direct.direct_num_workers or os.cpu_count()
    return f"{runner}, {direct.direct_running_mode}, {workers} worker{'s' * (workers != 1)}"


def _count(name: str, n: int = 1) -> None:
    Metrics.counter(NAMESPACE, name).inc(n)


class Entry(NamedTuple):
    """One document on its way to a shard: where it came from, its hash, and where its ids were spilled."""

    path: str
    line: int
    source: int  # index of the input glob
    digest: bytes  # sha256 of the text
    copies: int  # times written if it lands in train (mixture weight)
    spill: str  # "" when it was not tokenized (it would be written 0 times)
    offset: int
    length: int

    @property
    def split_key(self) -> int:
        return int.from_bytes(self.digest[:7], "big")

    @property
    def shard_key(self) -> int:
        return int.from_bytes(self.digest[7:14], "big")


def _bad(path: str, line: int, reason: str) -> beam.pvalue.TaggedOutput:
    _count(f"skipped.{reason}")
    return beam.pvalue.TaggedOutput("bad", (path, line, reason))


class ReadFn(beam.DoFn):
    """(file, source index) -> (path, line, source, sha256, text) per document; bad records to the "bad" output."""

    def __init__(self, text_field: str, max_bytes: int):
        self.text_field, self.max_bytes = text_field, max_bytes

    def process(self, element: tuple[str, int]):
        path, source = element
        bad = []
        for line, text in read_documents(path, self.text_field, lambda reason, line: bad.append((reason, line)), self.max_bytes):
            while bad:
                reason, at = bad.pop(0)
                yield _bad(path, at, reason)
            _count("read.documents")
            _count(f"source.{source}.documents")
            yield path, line, source, hashlib.sha256(text.encode()).digest(), text
        for reason, at in bad:
            yield _bad(path, at, reason)


class TokenizeFn(beam.DoFn):
    """A batch of documents -> one Entry each, ids appended to this bundle's spill file of the document's shard."""

    def __init__(self, tokenizer_dir: str, spill_dir: str, cfg: DataConfig):
        self.tokenizer_dir, self.spill_dir = tokenizer_dir, spill_dir
        self.weights = mixture.weights(cfg)
        self.threshold = int(cfg.val_fraction * 2**_HASH_BITS)
        self.counts = {"train": cfg.train_shards, "val": cfg.val_shards}

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

    def start_bundle(self):
        self._spills: dict[str, SpillWriter] = {}

    def finish_bundle(self):
        for spill in self._spills.values():
            spill.close()

    def process(self, batch: list[tuple]):
        docs = []
        for path, line, source, digest, text in batch:
            copies = mixture.copies(self.weights[source], digest)
            val = int.from_bytes(digest[:7], "big") < self.threshold
            shard = _shard("val" if val else "train", int.from_bytes(digest[7:14], "big"), self.counts)
            docs.append((path, line, source, digest, copies, text if copies or val else None, shard))
        encoded = iter(self.encoder.encode_batch([d[5] for d in docs if d[5] is not None]))
        for path, line, source, digest, copies, text, shard in docs:
            if text is None:  # a train document its weight drops: only its hash is needed (for dedup)
                yield Entry(path, line, source, digest, copies, "", 0, 0)
                continue
            ids = next(encoded)
            if len(ids) <= self.encoder.frame_len:  # nothing but BOS/EOS: the tokenizer found no tokens in it
                yield _bad(path, line, "no_tokens")
                continue
            spill = self._spills.get(shard)  # one spill file per shard, so a shard's writer fetches only its own
            if spill is None:
                spill = self._spills[shard] = SpillWriter(self.spill_dir, shard.removesuffix(".array_record"))
            yield Entry(path, line, source, digest, copies, spill.path, spill.append(ids), len(ids))


def _shard(split: str, shard_key: int, counts: dict[str, int]) -> str:
    return shard_name(split, shard_key % counts[split], counts[split])


def _assign(entry: Entry, smallest: list[int], threshold: int, counts: dict[str, int]) -> tuple[str, Entry]:
    """(shard name, entry). Val if the split key is below the threshold; the kept document with the
    smallest key always goes to val, so val is never empty."""
    split = "val" if entry.split_key < threshold or [entry.split_key] == smallest else "train"
    return _shard(split, entry.shard_key, counts), entry


class WriteShardFn(beam.DoFn):
    """(shard name, entries) -> one ArrayRecord file: duplicates dropped, documents ordered by (copy, path,
    line), packed and streamed to the file; its stats go to staging/.stats/NAME.json.

    For a URL out_dir the shard is written to a local temp file on the worker, then uploaded:
    ArrayRecordWriter takes only local paths, and workers share no disk with the launcher."""

    def __init__(self, out_dir: str, cfg: DataConfig):
        self.out_dir, self.seq_len, self.packing, self.dedup = out_dir, cfg.seq_len, cfg.packing, cfg.dedup

    def process(self, element: tuple[str, list]):
        name, entries = element
        split = name.split("-")[0]
        order = []
        for entry in self._unique([e for e in entries if e is not None]):
            for copy in range((entry.copies if split == "train" else 1) if entry.spill else 0):
                order.append((copy, entry.path, entry.line, entry))
        order.sort(key=lambda item: item[:3])
        remote = storage.is_url(self.out_dir)
        with tempfile.TemporaryDirectory(prefix="maxpipe-shard-") as tmp:
            local = os.path.join(tmp, name) if remote else os.path.join(self.out_dir, name)
            writer, reader, packer = ShardWriter(local), SpillReader(), PACKERS[self.packing](self.seq_len)
            tokens = 0
            try:
                for _, _, _, entry in order:
                    ids = reader.read(entry.spill, entry.offset, entry.length)
                    for row in packer.add(ids):
                        writer.write(row)
                    tokens += len(ids)
                    _count(f"documents.{split}")
                    _count(f"source.{entry.source}.{split}_documents")
                    _count(f"source.{entry.source}.{split}_tokens", len(ids))
                for row in packer.finish():
                    writer.write(row)
            except BaseException:
                writer.abort()
                raise
            finally:
                reader.close()
            writer.close()
            stats = {
                "name": name, "split": split, "sequences": writer.records, "tokens": tokens,
                "padding_tokens": writer.records * self.seq_len - tokens, "bytes": os.path.getsize(local),
                "sha256": storage.sha256(local),
            }
            if remote:
                storage.upload(local, storage.join(self.out_dir, name))
        storage.write_bytes(storage.join(self.out_dir, STATS, f"{name}.json"), json.dumps(stats).encode())
        yield name

    def _unique(self, entries: list[Entry]) -> list[Entry]:
        """With dedup, the first occurrence (by path, line) of each text; identical texts share a shard."""
        if not self.dedup:
            return entries
        first: dict[bytes, Entry] = {}
        for entry in sorted(entries, key=lambda e: (e.path, e.line)):
            if entry.digest in first:
                _count("duplicates")
                _count(f"source.{entry.source}.duplicates")
            else:
                first[entry.digest] = entry
        return list(first.values())


class WriteDeadLetterFn(beam.DoFn):
    """All bad records -> dead_letter.jsonl in out_dir, one JSON object per line, sorted (source, line, reason)."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def process(self, element: tuple[str, list]):
        records = sorted(r for r in element[1] if r is not None)
        lines = "".join(json.dumps({"source": s, "line": n, "reason": r}) + "\n" for s, n, r in records)
        storage.write_bytes(storage.join(self.out_dir, DEAD_LETTER), lines.encode())
        yield len(records)


def _direct_runner(options: PipelineOptions) -> beam.runners.PipelineRunner | None:
    """FnApiRunner for the DirectRunner, None (the options decide) for any other runner.

    Beam's DirectRunner first tries the Prism runner, which downloads a binary from GitHub (offline
    that fails and is logged; online the job would run elsewhere than configured). FnApiRunner is
    what it falls back to, and it honours direct_running_mode and direct_num_workers. The options
    reach the SDK workers as the DirectRunner hands them over (without them the workers log at INFO).
    """
    if not is_direct(options):
        return None
    from apache_beam.portability.api import beam_provision_api_pb2
    from apache_beam.runners.portability.fn_api_runner import fn_runner
    from apache_beam.runners.portability.portable_runner import JobServiceHandle

    encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options())
    info = beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded)
    return fn_runner.FnApiRunner(provision_info=fn_runner.ExtendedProvisionInfo(info))


def shard_names(cfg: DataConfig) -> list[str]:
    """Every shard file the step writes, train first."""
    return [shard_name("train", i, cfg.train_shards) for i in range(cfg.train_shards)] + [
        shard_name("val", i, cfg.val_shards) for i in range(cfg.val_shards)
    ]


def build(
    sources: list[tuple[Path | str, int]], cfg: DataConfig, tokenizer_dir: Path | str, out_dir: Path | str,
    options: PipelineOptions,
) -> beam.Pipeline:
    """The prep graph on a new Pipeline with these options, not yet run.

    `sources` are (file, input glob index); out_dir receives the shards, dead_letter.jsonl and the
    .spill/ and .stats/ working folders."""
    out_dir, threshold = str(out_dir), int(cfg.val_fraction * 2**_HASH_BITS)
    p = beam.Pipeline(runner=_direct_runner(options), options=options)
    read = (
        p
        | "Files" >> beam.Create([(str(f), i) for f, i in sources])
        | "Read" >> beam.ParDo(ReadFn(cfg.text_field, cfg.max_document_bytes)).with_outputs("bad", main="docs")
    )
    tokenized = (
        read.docs
        | "Batch" >> beam.BatchElements(
            min_batch_size=TOKENIZE_BATCH_CHARS, max_batch_size=TOKENIZE_BATCH_CHARS, element_size_fn=lambda d: len(d[-1])
        )
        | "Tokenize" >> beam.ParDo(TokenizeFn(str(tokenizer_dir), str(storage.join(out_dir, SPILL)), cfg)).with_outputs(
            "bad", main="entries"
        )
    )
    entries = tokenized.entries
    # Among documents with tokens kept: one its train weight dropped could not be written to val.
    smallest = (
        entries
        | "SplitKeys" >> beam.FlatMap(lambda e: [e.split_key] if e.spill else [])
        | "Smallest" >> beam.combiners.Top.Smallest(1)
    )
    counts = {"train": cfg.train_shards, "val": cfg.val_shards}
    keyed = entries | "Split" >> beam.Map(_assign, beam.pvalue.AsSingleton(smallest), threshold, counts)
    # An empty placeholder per shard, so that every shard file is written even if no document lands in it.
    placeholders = p | "AllShards" >> beam.Create([(name, None) for name in shard_names(cfg)])
    (
        (keyed, placeholders)
        | "Merge" >> beam.Flatten()
        | "PerShard" >> beam.GroupByKey()
        | "Write" >> beam.ParDo(WriteShardFn(out_dir, cfg))
    )
    (
        (read.bad, tokenized.bad, p | "NoBad" >> beam.Create([None]))
        | "AllBad" >> beam.Flatten()
        | "OneKey" >> beam.Map(lambda r: (DEAD_LETTER, r))
        | "Gather" >> beam.GroupByKey()
        | "DeadLetter" >> beam.ParDo(WriteDeadLetterFn(out_dir))
    )
    return p


def run(
    sources: list[tuple[Path | str, int]], cfg: DataConfig, tokenizer_dir: Path | str, out_dir: Path | str,
    options: PipelineOptions,
) -> dict[str, int]:
    """Run the graph into out_dir (see `build`); returns its counters."""
    for folder in (SPILL, STATS):
        storage.makedirs(storage.join(out_dir, folder))
    result = build(sources, cfg, tokenizer_dir, out_dir, options).run()
    state = result.wait_until_finish()
    if state != "DONE":
        raise RuntimeError(f"the Beam pipeline ended in state {state}")
    totals: dict[str, int] = defaultdict(int)
    for counter in result.metrics().query(MetricsFilter().with_namespace(NAMESPACE))["counters"]:
        value = counter.committed if counter.committed is not None else counter.attempted
        totals[counter.key.metric.name] += value or 0
    return dict(totals)


def shard_stats(cfg: DataConfig, out_dir: Path | str) -> list[dict]:
    """The per-shard stats the writers left in out_dir/.stats, in shard order."""
    return [json.loads(storage.read_bytes(storage.join(out_dir, STATS, f"{n}.json"))) for n in shard_names(cfg)]
