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

and, when neither gives a process count, to a launcher jax recognises by its variables (Slurm's
``srun``, Open MPI's ``mpirun``), as ``jax.distributed.initialize()`` without arguments would.

Start-up (:func:`join`). Every process first answers a roll call at the coordinator's address, before
jax's own service starts there: process 0 listens, the others connect and say who they are. Each says at
once what it waits for (the address, how many processes are missing, the timeout) and again every
``REPORT_EVERY_S`` seconds. When all have answered, process 0 sends "go", closes the port, and every
process calls ``jax.distributed.initialize``. A process that never comes ends the others with one line
naming the missing process ids (:class:`StartupError`); jax alone would wait out its timeout and abort
the process with a C++ stack trace that names nobody (measured on jax 0.10.2). The roll call also refuses
a process started with a different process count or an id already taken. Under a launcher the address
is jax's to find, so jax's own start-up runs alone.

``heartbeat_timeout_seconds`` bounds how long a process waits on a dead peer once running: after it, the
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
import dataclasses
import ipaddress
import json
import math
import os
import select
import socket
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

__all__ = [
    "ProcessGroup",
    "add_arguments",
    "StartupError",
    "fetch",
    "initialize",
    "is_main_process",
    "join",
    "key_value_store",
    "resolve",
    "shutdown",
]

_ENV = {
    "coordinator_address": "JAXDIT_COORDINATOR",
    "num_processes": "JAXDIT_NUM_PROCESSES",
    "process_id": "JAXDIT_PROCESS_ID",
    "local_device_ids": "JAXDIT_LOCAL_DEVICE_IDS",
}
#: Seconds between "still waiting" lines during the roll call.
REPORT_EVERY_S = 10.0
#: How often a process retries a coordinator that does not accept connections yet.
_RETRY_S = 0.2
#: The roll call's messages are one JSON line each, far below this.
_MAX_LINE = 4096


class StartupError(RuntimeError):
    """The processes could not all join: who is missing or what disagrees, in one line."""


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """Where and as whom this process joins. ``coordinator_address`` is None when a launcher's variables
    give it (jax then finds it); ``source`` says where the values came from, for messages."""

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    local_device_ids: tuple[int, ...] | None = None
    source: str = "arguments"

    def describe(self) -> str:
        if self.num_processes is None:
            return f"processes from {self.source}"
        return f"process {self.process_id} of {self.num_processes} ({self.source})"


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


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"coordinator address {address!r} must be HOST:PORT with a port in 1..65535")
    return host.strip("[]"), int(port)


def _launcher() -> str | None:
    """The name of a launcher jax recognises from its environment variables alone (Slurm, Open MPI)
    whose job has more than one process; None otherwise. Cloud TPU and Kubernetes detection query
    services, so they are left to an explicit ``jax.distributed.initialize()``."""
    try:
        from jax._src.clusters import OmpiCluster, SlurmCluster
    except ImportError:  # jax moved its cluster detection: fall back to explicit arguments
        return None
    for name, cluster in (("Slurm", SlurmCluster), ("Open MPI", OmpiCluster)):
        with contextlib.suppress(Exception):
            if cluster.is_env_present() and cluster.get_process_count() > 1:
                return name
    return None


def resolve(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: list[int] | None = None,
) -> ProcessGroup | None:
    """The process group from arguments, else ``JAXDIT_*`` variables, else a launcher's; None for a
    single process. Checks the values (no jax, no network): raises ValueError naming the problem."""
    given = (coordinator_address, num_processes, process_id, local_device_ids)
    coordinator_address = _from_env("coordinator_address", coordinator_address)
    num_processes = _from_env("num_processes", num_processes)
    process_id = _from_env("process_id", process_id)
    local_device_ids = _from_env("local_device_ids", local_device_ids)
    source = "arguments" if any(v is not None for v in given) else "JAXDIT_* environment variables"
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} is outside 0..{num_processes - 1}")
    if num_processes and num_processes > 1 and not coordinator_address:
        raise ValueError(
            f"num_processes={num_processes} needs a coordinator address (host:port), "
            f"by argument or {_ENV['coordinator_address']}"
        )
    if coordinator_address is not None:
        _split_address(coordinator_address)
    if num_processes is None and (coordinator_address is not None or process_id is not None):
        raise ValueError(
            f"a coordinator address or process id needs the process count: num_processes "
            f"(by argument or {_ENV['num_processes']})"
        )
    if num_processes is not None and num_processes > 1 and process_id is None:
        raise ValueError(
            f"num_processes={num_processes} needs this process's id (0..{num_processes - 1}), "
            f"by argument or {_ENV['process_id']}"
        )
    ids = tuple(local_device_ids) if local_device_ids is not None else None
    if num_processes is None or (num_processes == 1 and coordinator_address is None):
        launcher = _launcher()
        if launcher is None:
            return None
        return ProcessGroup(None, None, None, ids, source=f"{launcher} variables")
    return ProcessGroup(coordinator_address, num_processes, process_id or 0, ids, source=source)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------------
