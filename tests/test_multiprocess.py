"""Multi-process runs on loopback: 2 worker processes x 4 CPU devices joined by ``jax.distributed``.

* USP attention (ring 2 x ulysses 4) over the 8 devices of two processes equals the same computation
  on this process's 8 local devices and plain attention (fp32, tests/tolerance.py SHARDED).
* A dead peer: when one process dies right after start-up, the survivor, blocked in a collective that
  needs it, is terminated with an error within about the heartbeat timeout instead of hanging.
* ``jaxdit generate`` across 2 processes x 4 devices writes (from process 0 only) the same tiny-digits
  PNG, byte for byte, as 1 process x 8 devices.
* A process that never comes: the others say at once what they wait for, and end within the
  initialization timeout with one line naming the missing process ids (no C++ stack).
* ``jaxdit serve`` across 2 processes: process 0 serves HTTP, process 1 follows every request and every
  step's go/stop; answers equal `jaxdit generate`'s; a client that disconnects mid-request stops both
  processes after the same step; SIGTERM ends both cleanly.

The workers are ``tests/multiprocess_worker.py`` or the ``jaxdit`` command; each sets its own device
count before importing jax. Every worker is killed when a test ends, whatever happened.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import jax
import jax.numpy as jnp
import multiprocess_worker as worker
import numpy as np
import pytest
import tolerance as tol
from PIL import Image

from jaxdit import distributed
from jaxdit.mesh import ParallelConfig
from jaxdit.parallel.attention import parallel_attention
from jaxdit.parallel.local_attention import reference_attention

pytestmark = pytest.mark.slow

WORKER = Path(worker.__file__).resolve()
REPO = WORKER.parent.parent
HEARTBEAT_S = 5
#: The survivor must be gone this long after its peer died (heartbeat timeout plus generous slack).
DETECTION_BOUND_S = 30
#: Hard limit on any worker; past it the test kills everything and fails.
WORKER_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    # This process runs with 8 devices (conftest); the worker sets its own count before importing jax.
    env["XLA_FLAGS"] = re.sub(
        r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")
    ).strip()  # XLA reads a value that does not start with "--" as a file name
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


# --------------------------------------------------------------------------------------------------------
# jaxdit generate / jaxdit serve across processes
# --------------------------------------------------------------------------------------------------------

#: Start-up of a `jaxdit` process here: imports, then compiling the tiny model's programs with gloo.
COMMAND_TIMEOUT_S = 300
#: A missing peer: how long the others wait, the slack allowed past it to say so, and to have exited.
INIT_TIMEOUT_S, INIT_SLACK_S, EXIT_SLACK_S = 4, 2, 15


def _start(cmd: list[str], cwd: Path, name: str) -> Worker:
    cwd.mkdir(parents=True, exist_ok=True)
    out, err = cwd / f"{name}.out", cwd / f"{name}.err"
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen(
            cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env=_worker_env(), cwd=cwd
        )
    return Worker(proc, out, err)


def _jaxdit(command: str, port: int, pid: int, num_processes: int, *flags: str) -> list[str]:
    processes = ["--coordinator", f"127.0.0.1:{port}", "--num_processes", str(num_processes)]
    return [sys.executable, "-m", "jaxdit.cli", command, *flags, *processes, "--process_id", str(pid)]


def _wait(workers: list[Worker], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        while any(w.proc.poll() is None for w in workers):
            for w in workers:
                if w.exit_time is None and w.proc.poll() is not None:
                    w.exit_time = time.time()
            if time.monotonic() > deadline:
                report = "\n".join(f"=== {i}: {w.describe()}" for i, w in enumerate(workers))
                pytest.fail(f"still running after {timeout} s (killed)\n{report}")
            time.sleep(0.05)
        for w in workers:
            w.exit_time = w.exit_time or time.time()
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
            w.proc.wait()


def test_generate_across_two_processes_writes_the_one_process_png(tmp_path):
    port = _free_port()
    flags = ["--emulate_devices", "4", *worker.MESH_FLAGS, "--prompt", worker.DIGIT]
    flags += ["--seed", str(worker.DIGIT_SEED), "--output", "digit.png"]
    # Each process in a folder of its own, with the same relative --output: only process 0 may write.
    workers = [_start(_jaxdit("generate", port, i, 2, *flags), tmp_path / f"p{i}", "log") for i in (0, 1)]
    _wait(workers, COMMAND_TIMEOUT_S)
    for i, w in enumerate(workers):
        assert w.returncode == 0, f"process {i}: {w.describe()}"
    assert not (tmp_path / "p1" / "digit.png").exists(), "process 1 wrote the output too"
    assert "wrote" not in workers[1].stdout
    multi = (tmp_path / "p0" / "digit.png").read_bytes()
    assert multi == worker.generated_png(), "2 processes x 4 devices and 1 x 8 wrote different PNGs"


def test_a_missing_process_is_named_within_the_initialization_timeout(tmp_path):
    """Three processes expected, two started (2 never comes); and one process whose coordinator never comes."""
    common = ["--emulate_devices", "4", "--prompt", "7", "--output", "digit.png"]
    common += ["--initialization_timeout", str(INIT_TIMEOUT_S), "--ulysses_degree", "4"]
    three, alone = _free_port(), _free_port()
    flags = [*common, "--ring_degree", "3"]  # 3 processes x 4 devices
    workers = [_start(_jaxdit("generate", three, i, 3, *flags), tmp_path / f"p{i}", "log") for i in (0, 1)]
    flags = [*common, "--ring_degree", "2"]  # 2 processes x 4 devices
    workers.append(_start(_jaxdit("generate", alone, 1, 2, *flags), tmp_path / "alone", "log"))
    waiting_since, gave_up_at = {}, {}  # when each process said it waits, and when it said who is missing
    deadline = time.monotonic() + COMMAND_TIMEOUT_S
    while any(w.proc.poll() is None for w in workers) and time.monotonic() < deadline:
        for i, w in enumerate(workers):
            text = w.stderr
            if i not in waiting_since and "waiting" in text:
                waiting_since[i] = time.time()
            if i not in gave_up_at and "error:" in text:
                gave_up_at[i] = time.time()
        time.sleep(0.02)
    _wait(workers, 5)

    address = f"127.0.0.1:{three}"
    first_lines = [w.stderr.splitlines()[0] for w in workers]
    assert first_lines[0] == (
        f"process 0 of 3: coordinator at {address}; waiting for 2 more process(es) (processes 1, 2), up to "
        f"{INIT_TIMEOUT_S} s"
    ), first_lines
    assert first_lines[1].startswith(f"process 1 of 3: joining the coordinator (process 0) at {address}")
    expected = {
        0: f"jaxdit generate: error: process 2 of 3 never joined the coordinator at {address} within {INIT_TIMEOUT_S} s",
        1: f"jaxdit generate: error: process 2 of 3 never joined the coordinator at {address} within {INIT_TIMEOUT_S} s",
        2: f"jaxdit generate: error: process 0 of 2 (the coordinator at 127.0.0.1:{alone}) never came within "
        f"{INIT_TIMEOUT_S} s",
    }
    for i, w in enumerate(workers):
        assert w.returncode == 2, w.describe()
        assert w.stderr.strip().splitlines()[-1] == expected[i], w.describe()
        assert "stack trace" not in w.stderr and "Terminating process" not in w.stderr, w.describe()
        waited = gave_up_at[i] - waiting_since[i]
        assert waited < INIT_TIMEOUT_S + INIT_SLACK_S, (
            f"process {i} gave up {waited:.1f} s after it began waiting"
        )
        # Leaving takes a moment more (the interpreter's teardown with jax loaded: 1.7 s here unloaded).
        assert w.exit_time - waiting_since[i] < INIT_TIMEOUT_S + EXIT_SLACK_S, w.describe()
    assert not list(tmp_path.rglob("*.png")), "a process that never started wrote something"


def _http(url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _metric(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    label_text = "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else ""
    match = re.search(rf"^{re.escape(name + label_text)} (\S+)$", text, re.MULTILINE)
    return float(match[1]) if match else 0.0


def _pixels(answer: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(answer["data"][0]["b64_json"]))))


def _healthy(workers: list[Worker], url: str) -> tuple[int, dict]:
    """The first /healthz answer of a starting server (every worker must stay alive meanwhile)."""
    deadline = time.monotonic() + COMMAND_TIMEOUT_S
    while True:
        assert all(w.proc.poll() is None for w in workers), "\n".join(w.describe() for w in workers)
        assert time.monotonic() < deadline, "the server never became healthy"
        try:
            return _http(url + "/healthz", timeout=5)
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)


def test_serve_across_two_processes(tmp_path):
    port, http_port = _free_port(), _free_port()
    flags = ["--emulate_devices", "4", *worker.MESH_FLAGS, "--port", str(http_port)]
    flags += ["--log_level", "warning"]
    workers = [_start(_jaxdit("serve", port, i, 2, *flags), tmp_path, f"p{i}") for i in (0, 1)]
    url = f"http://127.0.0.1:{http_port}"
    try:
        code, health = _healthy(workers, url)
        assert code == 200 and health["processes"] == 2 and health["devices"] == 8, health

        big = np.asarray(Image.open(io.BytesIO(worker.generated_png())))
        reference = big[:: worker.PNG_SCALE, :: worker.PNG_SCALE]
        answers = {}
        asks = {
            "a": {"prompt": worker.DIGIT, "seed": worker.DIGIT_SEED},
            "b": {"prompt": "2", "seed": 5},
            "c": {"prompt": worker.DIGIT, "seed": worker.DIGIT_SEED},
        }
        ask = lambda k: answers.__setitem__(k, _http(url + "/v1/images/generations", asks[k]))
        threads = [threading.Thread(target=ask, args=(k,)) for k in asks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(COMMAND_TIMEOUT_S)
        for k in asks:
            assert answers[k][0] == 200, answers[k]
        assert (_pixels(answers["a"][1]) == reference).all() and (_pixels(answers["c"][1]) == reference).all()
        assert _pixels(answers["b"][1]).shape == (16, 16)

        # A client that leaves mid-request: process 0 decides "stop" after some step and process 1 stops
        # after the same one (else the next request would hang in a collective). 63 steps: the longest
        # request of the program compiled at start-up (1-63 steps).
        steps_before = _metric(url, "jaxdit_step_seconds_count")
        body = json.dumps({"prompt": "3", "steps": 63}).encode()
        with socket.create_connection(("127.0.0.1", http_port)) as conn:
            conn.sendall(
                b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            time.sleep(0.3)
        deadline = time.monotonic() + 60
        while _metric(url, "jaxdit_requests_total", kind="image", outcome="disconnected") < 1:
            assert time.monotonic() < deadline, "the disconnect was never noticed"
            time.sleep(0.05)
        ran = _metric(url, "jaxdit_step_seconds_count") - steps_before + 1  # the first step is not timed
        assert ran < 63, f"{ran} of 63 steps ran: the disconnected request was not stopped"
        assert _http(url + "/v1/images/generations", {"prompt": "5"})[0] == 200  # both processes moved on
        assert _http(url + "/v1/images/generations", {"prompt": "5", "size": "32x32"})[0] == 400

        workers[0].proc.send_signal(signal.SIGTERM)
        _wait(workers, 60)
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
    for i, w in enumerate(workers):
        assert w.returncode == 0, f"process {i}: {w.describe()}"
    assert "process 1: process 0 stopped after 5 request(s)" in workers[1].stderr, workers[1].describe()


def test_a_dead_follower_is_reported_and_the_leader_still_exits_on_sigterm(tmp_path):
    """Before: a killed follower went unnoticed (requests then failed with a raw Gloo message), and SIGTERM
    to process 0 printed "stopped" but it did not exit until jax's heartbeat timeout killed it with a C++
    stack. Now /healthz and requests answer 503 naming process 1, and process 0 leaves at once."""
    port, http_port = _free_port(), _free_port()
    flags = [
        "--emulate_devices",
        "1",
        "--ulysses_degree",
        "2",
        "--port",
        str(http_port),
        "--log_level",
        "warning",
    ]
    workers = [_start(_jaxdit("serve", port, i, 2, *flags), tmp_path, f"p{i}") for i in (0, 1)]
    url = f"http://127.0.0.1:{http_port}"
    try:
        code, health = _healthy(workers, url)
        assert code == 200 and health["lost_processes"] == [], health
        workers[1].proc.kill()
        deadline = time.monotonic() + 30
        while (health := _http(url + "/healthz", timeout=5))[0] != 503:
            assert time.monotonic() < deadline, f"the dead follower was never reported: {health}"
            time.sleep(0.2)
        assert health[1]["status"] == "process_lost" and health[1]["lost_processes"] == [1], health
        code, answer = _http(url + "/v1/images/generations", {"prompt": "7"})
        assert code == 503 and "process(es) 1 of this server stopped answering" in answer["error"]["message"]
        stopped = time.monotonic()
        workers[0].proc.send_signal(signal.SIGTERM)
        _wait(workers[:1], 30)
        assert time.monotonic() - stopped < 15, workers[0].describe()
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
    assert workers[0].returncode == 0, workers[0].describe()
    assert workers[0].stderr.strip().splitlines()[-1] == (
        "jaxdit serve: stopped (process(es) 1 had stopped answering)"
    ), workers[0].describe()
    assert "stack trace" not in workers[0].stderr, workers[0].describe()


# --------------------------------------------------------------------------------------------------------
# The roll call and the process flags, in this process (threads stand in for processes; no jax start-up)
# --------------------------------------------------------------------------------------------------------


def _roll_call(
    groups: list[distributed.ProcessGroup], timeout: float = 10.0, agreements: list | None = None
) -> list[tuple[str, list[str]]]:
    """Run each group's side of the roll call in a thread: (outcome, lines said) per group."""
    results: list = [None] * len(groups)
    agreements = agreements or [None] * len(groups)

    def side(i: int, group: distributed.ProcessGroup) -> None:
        said: list[str] = []
        run = distributed._lead_roll_call if group.process_id == 0 else distributed._follow_roll_call
        try:
            run(group, timeout, said.append, agreements[i])
            results[i] = ("joined", said)
        except distributed.StartupError as e:
            results[i] = (str(e), said)

    threads = [threading.Thread(target=side, args=(i, g)) for i, g in enumerate(groups)]
    threads[0].start()
    time.sleep(0.2)  # process 0 listening first is the usual order; late starters retry anyway
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return results


