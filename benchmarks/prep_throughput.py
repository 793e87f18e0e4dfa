"""The prep job's end-to-end tokens/s against raw HF `tokenizers` encode_batch, and its peak memory at two corpus sizes.

    python benchmarks/prep_throughput.py [--scale N]

Anchor: `Tokenizer.encode_batch` over the same documents, already in memory, on the same cores, in the
same run. The job (`data_prep.prepare`: read, tokenize, split, dedup, pack, write ArrayRecord, publish)
runs in a subprocess with the default Beam options (all cores) and the same tokenizer.json, once on
the standard library's .py files and once on a corpus N times larger (the same files as JSON lines,
each copy given a distinct last line so dedup keeps them). Peak memory is the largest resident set of
the job's processes (launcher, Beam workers), from getrusage(RUSAGE_CHILDREN) once the job has exited:
it must not grow with the corpus. Prints the ratio (goal >= 0.8); record the output in RESULTS.md.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB = 4096  # the demo model's vocabulary


def job(spec: str) -> None:
    """Child process: run prepare() with a DataConfig given as JSON; print its time, tokens and own peak RSS."""
    from configs import DataConfig
    from data_prep import prepare

    args = json.loads(spec)
    start = time.perf_counter()
    data = {k: v for k, v in args["data"].items() if k in DataConfig.model_fields}  # also runs against older checkouts
    cfg = DataConfig(**data)
    # Since 2026-11-24 the Beam options are passed apart from the config (they do not version the output).
    beam = {"beam_args": cfg.beam_args} if "beam_args" in inspect.signature(prepare).parameters else {}
    stats = prepare(cfg, VOCAB, args["out"], log=lambda line: print(line, file=sys.stderr), **beam)
    seconds = time.perf_counter() - start
    print(json.dumps({
        "seconds": seconds, "tokens": sum(stats["tokens"].values()), "documents": sum(stats["documents"].values()),
        "launcher_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "workers_peak_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }))


def stdlib_texts() -> list[str]:
    """The standard library's .py files as prep reads them (good UTF-8 documents only)."""
    from configs import load_config
    from data_prep.sources import read_documents, stdlib_files

    limit = load_config().data.max_document_bytes
    return [t for f in sorted(stdlib_files()) for _, t in read_documents(f, "text", lambda *_: None, limit)]


def make_tokenizer(path: str) -> None:
    """Child process: train the demo's byte-level BPE on the stdlib and save it."""
    from data_prep.tokenizer import train_bpe

    train_bpe(stdlib_texts(), VOCAB).save(path)


def anchor(path: str) -> None:
    """Child process: raw encode_batch (and encode_batch_fast) tokens/s over the documents in memory."""
    from tokenizers import Tokenizer

    tok, texts = Tokenizer.from_file(path), stdlib_texts()
    rates = {}
    for name in ("encode_batch", "encode_batch_fast"):
        start = time.perf_counter()
        encodings = getattr(tok, name)(texts)
        seconds = time.perf_counter() - start
        tokens = sum(len(e.ids) for e in encodings) + len(texts)  # + one EOS per document, as prep writes
        rates[name] = tokens / seconds
        del encodings
    print(json.dumps({"documents": len(texts), "bytes": sum(len(t.encode()) for t in texts), **rates}))


def make_corpus(folder: str, copies: int) -> None:
    """Child process: `copies` JSON-lines files of the stdlib's documents, each copy made distinct by its last line."""
    texts = stdlib_texts()
    for copy in range(copies):
        with open(Path(folder, f"copy{copy}.jsonl"), "w") as f:
            f.writelines(json.dumps({"text": f"{text}\n# copy {copy}\n"}) + "\n" for text in texts)


def child(mode: str, *args: str) -> dict:
    """Run a mode of this script in a fresh interpreter; its last stdout line, parsed as JSON, if any.

    Every heavy step runs in a child so that this process stays small: Linux carries a parent's resident
    set at fork into the child's ru_maxrss, which would inflate the job's peak memory."""
    done = subprocess.run(
        [sys.executable, __file__, f"--{mode}", *args], capture_output=True, text=True, check=False,
        cwd=Path(__file__).resolve().parent.parent,
    )
    if done.returncode:
        sys.exit(f"{mode} failed:\n{done.stderr[-3000:]}")
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=3, help="size of the larger corpus, in standard libraries")
    for mode in ("job", "tokenizer", "anchor", "corpus"):
        parser.add_argument(f"--{mode}", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return job(*args.job)
    if args.tokenizer:
        return make_tokenizer(*args.tokenizer)
    if args.anchor:
        return anchor(*args.anchor)
    if args.corpus:
        return make_corpus(args.corpus[0], int(args.corpus[1]))

    from configs import load_config

    with tempfile.TemporaryDirectory(prefix="maxpipe-bench-") as tmp:
        tmp = Path(tmp)
        tokenizer, big = str(tmp / "tokenizer.json"), tmp / "big"
        big.mkdir()
        child("tokenizer", tokenizer)
        child("corpus", str(big), str(args.scale))
        # The anchor before and after the jobs: the machine is shared, so its speed drifts during the run.
        anchors = [child("anchor", tokenizer)]
        a = anchors[0]
        print(f"corpus: the stdlib, {a['documents']:,} documents, {a['bytes'] / 1e6:.1f} MB; {os.cpu_count()} cores")
        data = {**load_config().data.model_dump(), "tokenizer": tokenizer, "beam_args": []}
        results = {}
        for label, inputs in (("1x", ["stdlib"]), (f"{args.scale}x", [str(big / "*.jsonl")])):
            spec = json.dumps({"data": {**data, "input": inputs}, "out": str(tmp / f"out-{label}")})
            start = time.perf_counter()
            results[label] = r = child("job", spec)
            r["wall_s"] = time.perf_counter() - start
        anchors.append(child("anchor", tokenizer))
        for name in ("encode_batch", "encode_batch_fast"):
            print(f"anchor {name:<18} " + " / ".join(f"{x[name]:,.0f}" for x in anchors) + " tokens/s (before / after the jobs)")
        mean = {name: sum(x[name] for x in anchors) / len(anchors) for name in ("encode_batch", "encode_batch_fast")}
        for label, r in results.items():
            rate = r["tokens"] / r["seconds"]
            print(
                f"prep job {label:>3}: {r['documents']:,} documents, {r['tokens']:,} tokens in {r['seconds']:6.2f} s "
                f"(process wall {r['wall_s']:.1f} s) = {rate:,.0f} tokens/s = {rate / mean['encode_batch']:.2f} x encode_batch, "
                f"{rate / mean['encode_batch_fast']:.2f} x encode_batch_fast; peak RSS: launcher {r['launcher_peak_mib']:,.0f} MiB, "
                f"largest Beam worker {r['workers_peak_mib']:,.0f} MiB"
            )
        small, large = results["1x"], results[f"{args.scale}x"]
        print(f"\nratio (prep job / raw encode_batch, stdlib): {small['tokens'] / small['seconds'] / mean['encode_batch']:.2f}  (goal >= 0.8)")
        for key in ("launcher_peak_mib", "workers_peak_mib"):
            print(
                f"{key}: {small[key]:,.0f} MiB at 1x, {large[key]:,.0f} MiB at {args.scale}x "
                f"({large['tokens'] / small['tokens']:.1f}x the tokens): {large[key] / small[key]:.2f}x"
            )


if __name__ == "__main__":
    main()