# The roll call
# --------------------------------------------------------------------------------------------------------


def _send(conn: socket.socket, **message) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(message).encode() + b"\n")


def _ids(ids) -> str:
    ids = sorted(ids)
    return ("process " if len(ids) == 1 else "processes ") + ", ".join(map(str, ids))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Lines:
    """Newline-delimited JSON messages from a socket, without blocking past a deadline."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.buffer = conn, b""

    def read(self, timeout: float) -> dict | None:
        """One message, {} on timeout, None when the peer closed (or sent garbage)."""
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([self.conn], [], [], max(timeout, 0.0))
            if not ready:
                return {}
            try:
                chunk = self.conn.recv(_MAX_LINE)
            except OSError:
                return None
            if not chunk or len(self.buffer) > _MAX_LINE:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except ValueError:
            return None
        return message if isinstance(message, dict) else None


def _lead_roll_call(
    group: ProcessGroup,
    timeout: float,
    say: Callable[[str], None],
    agreement: Mapping[str, Any] | None = None,
) -> None:
    """Process 0: listen at the coordinator's port until every other process has said who it is."""
    host, port = _split_address(group.coordinator_address)
    n = group.num_processes
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host if _is_loopback(host) else "", port))
    except OSError as e:
        listener.close()
        raise StartupError(f"process 0 cannot listen at {group.coordinator_address}: {e.strerror}") from None
    listener.listen(n)
    deadline = time.monotonic() + timeout
    say(
        f"process 0 of {n}: coordinator at {group.coordinator_address}; waiting for {n - 1} more "
        f"process(es) ({_ids(range(1, n))}), up to {timeout:g} s"
    )
    joined: dict[int, tuple[socket.socket, _Lines, str]] = {}
    pending: list[tuple[socket.socket, _Lines]] = []
    next_report = time.monotonic() + REPORT_EVERY_S
    try:
        while len(joined) < n - 1:
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(set(range(1, n)) - set(joined))
                reason = (
                    f"{_ids(missing)} of {n} never joined the coordinator at {group.coordinator_address} "
                    f"within {timeout:g} s"
                )
                for conn, _, _ in joined.values():
                    _send(conn, status="abort", reason=reason)
                raise StartupError(reason)
            if now >= next_report:
                missing = sorted(set(range(1, n)) - set(joined))
                say(f"process 0: still waiting for {_ids(missing)} ({deadline - now:.0f} s left)")
                next_report = now + REPORT_EVERY_S
            sockets = [listener] + [c for c, _ in pending]
            ready, _, _ = select.select(sockets, [], [], min(1.0, deadline - now))
            if listener in ready:
                conn, _ = listener.accept()
                pending.append((conn, _Lines(conn)))
            for conn, lines in list(pending):
                if conn not in ready:
                    continue
                pending.remove((conn, lines))
                message = lines.read(0.5)
                error = _admit(message, n, joined) or _disagreement(message, agreement)
                if error is not None:
                    fatal = message is not None and message.get("jaxdit_roll_call")
                    if fatal:  # a jaxdit process that disagrees: everyone stops (anything else: dropped)
                        for other in [conn] + [c for c, _, _ in joined.values()]:
                            _send(other, status="abort", reason=error)
                    conn.close()
                    if fatal:
                        raise StartupError(error)
                    continue
                pid = int(message["process_id"])
                joined[pid] = (conn, lines, f"{message.get('host')} pid {message.get('pid')}")
                missing = sorted(set(range(1, n)) - set(joined))
                for other, _, _ in joined.values():
                    _send(other, status="wait", missing=missing)
        for conn, _, _ in joined.values():
            _send(conn, status="go")
        # Let the others close first, so the port's TIME_WAIT stays on their side.
        for _conn, lines, _ in joined.values():
            lines.read(2.0)
        say(f"process 0: all {n} processes present")
    finally:
        for conn, _, _ in joined.values():
            conn.close()
        for conn, _ in pending:
            conn.close()
        listener.close()