def test_roll_call_admits_every_process_once():
    address = f"127.0.0.1:{_free_port()}"
    results = _roll_call([distributed.ProcessGroup(address, 3, i) for i in (0, 2, 1)])
    assert [r[0] for r in results] == ["joined"] * 3, results
    assert results[0][1][-1] == "process 0: all 3 processes present"


def test_roll_call_refuses_a_wrong_count_and_a_taken_id():
    address = f"127.0.0.1:{_free_port()}"
    results = _roll_call([distributed.ProcessGroup(address, 2, 0), distributed.ProcessGroup(address, 3, 1)])
    reason = "process 1 was started with 3 processes, process 0 with 2; start all with the same count"
    assert [r[0] for r in results] == [reason, reason], results

    address = f"127.0.0.1:{_free_port()}"
    groups = [distributed.ProcessGroup(address, 3, i) for i in (0, 1, 1)]
    results = _roll_call(groups)
    assert "process id 1 was claimed twice" in results[0][0], results
    assert all("claimed twice" in r[0] for r in results), results


def test_roll_call_refuses_a_process_started_with_other_flags():
    """Processes that differ in mesh or request would block in a collective at step 1 (or compute
    something else): the roll call compares their flags and every process stops, naming the flag."""
    address = f"127.0.0.1:{_free_port()}"
    ours = {"ulysses_degree": 2, "ring_degree": 1, "seed": 0, "prompt": "7"}
    theirs = dict(ours, ulysses_degree=1, ring_degree=2)
    groups = [distributed.ProcessGroup(address, 2, i) for i in (0, 1)]
    results = _roll_call(groups, agreements=[ours, theirs])
    reason = (
        "process 1 was started with other settings than process 0: --ring_degree (2 there, 1 on process 0), "
        "--ulysses_degree (1 there, 2 on process 0); start every process with the same flags"
    )
    assert [r[0] for r in results] == [reason, reason], results
    address = f"127.0.0.1:{_free_port()}"
    results = _roll_call(
        [distributed.ProcessGroup(address, 2, i) for i in (0, 1)], agreements=[ours, dict(ours)]
    )
    assert [r[0] for r in results] == ["joined", "joined"], results


