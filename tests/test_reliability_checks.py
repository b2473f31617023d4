"""The weight checks themselves (converters/checks.py): the checksum is the same on every path (host or
device, any sharding, restored wider than stored), catches any change to one element and moved values;
the finiteness check finds NaN and inf on both paths; dtype rules; restoring with and without checksums.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from converters import checks, orbax_io
from converters.errors import CheckpointError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["host", "device"])
def path(request, monkeypatch):
    """Run a test on the host path (numpy) and on the device path (jitted, per shard)."""
    monkeypatch.setattr(checks, "HOST_CHECK_MAX_BYTES", 1 << 30 if request.param == "host" else 0)
    return request.param


def _random(shape, dtype, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).astype(dtype)


DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16, ml_dtypes.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (7,), (5, 12), (3, 4, 6)], ids=str)
def test_host_and_device_checksums_agree(shape, dtype, monkeypatch):
    x = jnp.asarray(_random(shape, dtype))
    sums = {}
    for name, limit in (("host", 1 << 30), ("device", 0)):
        monkeypatch.setattr(checks, "HOST_CHECK_MAX_BYTES", limit)
        sums[name] = checks.checksum(x, dtype)
    assert sums["host"] == sums["device"]


@pytest.mark.parametrize(
    "spec",
    [
        PartitionSpec(),
        PartitionSpec("a"),
        PartitionSpec(None, "b"),
        PartitionSpec("a", "b"),
        PartitionSpec("b", "a"),
    ],
    ids=str,
)
def test_checksum_does_not_depend_on_sharding(spec, path):
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    value = _random((8, 12), ml_dtypes.bfloat16)
    want = checks.checksum(jax.device_put(value, jax.devices()[0]), ml_dtypes.bfloat16)
    assert checks.checksum(jax.device_put(value, NamedSharding(mesh, spec)), ml_dtypes.bfloat16) == want


def test_checksum_of_a_widened_array_is_the_stored_ones(path):
    stored = _random((6, 10), ml_dtypes.bfloat16)
    assert checks.checksum(jnp.asarray(stored).astype(jnp.float32), ml_dtypes.bfloat16) == checks.checksum(
        jnp.asarray(stored), ml_dtypes.bfloat16
    )


def test_any_change_to_one_element_and_any_swap_changes_the_checksum(path):
    x = _random((4, 16), np.float16)
    base = checks.checksum(jnp.asarray(x), np.float16)
    bits = x.view(np.uint16)
    for element in (0, 17, 63):
        for bit in range(16):
            flipped = bits.copy()
            flipped.flat[element] ^= np.uint16(1 << bit)
            assert checks.checksum(jnp.asarray(flipped.view(np.float16)), np.float16) != base, (element, bit)
    swapped = x.copy()
    swapped[0, [3, 9]] = swapped[0, [9, 3]]
    assert checks.checksum(jnp.asarray(swapped), np.float16) != base
    rows = x[[1, 0, 2, 3]]
    assert checks.checksum(jnp.asarray(rows), np.float16) != base


@pytest.mark.parametrize(
    "dtype", [np.float32, ml_dtypes.bfloat16, np.float16], ids=lambda d: np.dtype(d).name
)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_finiteness_found_on_both_paths(bad, dtype, path):
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    good = _random((8, 12), dtype)
    good[0, 0] = ml_dtypes.finfo(dtype).max  # the largest finite value is finite
    good[0, 1] = -ml_dtypes.finfo(dtype).max
    broken = good.copy()
    broken[7, 11] = bad
    arrays = {
        "good": jax.device_put(good, NamedSharding(mesh, PartitionSpec("a", "b"))),
        "broken": jax.device_put(broken, NamedSharding(mesh, PartitionSpec(None, "b"))),
    }
    finite, _ = checks.scan(arrays)
    assert finite == {"good": True, "broken": False}
    with pytest.raises(
        CheckpointError,
        match=r"(?s)1 parameter\(s\).*broken \(\w+\): 1 (NaN|inf) of 96 values, in layer\(s\) 7",
    ):
        checks.raise_if_nonfinite(arrays, finite, "ckpt")


@pytest.mark.parametrize(
    ("dtype", "floating"),
    [
        (np.float32, True),
        (ml_dtypes.bfloat16, True),
        (ml_dtypes.float8_e4m3fn, True),
        (np.float64, True),
        (np.int32, False),
        (np.uint8, False),
        (np.bool_, False),
        (np.complex64, False),
    ],
    ids=str,
)
def test_is_floating(dtype, floating):
    assert checks.is_floating(dtype) is floating


@pytest.mark.parametrize(
    "dtype", [None, "float32", "bfloat16", "float16", jnp.bfloat16, np.float32, jnp.dtype("float16")]
)
def test_compute_dtypes_accepted(dtype):
    checks.check_compute_dtype(dtype)


@pytest.mark.parametrize(
    ("stored", "target", "exact"),
    [
        ("bfloat16", "float32", True),
        ("float16", "float32", True),
        ("float8_e4m3fn", "bfloat16", True),
        ("float32", "bfloat16", False),
        ("float16", "bfloat16", False),
        ("bfloat16", "float16", False),
        ("float32", "float32", True),
    ],
)
def test_exact_widening(stored, target, exact):
    assert checks.is_exact_widening(jnp.dtype(stored), jnp.dtype(target)) is exact


def _target(arrays, dtype=None):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return {k: jax.ShapeDtypeStruct(v.shape, dtype or v.dtype, sharding=device) for k, v in arrays.items()}


def test_restore_narrower_than_stored_is_verified_then_cast(tmp_path):
    params = {
        "w": jnp.asarray(_random((64, 64), np.float32)),
        "b": jnp.asarray(_random((64,), np.float32, 1)),
    }
    ckpt = orbax_io.save(tmp_path / "ckpt", params, {"family": "flux", "dtype": "float32", "config": {}})
    restored = orbax_io.restore(ckpt, _target(params, jnp.bfloat16))
    assert restored["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(params["w"].astype(jnp.bfloat16)))
    meta = json.loads((ckpt / "jaxdit.json").read_text())
    meta["arrays"]["w"]["checksum"] = "00000000"
    (ckpt / "jaxdit.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"'w' \(recorded 00000000"):
        orbax_io.restore(ckpt, _target(params, jnp.bfloat16))


def test_checkpoint_without_checksums_loads_with_a_warning(tmp_path):
    params = {"w": jnp.asarray(_random((16, 16), np.float32))}
    ckpt = orbax_io.save(tmp_path / "ckpt", params, {"family": "flux", "dtype": "float32", "config": {}})
    meta = json.loads((ckpt / "jaxdit.json").read_text())
    del meta["arrays"], meta["checksum"]  # as jaxdit wrote them before checksums
    (ckpt / "jaxdit.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="without per-array checksums"):
        restored = orbax_io.restore(ckpt, _target(params))
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(params["w"]))


# A 2-process job (4 CPU devices each): arrays sharded across both processes, so neither holds all of
# any of them. Process 0 writes what scan() found on each path.
_TWO_PROCESS_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    from jaxdit.distributed import initialize
    initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from converters import checks
    sys.path.insert(0, sys.argv[4])
    from test_reliability_checks import two_process_arrays
    mesh = jax.make_mesh((2, 4), ("a", "b"), devices=jax.devices())
    arrays = {
        name: jax.make_array_from_callback(v.shape, NamedSharding(mesh, spec), lambda i, v=v: v[i])
        for name, (v, spec) in two_process_arrays().items()
    }
    results = {}
    for path, limit in (("host", 1 << 30), ("device", 0)):
        checks.HOST_CHECK_MAX_BYTES = limit
        finite, sums = checks.scan(arrays, {n: a.dtype for n, a in arrays.items()})
        results[path] = {"finite": finite, "sums": sums}
    if jax.process_index() == 0:
        with open(sys.argv[3], "w") as f:
            json.dump(results, f)
    """
)


def two_process_arrays() -> dict:
    """Arrays and their specs over a ("a", "b") = (2, 4) mesh: across processes, within, replicated."""
    stacked = _random((4, 8, 12), ml_dtypes.bfloat16)
    broken = _random((8, 12), np.float32)
    broken[6, 1] = np.nan
    return {
        "stacked": (stacked, PartitionSpec("a", None, "b")),
        "rows": (_random((8, 12), np.float16, 1), PartitionSpec("a")),
        "replicated": (_random((5,), np.float32, 2), PartitionSpec()),
        "broken": (broken, PartitionSpec(("a", "b"))),
    }


@pytest.mark.slow
def test_checks_agree_across_two_processes(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "results.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    tests = str(Path(__file__).parent)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TWO_PROCESS_SCRIPT, f"127.0.0.1:{port}", str(i), str(out), tests],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    results = json.loads(out.read_text())
    want_sums = {n: checks.checksum(jnp.asarray(v), v.dtype) for n, (v, _) in two_process_arrays().items()}
    want_finite = {n: n != "broken" for n in want_sums}
    for path in ("host", "device"):
        assert results[path] == {"finite": want_finite, "sums": want_sums}, path