def _admit(message: dict | None, n: int, joined: dict) -> str | None:
    """Why process 0 refuses a roll-call answer, or None to accept it."""
    if not message or not message.get("jaxdit_roll_call"):
        return "not a jaxdit process"
    pid, count = message.get("process_id"), message.get("num_processes")
    if count != n:
        return f"process {pid} was started with {count} processes, process 0 with {n}; start all with the same count"
    if not isinstance(pid, int) or not 1 <= pid < n:
        return f"process id {pid!r} is outside 1..{n - 1}"
    if pid in joined:
        return (
            f"process id {pid} was claimed twice (first by {joined[pid][2]}); give every process its own id"
        )
    return None


def _disagreement(message: dict, agreement: Mapping[str, Any] | None) -> str | None:
    """Why a process started with other settings than process 0 is refused (None: they agree). Every
    process must run the same request on the same mesh: one that differs would block in a collective
    at the first step, or compute something else, so the flags are compared before any device work."""
    theirs = message.get("agreement")
    if agreement is None or theirs is None:
        return None
    ours = json.loads(json.dumps(dict(agreement), default=str))  # as it travelled
    differ = [k for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]
    if not differ:
        return None
    pid = message.get("process_id")
    shown = ", ".join(f"--{k} ({theirs.get(k)!r} there, {ours.get(k)!r} on process 0)" for k in differ[:4])
    more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
    return f"process {pid} was started with other settings than process 0: {shown}{more}; start every process with the same flags"


def _follow_roll_call(
    group: ProcessGroup,
    timeout: float,
    say: Callable[[str], None],
    agreement: Mapping[str, Any] | None = None,
) -> None:
    """Processes 1..N-1: reach process 0 at the coordinator's address, say who we are, wait for "go"."""
    host, port = _split_address(group.coordinator_address)
    i, n = group.process_id, group.num_processes
    deadline = time.monotonic() + timeout
    say(
        f"process {i} of {n}: joining the coordinator (process 0) at {group.coordinator_address}, "
        f"waiting up to {timeout:g} s"
    )
    next_report = time.monotonic() + REPORT_EVERY_S
    missing: list[int] | None = None
    conn = None
    while True:
        now = time.monotonic()
        if now >= deadline:
            if missing is None:
                raise StartupError(
                    f"process 0 of {n} (the coordinator at {group.coordinator_address}) never came "
                    f"within {timeout:g} s"
                )
            raise StartupError(
                f"{_ids(missing)} of {n} never joined the coordinator at {group.coordinator_address} "
                f"within {timeout:g} s"
            )
        if now >= next_report:
            waiting_for = "process 0 (the coordinator)" if missing is None else _ids(missing)
            say(f"process {i}: still waiting for {waiting_for} ({deadline - now:.0f} s left)")
            next_report = now + REPORT_EVERY_S
        if conn is None:
            try:
                conn = socket.create_connection((host, port), timeout=min(2.0, deadline - now))
            except OSError:
                time.sleep(_RETRY_S)
                continue
            lines = _Lines(conn)
            hello = dict(jaxdit_roll_call=1, process_id=i, num_processes=n, pid=os.getpid())
            if agreement is not None:
                hello["agreement"] = json.loads(json.dumps(dict(agreement), default=str))
            _send(conn, host=socket.gethostname(), **hello)
        message = lines.read(min(1.0, deadline - time.monotonic()))
        if message is None:  # process 0 went away (or the port is not ours): start over
            conn.close()
            conn = None
            time.sleep(_RETRY_S)
            continue
        status = message.get("status")
        if status == "go":
            conn.close()
            return
        if status == "abort":
            conn.close()
            raise StartupError(str(message.get("reason")))
        if status == "wait":
            first, missing = missing is None, list(message.get("missing", []))
            if first:
                waiting = f"waiting for {_ids(missing)}" if missing else "all processes present"
                say(f"process {i}: process 0 answered; {waiting}")


# --------------------------------------------------------------------------------------------------------
# Joining
# --------------------------------------------------------------------------------------------------------


