"""Multi-process runs on loopback: 2 worker processes x 4 CPU devices joined by ``jax.distributed``.

* USP attention (ring 2 x ulysses 4) over the 8 devices of two processes equals the same computation
  on this process's 8 local devices and plain attention (fp32, tests/tolerance.py SHARDED).
* A dead peer: when one process dies right after start-up, the survivor, blocked in a collective that
  needs it, is terminated with an error within about the heartbeat timeout instead of hanging.

The workers are ``tests/multiprocess_worker.py``; each sets its own device count before importing jax.
Every worker is killed when a test ends, whatever happened.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol

from jaxdit.mesh import ParallelConfig
from jaxdit.parallel.attention import parallel_attention
from jaxdit.parallel.local_attention import reference_attention

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("multiprocess_worker.py")
REPO = WORKER.parent.parent
HEARTBEAT_S = 5
#: The survivor must be gone this long after its peer died (heartbeat timeout plus generous slack).
DETECTION_BOUND_S = 30
#: Hard limit on any worker; past it the test kills everything and fails.
WORKER_TIMEOUT_S = 120


def _load_worker_module():
    spec = importlib.util.spec_from_file_location("multiprocess_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _load_worker_module()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    # This process runs with 8 devices (conftest); the worker sets its own count before importing jax.
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    # gRPC (the coordination service) would send even loopback traffic through a proxy.
    for key in [k for k in env if k.lower().endswith("_proxy")]:
        del env[key]
    return env


class Worker:
    def __init__(self, proc: subprocess.Popen, stdout: Path, stderr: Path):
        self.proc, self._stdout, self._stderr = proc, stdout, stderr
        self.exit_time: float | None = None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    @property
    def stdout(self) -> str:
        return self._stdout.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self._stderr.read_text(errors="replace")

    def describe(self) -> str:
        tail = lambda text: "\n".join(text.splitlines()[-25:])
        return (
            f"returncode {self.returncode}\n--- stdout\n{tail(self.stdout)}\n--- stderr\n{tail(self.stderr)}"
        )


def _run_workers(
    tmp_path: Path, mode: str, num_processes: int = 2, extra=(), fail_fast: bool = True
) -> list[Worker]:
    """Start the workers, wait for all of them (at most WORKER_TIMEOUT_S), kill any left over.

    With ``fail_fast`` the others are killed as soon as one worker fails (instead of waiting for
    their start-up or heartbeat timeouts).
    """
    port = _free_port()
    env = _worker_env()
    workers = []
    try:
        for pid in range(num_processes):
            out, err = tmp_path / f"worker{pid}.out", tmp_path / f"worker{pid}.err"
            cmd = [sys.executable, str(WORKER), mode, "--port", str(port), "--process-id", str(pid)]
            cmd += ["--num-processes", str(num_processes), "--out", str(tmp_path), *extra]
            with open(out, "wb") as fo, open(err, "wb") as fe:
                proc = subprocess.Popen(
                    cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env=env, cwd=tmp_path
                )
            workers.append(Worker(proc, out, err))
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while time.monotonic() < deadline:
            for w in workers:
                if w.exit_time is None and w.proc.poll() is not None:
                    w.exit_time = time.time()
            if all(w.exit_time is not None for w in workers):
                break
            if fail_fast and any(w.returncode not in (None, 0) for w in workers):
                break
            time.sleep(0.05)
        else:
            report = "\n".join(f"=== worker {i}: {w.describe()}" for i, w in enumerate(workers))
            pytest.fail(f"workers still running after {WORKER_TIMEOUT_S} s (killed)\n{report}")
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
            w.proc.wait()
    return workers


def test_usp_across_two_processes_matches_single_process(tmp_path):
    workers = _run_workers(tmp_path, "usp")
    for i, w in enumerate(workers):
        assert w.returncode == 0, f"worker {i} failed: {w.describe()}"

    q, k, v = worker.make_inputs()
    mesh = ParallelConfig(ring=2, ulysses=4).make_mesh()
    assert len(mesh.devices.flat) == 8
    local = jax.jit(lambda q, k, v: parallel_attention(q, k, v, mesh))(q, k, v)
    local = np.concatenate([np.asarray(o) for o in local], axis=1)
    cat = lambda groups: jnp.concatenate(groups, axis=1)
    ref = np.asarray(reference_attention(cat(q), cat(k), cat(v)))
    tol.check(local, ref, tol.SHARDED, "1 process, ring2 x ulysses4 vs reference attention")

    for order in ("process_major", "interleaved"):
        multi = np.load(tmp_path / f"usp_{order}.npy")
        assert multi.shape == (worker.BATCH, sum(worker.LENGTHS), worker.HEADS, worker.HEAD_DIM)
        tol.check(multi, local, tol.SHARDED, f"{order}: 2 processes vs 1 process")
        tol.check(multi, ref, tol.SHARDED, f"{order}: 2 processes vs reference attention")


def _tagged(text: str, tag: str) -> list[str]:
    """The rest of each line of ``text`` that starts with the word ``tag``."""
    return [line[len(tag) :].strip() for line in text.splitlines() if line.split(" ", 1)[0] == tag]


DEAD_PEER_CASES = {
    # The survivor hosts the coordination service, which stops receiving the dead process's heartbeats
    # and, after the heartbeat timeout, sends every task the error (the survivor's first cross-process
    # collective is still waiting to set up its gloo connections with the dead peer).
    "worker_dies": dict(dead=1, warm=False),
    # The survivor's connection to the coordination service breaks at once.
    "coordinator_dies": dict(dead=0, warm=False),
    # Mid-run: the gloo connections are up and the survivor is already blocked in the all-reduce when its
    # peer dies. gloo does not notice the closed sockets there (measured: still blocked 40 s later with a
    # 40 s heartbeat timeout); the heartbeat timeout ends it. (Had the survivor entered after the death,
    # gloo would raise a JaxRuntimeError at once, and jax's shutdown barrier at exit would abort the
    # process at the heartbeat timeout.)
    "worker_dies_mid_run": dict(dead=1, warm=True),
}


@pytest.mark.parametrize("case", list(DEAD_PEER_CASES))
def test_dead_peer_ends_survivor_with_error(tmp_path, case):
    """One process exits abruptly (``os._exit``) after start-up while the other enters an all-reduce
    that needs it: the survivor must end with an error, not hang."""
    dead, warm = DEAD_PEER_CASES[case]["dead"], DEAD_PEER_CASES[case]["warm"]
    extra = ["--dead", str(dead), "--heartbeat", str(HEARTBEAT_S)] + (["--warm"] if warm else [])
    workers = _run_workers(tmp_path, "dead_peer", extra=extra, fail_fast=False)
    dying, survivor = workers[dead], workers[1 - dead]

    assert dying.returncode == worker.DYING_EXIT_CODE, f"dying worker: {dying.describe()}"
    if warm:
        assert _tagged(survivor.stdout, "WARM") == ["32.0"], survivor.describe()
    died_at = float(_tagged(dying.stdout, "DYING")[0])
    assert _tagged(survivor.stdout, "ENTERING"), (
        f"survivor never reached the collective: {survivor.describe()}"
    )
    assert not _tagged(survivor.stdout, "RETURNED"), (
        f"collective returned without its peer: {survivor.describe()}"
    )

    assert survivor.returncode != 0, f"survivor exited cleanly: {survivor.describe()}"
    detection_s = survivor.exit_time - died_at
    assert detection_s < DETECTION_BOUND_S, (
        f"survivor took {detection_s:.1f} s to exit: {survivor.describe()}"
    )
    stderr = survivor.stderr
    assert "Terminating process because the JAX distributed service detected fatal errors" in stderr, (
        survivor.describe()
    )
    assert re.search(r"another task died|heartbeat|unhealthy|UNAVAILABLE", stderr), survivor.describe()
    print(f"{case}: survivor rc {survivor.returncode}, exited {detection_s:.2f} s after its peer died")
