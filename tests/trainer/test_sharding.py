"""Mesh construction: train.mesh within each slice/process times train.dcn_mesh across them."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
import pytest
from jax.experimental import mesh_utils

from configs import UserError, load_config
from trainer.model.sharding import device_grid, granules, make_mesh


@dataclass(frozen=True)
class _Device:
    """What mesh_utils reads of a device, for layouts of several processes or slices inside one test process."""

    id: int
    process_index: int
    slice_index: int = 0
    platform: str = "cpu"
    device_kind: str = "cpu"


def _devices(processes: int, per_process: int) -> list[_Device]:
    return [_Device(p * per_process + i, p) for p in range(processes) for i in range(per_process)]


def _owners(grid: np.ndarray) -> np.ndarray:
    return np.vectorize(lambda d: d.process_index)(grid)


@pytest.mark.parametrize("axes", [{"data": -1}, {"fsdp": 4, "tensor": 2}, {"data": 2, "fsdp": -1, "tensor": 2}])
@pytest.mark.parametrize("dcn", [None, {"data": 1, "fsdp": 1, "tensor": 1}, {"fsdp": -1}], ids=str)
def test_a_dcn_mesh_of_one_slice_keeps_the_plain_mesh(axes: dict[str, int], dcn: dict[str, int] | None) -> None:
    mesh = make_mesh(axes, dcn=dcn)
    shape = tuple(mesh.shape.values())
    assert mesh.axis_names == ("data", "fsdp", "expert", "context", "tensor") and np.prod(shape) == 8
    np.testing.assert_array_equal(mesh.devices, mesh_utils.create_device_mesh(shape, jax.devices()))


def test_the_base_config_has_a_dcn_mesh_of_ones() -> None:
    assert load_config("tiny").train.dcn_mesh == {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    with pytest.raises(UserError, match=r"train.dcn_mesh \{.*\}: at most one axis may be -1"):
        load_config("tiny", ["train.dcn_mesh={data: -1, fsdp: -1}"])
    with pytest.raises(UserError, match="train.dcn_mesh: axis sizes must be positive or -1"):
        load_config("tiny", ["train.dcn_mesh.tensor=0"])


def test_a_dcn_mesh_of_ones_spans_all_processes_with_one_mesh() -> None:
    devices = _devices(2, 4)
    grid = device_grid({"data": 2, "fsdp": -1}, devices, {"data": 1, "fsdp": 1, "tensor": 1})
    assert grid.shape == (2, 4, 1, 1, 1) and list(grid.flat) == devices  # today's mesh: the devices in order


def test_dcn_data_over_two_processes_gives_each_process_half_the_data_axis() -> None:
    devices = _devices(2, 4)
    grid = device_grid({"fsdp": -1}, devices, {"data": 2})
    assert grid.shape == (2, 4, 1, 1, 1)  # data = 2 (DCN) x 1 (ICI), fsdp = 1 x 4, expert = tensor = 1
    np.testing.assert_array_equal(_owners(grid)[:, :, 0, 0, 0], [[0] * 4, [1] * 4])
    assert list(grid.flat) == devices  # each process's devices in their own order

    grid = device_grid({"data": -1, "fsdp": 2}, devices, {"data": -1})  # -1 fills 2 processes, then 2 devices each
    assert grid.shape == (4, 2, 1, 1, 1)
    np.testing.assert_array_equal(_owners(grid)[:, :, 0, 0, 0], [[0, 0], [0, 0], [1, 1], [1, 1]])


def test_dcn_axes_multiply_the_ici_axes_of_the_same_name() -> None:
    grid = device_grid({"data": 2, "fsdp": 2}, _devices(2, 4), {"fsdp": 2})
    assert grid.shape == (2, 4, 1, 1, 1)  # fsdp = 2 (DCN) x 2 (ICI): process 0 holds fsdp 0-1, process 1 fsdp 2-3
    np.testing.assert_array_equal(_owners(grid)[:, :, 0, 0, 0], [[0, 0, 1, 1], [0, 0, 1, 1]])

    grid = device_grid({"tensor": -1}, _devices(4, 2), {"data": 2, "fsdp": 2})
    assert grid.shape == (2, 2, 1, 1, 2)  # tensor stays inside each process
    np.testing.assert_array_equal(_owners(grid)[:, :, 0, 0], [[[0, 0], [1, 1]], [[2, 2], [3, 3]]])


def test_tpu_slices_are_the_dcn_granules_elsewhere_processes() -> None:
    tpu = [_Device(i, process_index=i // 2, slice_index=i // 4, platform="tpu") for i in range(8)]
    unit, groups = granules(tpu)
    assert unit == "slice" and [[d.id for d in g] for g in groups] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    unit, groups = granules(_devices(4, 2))
    assert unit == "process" and len(groups) == 4
    assert granules(jax.devices()) == ("process", [jax.devices()])


@pytest.mark.parametrize(
    "axes, dcn, devices, message",
    [
        ({"data": -1}, {"data": 2}, _devices(1, 8), r"train.dcn_mesh \{'data': 2\} needs 2 processes but there are 1"),
        ({"data": -1}, {"data": 3}, _devices(2, 4), r"dcn_mesh \{'data': 3\} needs 3 processes but there are 2"),
        ({"data": -1}, {"data": -1, "fsdp": 3}, _devices(4, 2), r"dcn_mesh .* does not divide the 4 processes"),
        ({"fsdp": 8}, {"data": 2}, _devices(2, 4), r"mesh \{'fsdp': 8\} needs 8 devices per process but there are 4"),
        ({"fsdp": 3, "data": -1}, {"data": 2}, _devices(2, 4), r"train.mesh .* does not divide the 4 devices per"),
        ({"data": -1}, {"data": 2}, _devices(2, 4)[:7], r"as many devices in each process; they have \[4, 3\]"),
        ({"data": 16}, None, _devices(1, 8), r"train.mesh \{'data': 16\} needs 16 devices but there are 8"),
    ],
)
def test_sizes_that_do_not_multiply_up_are_one_line_errors(axes, dcn, devices, message: str) -> None:
    with pytest.raises(UserError, match=message):
        device_grid(axes, devices, dcn)