def join(
    group: ProcessGroup,
    *,
    initialization_timeout_seconds: float = 300,
    heartbeat_timeout_seconds: int = 60,
    say: Callable[[str], None] = _say,
    agreement: Mapping[str, Any] | None = None,
) -> None:
    """The roll call, then ``jax.distributed.initialize``; afterwards ``jax.devices()`` lists every
    process's devices. Raises :class:`StartupError` naming the missing processes after
    ``initialization_timeout_seconds``, or (``agreement``: the settings every process must share, flag
    name -> value) naming the flags a process was started with differently. Call before any other jax
    computation."""
    if not (math.isfinite(initialization_timeout_seconds) and initialization_timeout_seconds > 0):
        raise StartupError(
            f"--initialization_timeout must be a finite number of seconds > 0, got {initialization_timeout_seconds}"
        )
    if group.coordinator_address is not None and group.num_processes and group.num_processes > 1:
        if group.process_id == 0:
            _lead_roll_call(group, initialization_timeout_seconds, say, agreement)
        else:
            _follow_roll_call(group, initialization_timeout_seconds, say, agreement)
    # gloo is jax's default CPU collective library; set it explicitly so a CPU run never falls back
    # to a backend that cannot cross processes.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = dict(
        coordinator_address=group.coordinator_address,
        num_processes=group.num_processes,
        process_id=group.process_id,
        local_device_ids=list(group.local_device_ids) if group.local_device_ids is not None else None,
        initialization_timeout=max(1, round(initialization_timeout_seconds)),
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
    )
    if group.coordinator_address is not None:
        host, port = _split_address(group.coordinator_address)
        if _is_loopback(host):  # a loopback job stays on loopback (jax binds every interface by default)
            kwargs["coordinator_bind_address"] = group.coordinator_address
    jax.distributed.initialize(**kwargs)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: list[int] | None = None,
    *,
    heartbeat_timeout_seconds: int = 60,
    initialization_timeout_seconds: int = 300,
) -> None:
    """Join this process to the others (:func:`resolve`, then :func:`join`); afterwards ``jax.devices()``
    lists every process's devices. On CPU the cross-process collectives use gloo. Call before any other
    jax computation."""
    group = resolve(coordinator_address, num_processes, process_id, local_device_ids)
    if group is None:
        raise ValueError(
            "nothing to join: give num_processes > 1, a coordinator address and this process's id "
            f"(or {_ENV['num_processes']}, {_ENV['coordinator_address']}, {_ENV['process_id']}), "
            "or start under a launcher (srun, mpirun)"
        )
    join(
        group,
        initialization_timeout_seconds=initialization_timeout_seconds,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
    )


def shutdown() -> None:
    """Leave the process group (safe to call when not initialised)."""
    with contextlib.suppress(RuntimeError):
        jax.distributed.shutdown()


# --------------------------------------------------------------------------------------------------------
# Running across processes
# --------------------------------------------------------------------------------------------------------


def is_main_process() -> bool:
    """Process 0: the one that prints results and writes files."""
    return jax.process_index() == 0


def fetch(x: jax.Array) -> np.ndarray:
    """The whole value of ``x`` on this host, also when its shards live on several processes (then an
    all-gather across processes, as every process must call this)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def key_value_store():
    """The coordination service's key-value store (process 0 hosts it), for small host messages between
    processes: ``key_value_set(_bytes)``, ``blocking_key_value_get(_bytes)``, ``key_value_dir_get``,
    ``key_value_delete``. None in a single process. jax keeps its client in ``jax._src.distributed``
    (also what orbax and ``multihost_utils`` use); no public accessor exists in jax 0.10."""
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


# --------------------------------------------------------------------------------------------------------
# Command-line flags (jaxdit generate, jaxdit serve)
# --------------------------------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    """The flags that join several processes (``argparse``); each has an underscore and a hyphen spelling."""
    group = parser.add_argument_group(
        "several processes (hosts): start the same command on each, with its own --process_id"
    )

    def flag(name: str, **kwargs) -> None:
        spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        group.add_argument(*spellings, dest=name, **kwargs)

    flag("coordinator", default=None, help="HOST:PORT of process 0, reachable from every process "
         f"(or {_ENV['coordinator_address']})")  # fmt: skip
    flag("num_processes", type=int, default=None, help=f"how many processes (or {_ENV['num_processes']}; "
         "under srun / mpirun jax reads the launcher's variables)")  # fmt: skip
    flag("process_id", type=int, default=None, help=f"this process, 0..N-1; process 0 writes the output "
         f"(or {_ENV['process_id']})")  # fmt: skip
    flag("initialization_timeout", type=float, default=300.0, help="seconds to wait for every process to "
         "join before giving up and naming the missing ones (default 300)")  # fmt: skip