def test_generate_processes_with_different_meshes_end_with_one_line_each(tmp_path):
    """Before: both blocked in a collective at step 1 and ignored SIGTERM. Now the roll call refuses them
    before any device work, within seconds."""
    port = _free_port()
    common = [
        "--emulate_devices",
        "2",
        "--prompt",
        "7",
        "--output",
        "digit.png",
        "--initialization_timeout",
        "60",
    ]
    meshes = (["--ulysses_degree", "2", "--ring_degree", "2"], ["--ring_degree", "4"])
    start = time.monotonic()
    workers = [
        _start(_jaxdit("generate", port, i, 2, *common, *meshes[i]), tmp_path / f"p{i}", "log")
        for i in (0, 1)
    ]
    _wait(workers, 60)
    assert time.monotonic() - start < 45
    for w in workers:
        assert w.returncode == 2, w.describe()
        last = w.stderr.strip().splitlines()[-1]
        assert last.startswith("jaxdit generate: error: process 1 was started with other settings"), (
            w.describe()
        )
        assert "--ring_degree (4 there, 2 on process 0)" in last and "--ulysses_degree" in last, last
        assert "Traceback" not in w.stderr, w.describe()
    assert not list(tmp_path.rglob("*.png"))


def test_process_flags_checked_before_anything_starts(monkeypatch):
    for name in ("JAXDIT_COORDINATOR", "JAXDIT_NUM_PROCESSES", "JAXDIT_PROCESS_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.resolve() is None
    assert distributed.resolve(num_processes=1) is None
    group = distributed.resolve("10.0.0.1:1234", 2, 1)
    assert (group.coordinator_address, group.num_processes, group.process_id) == ("10.0.0.1:1234", 2, 1)
    for kwargs, message in [
        (dict(num_processes=2, process_id=1), "needs a coordinator address"),
        (dict(coordinator_address="10.0.0.1", num_processes=2, process_id=1), "HOST:PORT"),
        (dict(coordinator_address="h:99999", num_processes=2, process_id=1), "1..65535"),
        (dict(coordinator_address="h:1234", num_processes=2), "needs this process's id"),
        (dict(coordinator_address="h:1234", process_id=0), "needs the process count"),
        (dict(coordinator_address="h:1234", num_processes=2, process_id=2), "outside 0..1"),
    ]:
        with pytest.raises(ValueError, match=message):
            distributed.resolve(**kwargs)
    # A launcher's variables (here Slurm's, as srun sets them) are jax's to read.
    slurm = dict(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="node[1-2]", SLURM_NTASKS="2", SLURM_PROCID="1")
    for name, value in dict(slurm, SLURM_LOCALID="0").items():
        monkeypatch.setenv(name, value)
    group = distributed.resolve()
    assert group is not None and group.source == "Slurm variables" and group.coordinator_address is None
