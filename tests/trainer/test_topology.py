"""Compiling the train step for a TPU slice this machine does not have (libtpu's topology descriptions)."""

from __future__ import annotations

import importlib.util

import jax
import pytest

from configs import UserError, load_config
from trainer.train import loop, topology
from trainer.train.topology import parse_slice
from trainer.train.loop import compile_only

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (pip install -e '.[tpu]')"
)


@pytest.mark.parametrize("name, topo, config, wrap", [
    ("v4-8", "v4:2x2x1", "megacore", (False, False, False)),
    ("v5p-64", "v5:2x4x4", "megacore", (False, False, False)),
    ("v5p-128", "v5:4x4x4", "megacore", (True, True, True)),
    ("v5e-16", "v5e:4x4", "default", (False, False, False)),
    ("v5litepod-256", "v5e:16x16", "default", (True, True, False)),
    ("v6e-8", "v6e:2x4", "default", (False, False, False)),
    ("v6e-128", "v6e:8x16", "default", (False, True, False)),
])
def test_cloud_tpu_names_map_to_libtpu_topologies(name, topo, config, wrap) -> None:
    spec = parse_slice(name)
    assert (spec.topology, spec.chip_config, spec.wrap) == (topo, config, wrap)


@pytest.mark.parametrize("name", ["v5p-12", "v5e-2048", "v7-8", "h100-8"])
def test_an_unknown_slice_is_one_line(name: str) -> None:
    with pytest.raises(UserError, match="TPU slice"):
        parse_slice(name)


def test_without_libtpu_the_error_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setattr(topology.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"needs libtpu: pip install -e '\.\[tpu\]'"):
        topology.slice_devices("v5e-4")


def _compile(*overrides: str, seq: int = 128, slice_name: str = "v5e-4") -> tuple[dict, list[str]]:
    cfg = load_config("tiny", list(overrides))
    lines: list[str] = []
    report = compile_only(cfg.model, cfg.train, seq, log=lines.append, documents=True, topology=slice_name)
    return report, lines


@needs_libtpu
def test_tiny_model_compiles_for_a_tpu_slice_with_splash_attention() -> None:
    report, lines = _compile("train.mesh={fsdp: 2, tensor: 2}", "model.dtype=bfloat16")
    assert lines[0] == "attention: splash"  # auto on TPU devices, document masks as segment ids
    assert report["target"] == "v5e-4 (4 x TPU v5 lite)" and report["mesh"] == {"data": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    assert report["fits"] and 0 < report["peak_bytes_per_device"] < report["capacity_bytes_per_device"]
    assert "fits" in lines[-1] and "15.75 GiB" in lines[-1]


@needs_libtpu
def test_several_slices_come_from_the_dcn_mesh() -> None:
    report, lines = _compile("train.mesh={fsdp: -1}", "train.dcn_mesh={data: 2}")
    assert report["target"] == "2 x v5e-4 (8 x TPU v5 lite)"
    assert report["mesh"] == {"data": 2, "fsdp": 4, "expert": 1, "context": 1, "tensor": 1}
    assert report["fits"]


@needs_libtpu
def test_a_model_over_the_chips_memory_does_not_fit() -> None:
    # Llama 3 8B's layers (2 of them: 1.5 B parameters with the embeddings) replicated on every v5e chip:
    # float32 weights, gradients and two Adam moments are about 24 GiB per chip, over v5e's 15.75.
    report, lines = _compile("model=llama3_8b", "model.num_layers=2", "train.mesh={data: -1}", "train.batch_size=4")
    assert report["fits"] is False and report["peak_bytes_per_device"] > report["capacity_bytes_per_device"]
    assert "does not fit, needs" in lines[-1] and "of 15.75 GiB" in lines[-1]


def test_a_program_over_the_hosts_memory_does_not_fit(monkeypatch) -> None:
    """Offloaded activations can overflow the host memory XLA:TPU gives a chip; that too is an answer, not a crash."""
    message = "RESOURCE_EXHAUSTED: Ran out of memory in memory space host. Used 204.75G of 128.00G host."

    class Refused:
        def lower(self, *_: object) -> "Refused":
            return self

        def compile(self) -> None:
            raise jax.errors.JaxRuntimeError(message)

    monkeypatch.setattr(loop, "make_train_step", lambda *_, **__: Refused())
    cfg = load_config("tiny", ["train.mesh={data: -1}", "train.batch_size=8"])
    lines: list[str] = []
    report = loop.compile_only(cfg.model, cfg.train, 32, log=lines.append)
    assert report["fits"] is False and report["host_bytes"] == int(204.75 * 2**30)
    assert lines[-1].endswith("does not fit, needs 204.75 GiB of host memory of 128.00 GiB per device")
