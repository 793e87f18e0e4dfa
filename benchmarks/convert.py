"""HF -> Orbax ingest: throughput against reading the same safetensors bytes, and peak RSS against model size.

    python benchmarks/convert.py [--family llama|gpt_oss] [--emb 768] [--layers 8] [--dtype bfloat16] [--repeat 3]

Writes a random Llama-shaped safetensors checkpoint of a few hundred MB (sharded, with an index), or with
--family gpt_oss a GPT-OSS-shaped one whose experts are MXFP4 as on the hub (so the model, dequantized, is ~3.5x
the bytes read; "model size" below is always the converted model's),
then, in the same run: (1) reads its bytes (the anchor), (2) converts it in a subprocess
(`load_hf_params`, then the whole `ingest` with the Orbax write) and reads the child's peak RSS
(VmHWM) above its own baseline after imports and JAX's start-up. Both are done twice: from disk
(the files evicted from the page cache first, as the issue's goal reads) and from the page cache (as
a re-run would read them). Goals: conversion throughput >= 0.5 x the raw read; peak RSS above
baseline <= 0.5 x model size. Each child runs --repeat times (the median ratio and the worst RSS are
shown); a plain copy of the same bytes, with and without fsync, is printed for scale.
Record the output in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _config(family: str, emb: int, layers: int, dtype: str):
    from configs import load_config

    sizes = [f"model.emb_dim={emb}", f"model.num_layers={layers}", f"model.num_heads={emb // 64}",
             f"model.num_kv_heads={emb // 128}", "model.head_dim=64", "model.vocab_size=32000",
             f"model.param_dtype={dtype}"]
    if family == "gpt_oss":  # 8 experts of GPT-OSS's shape (expert width = emb), top-4
        return load_config("tiny", ["model.name=tiny_gpt_oss", *sizes, f"model.mlp_dim={emb}",
                                    "model.num_experts=8", "model.experts_per_token=4"]).model
    return load_config("tiny", [*sizes, f"model.mlp_dim={4 * emb}"]).model


def write_checkpoint(path: Path, family: str, emb: int, layers: int, dtype: str, shards: int = 4) -> tuple[int, int]:
    """A random HF checkpoint in `shards` safetensors files with an index (GPT-OSS: its experts in a fifth, MXFP4);
    returns its data bytes and the converted model's."""
    from safetensors.numpy import save_file

    from trainer.hf import mxfp4
    from trainer.hf.config import hf_config_from_model
    from trainer.hf.tensor_spec import hf_names, stacked_shape
    from trainer.hf.tensors import tensor_specs
    from trainer.hf.safetensors_io import write_safetensors

    cfg = _config(family, emb, layers, dtype)
    rng = np.random.default_rng(0)
    specs = tensor_specs(cfg)
    entries = list({name: spec.hf_shape for spec in specs for name in hf_names(spec, cfg)}.items())
    packed = [(n, s) for n, s in entries if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    entries = [e for e in entries if e not in packed]
    path.mkdir(parents=True)
    total, weight_map = 0, {}
    for k in range(shards):
        part = entries[k::shards]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        fetch = lambda shape: lambda: rng.standard_normal(shape, np.float32)  # noqa: E731
        total += write_safetensors(path / fname, [(n, s, fetch(s)) for n, s in part], np.dtype(dtype))
        weight_map.update({n: fname for n, _ in part})
    if packed:  # random codes, scales around 2**-4 as trained weights have them
        tensors = {}
        for name, shape in packed:
            blocks = mxfp4.blocks_shape(shape)
            tensors[name + mxfp4.BLOCKS] = rng.integers(0, 256, blocks, np.uint8)
            tensors[name + mxfp4.SCALES] = rng.integers(120, 128, blocks[:-1], np.uint8)
        save_file(tensors, path / "model-experts.safetensors")
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update({n: "model-experts.safetensors" for n in tensors})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = hf_config_from_model(cfg, None, 0)
    if packed:
        config["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))
    converted = sum(int(np.prod(stacked_shape(s, cfg))) for s in specs) * np.dtype(dtype).itemsize
    return total, converted


def child(hf_dir: str, out_dir: str, what: str) -> None:
    """Run in a fresh process: convert and print timing and RSS (KiB) as JSON."""
    from trainer.hf.config import model_config_from_hf, read_hf_config
    from trainer.hf.ingest import ingest, load_hf_params

    cfg = model_config_from_hf(read_hf_config(hf_dir))
    cfg = cfg.model_copy(update={"param_dtype": json.loads(Path(hf_dir, "config.json").read_text())["dtype"]})
    import jax

    jax.device_put(np.zeros(1)).block_until_ready()  # the XLA client's start-up belongs to the baseline
    base = _rss_kib("VmRSS")
    start = time.perf_counter()
    if what == "load":
        load_hf_params(hf_dir, cfg)
    else:
        ingest(hf_dir, out_dir, cfg, log=lambda _: None)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "baseline_kib": base, "peak_kib": _rss_kib("VmHWM")}))


