"""One process of a multi-process CPU job, started by ``tests/test_multiprocess.py``.

Usage::

    python tests/multiprocess_worker.py MODE --port P --process-id I --num-processes N --out DIR

Modes:

``usp``
    Joins the job (``jaxdit.distributed.initialize``, gloo collectives over loopback), builds global
    q/k/v from a seed with ``jax.make_array_from_callback``, runs sequence-parallel attention with
    ``ParallelConfig(ring=2, ulysses=4)`` over all processes' devices, gathers the output and, on
    process 0, writes it to ``DIR/usp_<order>.npy``. Two device orders are run: ``process_major``
    (``jax.devices()`` order: each Ulysses group inside one process, Ring crosses processes) and
    ``interleaved`` (devices alternate between processes, so Ulysses' all-to-alls cross them too).

``dead_peer``
    Joins the job; process ``--dead`` then leaves abruptly (``os._exit``) and the others enter a
    collective that needs it (with ``--warm`` after one collective together, so the gloo connections
    are up when the peer dies). The survivors must die with an error within about the heartbeat timeout.
    Each line the worker prints starts with a tag the test parses (``INITIALIZED``, ``WARM``,
    ``DYING <time>``, ``ENTERING <time>``, ``RETURNED``).

The device count is set in ``XLA_FLAGS`` here, before jax is imported (the test process itself runs
with 8 devices; each worker gets ``--local-devices``, default 4).
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

#: The inputs: two token groups whose lengths no sequence degree divides (FLUX's text + image).
BATCH = 2
LENGTHS = (13, 61)
HEADS = 8
HEAD_DIM = 16
SEED = 1234

#: Exit code of the worker that leaves on purpose in ``dead_peer`` mode.
DYING_EXIT_CODE = 17

#: The tiny-digits run the multi-process and serving tests compare with: this mesh (8 devices), this digit
#: and seed; `jaxdit generate` enlarges the 16x16 picture by 8 in its PNG.
MESH_FLAGS = ("--use_cfg_parallel", "--ring_degree", "2", "--ulysses_degree", "2")
DIGIT, DIGIT_SEED, PNG_SCALE = "7", 3, 8


@functools.cache
def generated_png(digit: str = DIGIT, seed: int = DIGIT_SEED) -> bytes:
    """The PNG `jaxdit generate` writes for ``digit`` and ``seed`` with :data:`MESH_FLAGS`, run in the calling
    process on its 8 devices (once per test session)."""
    from jaxdit import cli

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "digit.png"
        argv = ["generate", "--prompt", digit, "--seed", str(seed), "--output", str(path), *MESH_FLAGS]
        assert cli.main(argv) == 0
        return path.read_bytes()


def make_inputs(seed: int = SEED) -> tuple[tuple[np.ndarray, ...], ...]:
    """q, k, v: each a tuple of float32 token groups [BATCH, n, HEADS, HEAD_DIM]; identical everywhere."""
    rng = np.random.default_rng(seed)
    make = lambda n: rng.standard_normal((BATCH, n, HEADS, HEAD_DIM)).astype(np.float32)
    return tuple(tuple(make(n) for n in LENGTHS) for _ in range(3))


def _set_device_count(count: int) -> None:
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"


def _say(*parts) -> None:
    print(*parts, flush=True)


def _to_global(host: np.ndarray, sharding):
    """A global jax.Array from a host array every process holds whole: each device takes its slice."""
    import jax

    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _run_usp(args) -> None:
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdit.mesh import ParallelConfig
    from jaxdit.parallel.attention import parallel_attention

    devices = jax.devices()
    assert len(devices) == args.num_processes * args.local_devices, devices
    # Heads split over all devices: the inputs arrive in a layout the attention does not use, so the
    # compiled program also reshards across processes before attending.
    q, k, v = make_inputs(args.seed)
    per_process = [[d for d in devices if d.process_index == p] for p in range(args.num_processes)]
    orders = {
        "process_major": devices,
        "interleaved": [d for column in zip(*per_process, strict=True) for d in column],
    }
    for name, order in orders.items():
        mesh = ParallelConfig(ring=2, ulysses=4).make_mesh(order)
        sharding = NamedSharding(mesh, P(None, None, ("ring", "ulysses"), None))
        qs, ks, vs = (tuple(_to_global(g, sharding) for g in groups) for groups in (q, k, v))
        out = jax.jit(lambda q, k, v, mesh=mesh: parallel_attention(q, k, v, mesh))(qs, ks, vs)
        full = [np.asarray(multihost_utils.process_allgather(o, tiled=True)) for o in out]
        result = np.concatenate(full, axis=1)
        if jax.process_index() == 0:
            np.save(os.path.join(args.out, f"usp_{name}.npy"), result)
        _say("DONE", name, result.shape)


def _run_dead_peer(args) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdit.mesh import ParallelConfig

    _say("INITIALIZED", jax.process_index())
    # A global sum: every process's shard is needed, so this all-reduce waits on the dead peer.
    mesh = ParallelConfig(ulysses=len(jax.devices())).make_mesh()
    n = len(jax.devices())
    x = _to_global(np.ones((n, 4), np.float32), NamedSharding(mesh, P("ulysses")))
    global_sum = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    if args.warm:
        # Mid-run death: the gloo connections are up when the peer goes.
        _say("WARM", float(global_sum(x)))
    # Both processes past start-up before one dies (on a loaded machine the survivor could otherwise still
    # be creating its CPU backend, which reads the coordinator's key-value store, when the peer went).
    from jaxdit.distributed import key_value_store

    key_value_store().wait_at_barrier("jaxdit_test_ready", 60_000)
    # The barrier's reply to the survivor can still be in flight when a dying coordinator leaves it (and
    # so can the reply to any later message to the coordinator): the survivor says it is past the barrier
    # through a file, which needs no reply, and the dying process waits for that file.
    ready = os.path.join(args.out, "survivor_past_barrier")
    if jax.process_index() == args.dead:
        deadline = time.monotonic() + 60
        while not os.path.exists(ready) and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        with open(ready, "w"):
            pass
    if jax.process_index() == args.dead:
        if args.warm:
            time.sleep(0.5)  # let the survivor finish reading the warm-up sum
        _say("DYING", repr(time.time()))
        os._exit(DYING_EXIT_CODE)
    _say("ENTERING", repr(time.time()))
    total = global_sum(x)
    _say("RETURNED", float(total))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("usp", "dead_peer"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--local-devices", type=int, default=4)
    parser.add_argument("--out", default=".")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--dead", type=int, default=1, help="dead_peer: the process that leaves")
    parser.add_argument("--warm", action="store_true", help="dead_peer: one collective before the death")
    parser.add_argument("--heartbeat", type=int, default=60, help="heartbeat timeout, seconds")
    args = parser.parse_args(argv)

    _set_device_count(args.local_devices)
    # A survivor that loses its peer is ended by SIGABRT; no core file for that.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    from jaxdit import distributed

    distributed.initialize(
        f"127.0.0.1:{args.port}",
        args.num_processes,
        args.process_id,
        heartbeat_timeout_seconds=args.heartbeat,
        initialization_timeout_seconds=60,
    )
    if args.mode == "usp":
        _run_usp(args)
    else:
        _run_dead_peer(args)
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
