"""The FLOP count behind MFU (6 x matmul parameters x tokens plus causal attention, as MaxText counts it), the
chip whose peak it is divided by, and the metrics log (JSON lines and TensorBoard events) across a resume."""

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import flax.linen as nn
import pytest
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.record_writer import masked_crc32c

from configs import load_config
from trainer.train.accelerators import chip_of
from trainer.train.metrics import train_flops_per_step
from trainer.model.decoder import Transformer
from trainer.train.run_log import MetricsLog


def matmul_params(params: dict) -> int:
    """Parameters that take part in a matmul: every kernel (the embedding lookup and norm scales do not)."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return sum(x.size for path, x in leaves if "kernel" in jax.tree_util.keystr(path))


@pytest.mark.parametrize("overrides", [[], ["model.num_kv_heads=4", "model.tie_embeddings=true"]])
def test_flops_are_six_n_tokens_plus_attention(overrides: list[str]) -> None:
    cfg = load_config("tiny", overrides).model
    batch, seq = 4, 128
    tokens = jnp.zeros((1, seq), jnp.int32)
    params = nn.unbox(jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tokens)["params"])
    n = matmul_params(params) + (cfg.vocab_size * cfg.emb_dim if cfg.tie_embeddings else 0)  # tied: the unembed matmul
    # Causal attention: QK^T and PV each 2 * seq * seq/2 * head_dim per head and token row, x3 for fwd + bwd.
    attention = 3 * cfg.num_layers * 4 * batch * seq * seq * cfg.num_heads * cfg.head_dim / 2
    assert train_flops_per_step(cfg, batch, seq) == pytest.approx(6 * n * batch * seq + attention, rel=1e-9)


def test_sliding_window_layers_count_their_window_not_the_whole_sequence() -> None:
    """MaxText's count: a local layer scores seq x window (halved for causality), a global one seq x seq."""
    batch, seq, window = 2, 256, 64
    full = load_config("tiny", ["model.global_every=2"]).model  # no window: every layer global
    windowed = load_config("tiny", ["model.global_every=2", f"model.sliding_window={window}"]).model
    per_layer_square = 3 * 4 * batch * seq * full.num_heads * full.head_dim / 2  # x span
    local_layers = full.num_layers // 2
    saved = local_layers * per_layer_square * (seq - window)
    assert train_flops_per_step(full, batch, seq) - train_flops_per_step(windowed, batch, seq) == pytest.approx(saved)
    assert train_flops_per_step(windowed, batch, window) == train_flops_per_step(full, batch, window)  # window >= seq



@pytest.mark.parametrize("kind, chip", [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"), ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA L4", "L4"), ("NVIDIA L40S", None), ("NVIDIA A10", "A10"),
    ("TPU v4", "TPU v4"), ("TPU v5 lite", "TPU v5e"), ("TPU v5", "TPU v5p"), ("TPU v6 lite", "TPU v6e"), ("cpu", None),
])
def test_chips_are_named_by_their_device_kind(kind: str, chip: str | None) -> None:
    found = chip_of(SimpleNamespace(device_kind=kind))
    assert (found.name if found else None) == chip


def read_events(path: Path) -> list[Event]:
    """The Event protos of one TFRecord file, checksums checked; a record a killed run left half-written ends it."""
    data, events, at = path.read_bytes(), [], 0
    while at + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[at : at + 8])
        end = at + 12 + length + 4
        if end > len(data):
            break
        payload = data[at + 12 : end - 4]
        assert struct.unpack("<I", data[at + 8 : at + 12])[0] == masked_crc32c(data[at : at + 8])
        assert struct.unpack("<I", data[end - 4 : end])[0] == masked_crc32c(payload)
        events.append(Event.FromString(payload))
        at = end
    return events


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} as TensorBoard shows it: files read in name order, and a SessionLog START at step s
    (brain.Event:2 files) hiding the events read before it at steps >= s."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        for event in read_events(path):
            if event.session_log.status == SessionLog.START:
                scalars = {tag: [(s, v) for s, v in kept if s < event.step] for tag, kept in scalars.items()}
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def _row(loss: float) -> dict[str, float]:
    return {"loss": loss, "learning_rate": 1e-3, "grad_norm": 1.0, "step_time": 0.5, "tokens_per_s": 100.0,
            "tflops_per_device": 1.0, "mfu": 0.25}


def test_a_resumed_log_drops_the_rows_and_hides_the_events_past_its_checkpoint(tmp_path: Path) -> None:
    files = {"path": tmp_path / "metrics.jsonl", "tensorboard_dir": tmp_path / "tensorboard"}
    killed = MetricsLog(total_steps=6, every=1, log=lambda _: None, **files)
    for step in range(1, 6):  # a run killed after logging step 5, its last checkpoint at step 3
        killed.write(step, _row(float(step)))
    killed.close()
    resumed = MetricsLog(total_steps=6, every=1, log=lambda _: None, resume_step=3, **files)
    resumed.write(4, _row(40.0))
    resumed.close()  # killed again, before step 5

    rows = [json.loads(line) for line in files["path"].read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    first, _ = sorted(files["tensorboard_dir"].iterdir())
    assert first.name.startswith("events.out.tfevents.") and read_events(first)[0].file_version == "brain.Event:2"
    assert {e.step for e in read_events(first) if e.summary.value} == {1, 2, 3, 4, 5}  # the killed run's file is kept
    shown = tensorboard_scalars(files["tensorboard_dir"])
    assert set(shown) == set(_row(0.0))
    assert shown["loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]  # its steps 4 and 5 are hidden