def evict(hf_dir: Path) -> None:
    """Drop the checkpoint's files from the page cache, so that the next read comes from disk."""
    for p in hf_dir.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(hf_dir: Path, cold: bool) -> float:
    if cold:
        evict(hf_dir)
    start = time.perf_counter()
    for p in sorted(hf_dir.glob("*.safetensors")):
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass
    return time.perf_counter() - start


def copy_all(hf_dir: Path, dest: Path) -> tuple[float, float]:
    """Seconds to copy the safetensors bytes into one file, and to fsync it too."""
    buf = memoryview(bytearray(64 << 20))
    start = time.perf_counter()
    with open(dest, "wb") as out:
        for p in sorted(hf_dir.glob("*.safetensors")):
            with open(p, "rb") as f:
                while n := f.readinto(buf):
                    out.write(buf[:n])
        cached = time.perf_counter() - start
        os.fsync(out.fileno())
    synced = time.perf_counter() - start
    dest.unlink()
    return cached, synced


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=("llama", "gpt_oss"), default="llama")
    ap.add_argument("--emb", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", nargs=3, metavar=("HF_DIR", "OUT", "WHAT"))
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf"
        read_size, size = write_checkpoint(hf_dir, args.family, args.emb, args.layers, args.dtype)
        print(f"{args.family} model: {size / 2**20:.1f} MiB of {args.dtype} from {read_size / 2**20:.1f} MiB of "
              f"safetensors (emb {args.emb}, {args.layers} layers)")
        for what in ("load", "ingest"):
            for cold in (True, False):
                runs = []
                for _ in range(args.repeat):  # the machine is shared: each run gets its own anchor, the median is shown
                    read_s = read_all(hf_dir, cold)
                    if cold:
                        evict(hf_dir)
                    out = subprocess.run([sys.executable, __file__, "--child", str(hf_dir), str(Path(tmp) / what), what],
                                         capture_output=True, text=True, check=True)
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    runs.append((read_s / r["seconds"], read_s, r))
                runs.sort(key=lambda x: x[0])
                ratio, read_s, r = runs[len(runs) // 2]
                peak = max(x[2]["peak_kib"] - x[2]["baseline_kib"] for x in runs) * 1024
                label = ("load_hf_params" if what == "load" else "ingest (+ Orbax write)") + (", disk" if cold else ", cache")
                print(f"{label:<31} {r['seconds']:6.2f} s = {size / r['seconds'] / 2**20:7.1f} MiB/s; raw read {read_s:5.2f} s = "
                      f"{read_size / read_s / 2**20:7.1f} MiB/s; throughput ratio {ratio:.2f} (goal >= 0.5; "
                      f"median of {len(runs)}, range {runs[0][0]:.2f}-{runs[-1][0]:.2f})")
                print(f"{'':<31} peak RSS above baseline {peak / 2**20:7.1f} MiB = {peak / size:.2f} x model size "
                      f"(goal <= 0.5, worst of {len(runs)}); baseline {r['baseline_kib'] / 1024:.0f} MiB")
        # For scale: copying the same bytes into one new file (page cache, then fsync), median of the repeats.
        copies = sorted(copy_all(hf_dir, Path(tmp) / "copy") for _ in range(args.repeat))
        cached, synced = copies[len(copies) // 2]
        print(f"{'(plain copy, for scale)':<31} read + write the bytes {cached:5.2f} s (ratio {read_s / cached:.2f}), "
              f"+ fsync {synced:5.2f} s (ratio {read_s / synced:.2f})")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
