"""ParallelConfig validates before anything compiles and builds the mesh in the design's axis order."""

import jax
import pytest

from jaxdit import distributed
from jaxdit.mesh import MESH_AXES, DeviceMesh, ParallelConfig


def test_mesh_axes_outer_to_inner_and_size_one_axes_kept():
    mesh = ParallelConfig(cfg=2, ulysses=4).make_mesh()
    assert tuple(mesh.axis_names) == ("data", "cfg", "pipefusion", "ring", "ulysses", "tensor") == MESH_AXES
    assert dict(mesh.shape) == dict(data=1, cfg=2, pipefusion=1, ring=1, ulysses=4, tensor=1)
    # The innermost axes vary fastest: ulysses neighbours are consecutive devices.
    ids = [[d.id for d in row] for row in mesh.devices.reshape(2, 4)]
    assert ids == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_explicit_device_list_and_round_trip():
    devices = jax.devices()[4:]
    config = ParallelConfig(ring=2, ulysses=2)
    mesh = config.make_mesh(devices)
    assert [d.id for d in mesh.devices.flat] == [4, 5, 6, 7]
    assert ParallelConfig.from_mesh(mesh) == config
    assert config.describe() == "ring2 x ulysses2"
    assert config.sequence_degree == 4 and config.head_degree == 2


def test_device_mesh_is_built_once_and_passed_through():
    """``ParallelConfig.device_mesh`` pairs the mesh with the config it came from; ``DeviceMesh.of`` passes
    a DeviceMesh on as it is, reads a plain mesh's degrees, and lays a config on the first devices."""
    config = ParallelConfig(ring=2, ulysses=2)
    where = config.device_mesh(jax.devices()[:4])
    assert where.parallel is config and dict(where.mesh.shape) == config.degrees
    assert DeviceMesh.of(where) is where
    again = DeviceMesh.of(where.mesh)
    assert again.mesh is where.mesh and again.parallel == config
    assert DeviceMesh.of(config).parallel is config and DeviceMesh.of(config).mesh.devices.size == 4
    assert DeviceMesh.of(None).parallel == ParallelConfig()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(ulysses=0), "ulysses must be >= 1, got 0"),
        (dict(ring=-2), "ring must be >= 1, got -2"),
        (dict(cfg=4), "cfg degree must be 1 or 2"),
        (dict(tensor=2.0), "tensor must be an int"),
    ],
)
def test_bad_degrees(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ParallelConfig(**kwargs)


def test_product_must_equal_device_count():
    with pytest.raises(ValueError, match=r"multiply to 6 devices, but 8 devices are given.*ulysses=8"):
        ParallelConfig(ring=3, ulysses=2).make_mesh()
    with pytest.raises(ValueError, match=r"multiply to 8 devices, but 4 devices are given"):
        ParallelConfig(ulysses=8).make_mesh(jax.devices()[:4])


def test_heads_must_split_over_ulysses_times_tensor():
    ParallelConfig(ulysses=8).validate_model(num_heads=24)
    with pytest.raises(
        ValueError, match=r"24 heads cannot be split over ulysses=5 x tensor=1.*1, 2, 3, 4, 6, 8"
    ):
        ParallelConfig(ulysses=5).validate_model(num_heads=24)
    with pytest.raises(ValueError, match=r"40 heads cannot be split over ulysses=3 x tensor=2.*1, 2, 4, 5"):
        ParallelConfig(ulysses=3, tensor=2).validate_heads(40)


def test_distributed_arguments_from_environment(monkeypatch):
    monkeypatch.setenv("JAXDIT_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="JAXDIT_NUM_PROCESSES='two' is not an integer"):
        distributed.initialize()
    monkeypatch.setenv("JAXDIT_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAXDIT_PROCESS_ID", "5")
    with pytest.raises(ValueError, match=r"process_id=5 is outside 0..1"):
        distributed.initialize()
    monkeypatch.setenv("JAXDIT_PROCESS_ID", "1")
    with pytest.raises(ValueError, match="needs a coordinator address"):
        distributed.initialize()
