"""The FLOP count behind MFU (6 x matmul parameters x tokens plus causal attention, as MaxText counts it) and
the chip whose peak it is divided by."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import flax.linen as nn
import pytest

from configs import load_config
from trainer.accelerators import chip_of
from trainer.metrics import train_flops_per_step
from trainer.model import Transformer


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



@pytest.mark.parametrize("kind, chip", [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"), ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA L4", "L4"), ("NVIDIA L40S", None), ("NVIDIA A10", "A10"),
    ("TPU v4", "TPU v4"), ("TPU v5 lite", "TPU v5e"), ("TPU v5", "TPU v5p"), ("TPU v6 lite", "TPU v6e"), ("cpu", None),
])
def test_chips_are_named_by_their_device_kind(kind: str, chip: str | None) -> None:
    found = chip_of(SimpleNamespace(device_kind=kind))
    assert (found.name if found else None) == chip
