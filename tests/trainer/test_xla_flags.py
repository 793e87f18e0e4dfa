"""Default XLA flags: user flags win, the off switch, nothing on CPU, and every flag accepted by this jaxlib and libtpu."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from components import steps
from configs import load_config
from contract.manifest import publish
from trainer.train import xla_flags

USER = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/hlo"


def test_user_flags_win_and_the_rest_are_added() -> None:
    env = {"XLA_FLAGS": USER}
    line = xla_flags.apply(env, "gpu")
    flags = env["XLA_FLAGS"].split()
    assert flags[:2] == USER.split() and "--xla_gpu_enable_latency_hiding_scheduler=true" not in flags
    assert set(flags[2:]) == set(xla_flags.flags("gpu")) - {"--xla_gpu_enable_latency_hiding_scheduler=true"}
    assert line.startswith("xla flags (gpu): XLA_FLAGS='--xla_gpu_enable_latency_hiding_scheduler=false ")
    assert line.endswith(f"({len(flags) - 2} defaults added)")
    xla_flags.apply(env, "gpu")  # a second call adds nothing
    assert env["XLA_FLAGS"].split() == flags


def test_tpu_flags_go_to_libtpu_init_args() -> None:
    env = {"LIBTPU_INIT_ARGS": "--xla_enable_async_all_gather=false"}
    assert xla_flags.apply(env, "tpu").startswith("xla flags (tpu): LIBTPU_INIT_ARGS=")
    assert env["LIBTPU_INIT_ARGS"].split()[0] == "--xla_enable_async_all_gather=false"
    assert "--xla_enable_async_all_gather=true" not in env["LIBTPU_INIT_ARGS"] and "XLA_FLAGS" not in env


def test_the_off_switch_sets_nothing() -> None:
    env = {"MAXPIPE_XLA_FLAGS": "none", "XLA_FLAGS": USER}
    assert xla_flags.apply(env, "gpu") == f"xla flags (gpu): defaults off (MAXPIPE_XLA_FLAGS=none); XLA_FLAGS={USER!r}"
    assert env["XLA_FLAGS"] == USER


@pytest.mark.parametrize("env, platform", [
    ({}, "cpu"), ({"JAX_PLATFORMS": "cpu"}, "cpu"), ({"JAX_PLATFORMS": "cuda,cpu"}, "gpu"), ({"JAX_PLATFORMS": "tpu"}, "tpu"),
])
def test_the_platform_comes_from_jax_platforms_first(env, platform) -> None:
    assert xla_flags.detect_platform(env) == platform  # {}: this machine has libtpu but no TPU chip, no CUDA plugin


def test_cpu_sets_nothing_and_the_train_step_logs_it(tmp_path) -> None:
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": USER}
    assert xla_flags.apply(env) == "xla flags (cpu): none" and env == {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": USER}
    publish(tmp_path, kind="dataset", step="prep", version="d", code="c", config={}, settings={}, inputs=[], stats={})
    lines = []
    steps.plan_train(load_config("tiny", []), tmp_path, log=lines.append)  # the tests run on CPU (conftest)
    assert lines == ["xla flags (cpu): none"]


def test_pipelined_collectives_are_spelled_as_each_jaxlib_takes_them() -> None:
    old, new = ({name for name, _, _ in xla_flags.gpu_flags(v)} for v in ((0, 10, 2), (0, 11, 2)))
    assert old - new == {f"xla_gpu_enable_pipelined_{c}" for c in xla_flags.PIPELINED}
    assert new - old == {f"xla_gpu_pipeline_{c}" for c in xla_flags.PIPELINED}


def test_every_gpu_flag_is_accepted_by_this_jaxlib() -> None:
    # XLA parses every platform's flags whatever the backend and aborts on one it does not know: CPU checks them.
    refused, error = xla_flags.rejected(xla_flags.flags("gpu") + ["--xla_gpu_no_such_flag=true"])
    assert refused == ["xla_gpu_no_such_flag"] and "Unknown flag in XLA_FLAGS" in error


TPU_COMPILE = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from trainer.train.topology import slice_devices
mesh = Mesh(np.array(slice_devices("v5p-8")).reshape(2, 2), ("data", "fsdp"))
w = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))
x = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P(("data", "fsdp"), None)))
jax.jit(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2))).lower(w, x).compile()
"""


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_every_tpu_flag_is_accepted_by_libtpu_compiling_for_v5p_8() -> None:
    # libtpu refuses an unknown flag in LIBTPU_INIT_ARGS ("Unknown command line flag") and exits.
    env = {**os.environ, "LIBTPU_INIT_ARGS": " ".join(xla_flags.flags("tpu")), "JAX_PLATFORMS": ""}
    run = subprocess.run([sys.executable, "-c", TPU_COMPILE], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, [line for line in run.stderr.splitlines() if "flag" in line.lower()][-1:]
