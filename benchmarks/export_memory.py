"""Export (param-only Orbax + HF safetensors) from a training checkpoint: peak RSS and time, streamed vs whole.

    python benchmarks/export_memory.py [--emb 768] [--layers 8] [--repeat 3]

Saves random float32 params of a Llama-shaped model as a training checkpoint (the params item, as
the trainer writes it), then exports it to bfloat16 in fresh subprocesses, each measuring its peak
RSS (VmHWM) above its own baseline after imports: (1) the way the export step works now, reading
the checkpoint a layer at a time as it writes (`latest_stored_params` + `lazy_copies` +
`export_hf`); (2) the anchor, the previous way: restore the whole tree, cast it, save it, export it.
Prints both against the checkpoint's size. Record the output in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
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


def _config(emb: int, layers: int):
    from configs import load_config

    return load_config("tiny", [
        f"model.emb_dim={emb}", f"model.num_layers={layers}", f"model.num_heads={emb // 64}",
        f"model.num_kv_heads={emb // 128}", "model.head_dim=64", f"model.mlp_dim={4 * emb}",
        "model.vocab_size=32000",
    ]).model


def write_run(run: Path, emb: int, layers: int) -> int:
    """A training run directory with one checkpoint of random float32 params; returns their bytes."""
    import jax
    import orbax.checkpoint as ocp

    from trainer.train.checkpoint import CHECKPOINTS_DIR
    from trainer.params.reader import abstract_params

    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.standard_normal(a.shape, np.float32), abstract_params(_config(emb, layers)))
    manager = ocp.CheckpointManager(run / CHECKPOINTS_DIR, options=ocp.CheckpointManagerOptions(create=True),
                                    item_handlers={"params": ocp.StandardCheckpointHandler()})
    manager.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(params)))
    manager.wait_until_finished()
    manager.close()
    return sum(x.nbytes for x in jax.tree.leaves(params))


def child(run: str, out: str, how: str, emb: int, layers: int) -> None:
    """In a fresh process: export to bfloat16 and print seconds and RSS (KiB) as JSON."""
    import jax
    import orbax.checkpoint as ocp

    from trainer.train import checkpoint
    from trainer.params import reader as param_reader
    from trainer.params import writer as param_writer
    from trainer.params import scan_layers
    from trainer.hf.export import export_hf

    cfg = _config(emb, layers)
    jax.device_put(np.zeros(1)).block_until_ready()
    base = _rss_kib("VmRSS")
    start = time.perf_counter()
    quiet = {"log": lambda _: None}
    if how == "streamed":
        _, stored = checkpoint.latest_stored_params(run, param_reader.abstract_params(cfg))
        copies = param_writer.lazy_copies(stored, "bfloat16")
        param_writer.save_lazy_params(out, copies)
        export_hf(stored, cfg, None, Path(out) / "hf", dtype="bfloat16", **quiet)
    else:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(Path(run).absolute() / checkpoint.CHECKPOINTS_DIR / "1" / "params")
        param_writer.save_params(out, scan_layers.cast(params, "bfloat16"))
        export_hf(params, cfg, None, Path(out) / "hf", dtype="bfloat16", **quiet)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "baseline_kib": base, "peak_kib": _rss_kib("VmHWM")}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--emb", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", nargs=3, metavar=("RUN", "OUT", "HOW"))
    args = ap.parse_args()
    if args.child:
        child(*args.child, args.emb, args.layers)
        return
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        size = write_run(run, args.emb, args.layers)
        print(f"checkpoint: {size / 2**20:.1f} MiB of float32 params (emb {args.emb}, {args.layers} layers); "
              f"exported to bfloat16 ({size / 2**21:.1f} MiB) as Orbax params and HF safetensors")
        results = {}
        for k in range(args.repeat):
            for how in ("whole", "streamed"):  # alternating, as the machine is shared
                out = subprocess.run([sys.executable, __file__, "--child", str(run), str(Path(tmp) / f"{how}{k}"), how,
                                      "--emb", str(args.emb), "--layers", str(args.layers)],
                                     capture_output=True, text=True, check=True)
                results.setdefault(how, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
        for how in ("whole", "streamed"):
            runs = results[how]
            peak = max(r["peak_kib"] - r["baseline_kib"] for r in runs) * 1024
            seconds = sorted(r["seconds"] for r in runs)[len(runs) // 2]
            label = "whole tree (anchor)" if how == "whole" else "streamed (export step)"
            print(f"{label:<24} peak RSS above baseline {peak / 2**20:7.1f} MiB = {peak / size:.2f} x the checkpoint "
                  f"(worst of {len(runs)}); {seconds:.2f} s (median)")
        whole = max(r["peak_kib"] - r["baseline_kib"] for r in results["whole"])
        streamed = max(r["peak_kib"] - r["baseline_kib"] for r in results["streamed"])
        print(f"streamed / whole peak RSS: {streamed / whole:.2f}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
