"""Multi-process start-up: one process per host (or per GPU), all joined into one device mesh.

This wraps ``jax.distributed.initialize``: XLA's collectives (NCCL on GPUs, gloo on CPUs) carry the
data; nothing here is a transport of its own. Arguments fall back to environment variables so the same
script runs under a launcher:

==========================  ===================================
argument                    environment variable
==========================  ===================================
``coordinator_address``     ``JAXDIT_COORDINATOR`` (host:port)
``num_processes``           ``JAXDIT_NUM_PROCESSES``
``process_id``              ``JAXDIT_PROCESS_ID``
``local_device_ids``        ``JAXDIT_LOCAL_DEVICE_IDS`` (comma-separated)
==========================  ===================================

``heartbeat_timeout_seconds`` bounds how long a process waits on a dead peer: after it, the
coordination service reports the peer missing and the survivors exit with an error instead of hanging.

How a dead peer ends the others (jax 0.10.2 on CPU/gloo, measured; ``tests/test_multiprocess.py``):
every process's coordination-service client sends heartbeats to the service (hosted by process 0) and
polls it for errors. When a process stops heartbeating for ``heartbeat_timeout_seconds`` the service
sends the error to every task, and jax's client ends each survivor at once: a fatal log line
"Terminating process because the JAX distributed service detected fatal errors. This most likely
indicates that another task died ..." naming the unhealthy task, then SIGABRT (exit status -6/134).
If process 0 (the service) dies, the others lose their connection to it and end the same way:
immediately when its socket closes, otherwise (a frozen host) after the heartbeat timeout.

This is what bounds a survivor blocked inside a gloo collective: gloo did not notice that a peer's
sockets had closed while it waited in an all-reduce (still blocked 40 s later, with no error of its
own). A survivor whose collective raises a ``JaxRuntimeError`` and exits normally is bounded the same
way, by jax's shutdown barrier at exit. So no watchdog of ours is needed. Not covered: a peer that is
alive but stuck, whose client thread keeps heartbeating.
"""

from __future__ import annotations

import contextlib
import os

import jax

_ENV = {
    "coordinator_address": "JAXDIT_COORDINATOR",
    "num_processes": "JAXDIT_NUM_PROCESSES",
    "process_id": "JAXDIT_PROCESS_ID",
    "local_device_ids": "JAXDIT_LOCAL_DEVICE_IDS",
}


def _from_env(name: str, value):
    if value is not None:
        return value
    raw = os.environ.get(_ENV[name])
    if raw is None or raw == "":
        return None
    if name in ("num_processes", "process_id"):
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{_ENV[name]}={raw!r} is not an integer") from None
    if name == "local_device_ids":
        return [int(x) for x in raw.split(",") if x.strip()]
    return raw


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: list[int] | None = None,
    *,
    heartbeat_timeout_seconds: int = 60,
    initialization_timeout_seconds: int = 300,
) -> None:
    """Join this process to the others; afterwards ``jax.devices()`` lists every process's devices.

    On CPU the cross-process collectives use gloo. Call before any other jax computation.
    """
    coordinator_address = _from_env("coordinator_address", coordinator_address)
    num_processes = _from_env("num_processes", num_processes)
    process_id = _from_env("process_id", process_id)
    local_device_ids = _from_env("local_device_ids", local_device_ids)
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} is outside 0..{num_processes - 1}")
    if num_processes and num_processes > 1 and not coordinator_address:
        raise ValueError(
            f"num_processes={num_processes} needs a coordinator address (host:port), "
            f"by argument or {_ENV['coordinator_address']}"
        )
    # gloo is jax's default CPU collective library; set it explicitly so a CPU run never falls back
    # to a backend that cannot cross processes.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = dict(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=initialization_timeout_seconds,
    )
    jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_seconds, **kwargs)


def shutdown() -> None:
    """Leave the process group (safe to call when not initialised)."""
    with contextlib.suppress(RuntimeError):
        jax.distributed.shutdown()
