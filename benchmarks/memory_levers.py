"""Per-chip memory of a large model's train step on a TPU slice under each memory lever, compiled on this host.

    python benchmarks/memory_levers.py [--model llama3_70b --topology v5p-128 --mesh '{fsdp: -1}' --batch 64
                                        --seq 8192] [--levers anchor,vocab,offload_remat,offload_opt,all]

Each row is the real train step (`maxpipe train --compile-only --topology`) with one lever changed from the anchor
(remat full, bf16 compute, float32 weights and Adam, whole logits); its ratio is its per-chip peak over the
anchor's, compiled in the same run. Levers: `vocab` = train.vocab_tiling 8 (the logits 1/8 of the sequence at a
time), `remat_custom` = remat custom saving the q/k/v projections on device, `offload_remat` = the same with the MLP
activations moved to host memory, `offload_opt` = train.optimizer_offload (Adam moments in host memory), `all`.
Record the output in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import time

from configs import load_config
from trainer.train.loop import compile_only

LEVERS = {
    "anchor": {},
    "vocab": {"vocab_tiling": 8},
    "remat_custom": {"remat": "custom", "remat_save": ["query_proj", "key_proj", "value_proj"]},
    "offload_remat": {"remat": "custom", "remat_save": ["query_proj", "key_proj", "value_proj"],
                      "remat_offload": ["mlp_gate", "mlp_up"]},
    "offload_opt": {"optimizer_offload": True},
    "all": {"vocab_tiling": 8, "optimizer_offload": True, "remat": "custom",
            "remat_save": ["query_proj", "key_proj", "value_proj"], "remat_offload": ["mlp_gate", "mlp_up"]},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3_70b")
    parser.add_argument("--topology", default="v5p-128")
    parser.add_argument("--mesh", default="{fsdp: -1}")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--levers", default=",".join(LEVERS))
    args = parser.parse_args()
    cfg = load_config("tiny", [f"model={args.model}", f"train.mesh={args.mesh}", f"train.batch_size={args.batch}",
                               "train.remat=full", f"model.max_seq_len={max(args.seq, 1)}"])
    print(f"{args.model} on {args.topology}, mesh {cfg.train.mesh}, batch {args.batch} x seq {args.seq}", flush=True)
    print("| lever | per-chip peak | of which temporaries | host memory | against the anchor | compile |")
    print("|---|---|---|---|---|---|", flush=True)
    anchor = None
    for name in args.levers.split(","):
        start = time.perf_counter()
        report = compile_only(cfg.model, cfg.train.model_copy(update=LEVERS[name]), args.seq, log=lambda _: None,
                              topology=args.topology)
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        if "peak_bytes_per_device" not in report:  # refused for its host memory
            print(f"| {name} | does not fit: needs {gib(report['host_bytes'])} of host memory per chip | | | | "
                  f"{time.perf_counter() - start:.0f} s |", flush=True)
            continue
        peak = report["peak_bytes_per_device"]
        anchor = anchor or peak
        fits = "" if report.get("fits", True) else " (does not fit)"
        print(f"| {name} | {gib(peak)}{fits} | {gib(report.get('temp_bytes', 0))} | {gib(report.get('host_bytes', 0))} "
              f"| {peak / anchor:.2f} | {time.perf_counter() - start:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
