"""``jaxdit serve`` on loopback with the bundled tiny-digits model (cfg2 x ring2 x ulysses2, 8 devices).

One engine (loaded and compiled once) serves every test; each test starts its own scheduler and HTTP
server (uvicorn, a free port on 127.0.0.1) around it with the settings it needs.

* 40 requests from 8 concurrent clients: every answer a PNG whose pixels are `jaxdit generate`'s for the
  same digit and seed; no XLA compilation during the run; the process's memory does not grow.
* Bad requests get a 4xx naming the field and never reach the devices (no step runs).
* A full queue answers 429 with Retry-After; a request past its deadline 504; a client that disconnects
  stops its generation within a step; an error inside one generation fails that request only; a graceful
  shutdown finishes the running request and answers the queued ones 503.
* ``--new_shapes compile`` compiles a new shape once, then serves it from the cache.
* A PipeFusion mesh (cfg2 x pipefusion2 x ulysses2) answers `jaxdit generate`'s pictures with its programs
  compiled at start-up only; progress and cancellation act at its warm-up step and its pipelined phase's end.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import jax
import multiprocess_worker as worker
import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from PIL import Image  # noqa: E402

from jaxdit.mesh import ParallelConfig  # noqa: E402
from jaxdit.pipelines import preflight  # noqa: E402
from jaxdit.serve import schema  # noqa: E402
from jaxdit.serve.command import Service  # noqa: E402
from jaxdit.serve.engine import Engine, EngineLimits, GenerationCancelled  # noqa: E402
from jaxdit.serve.jobs import Scheduler  # noqa: E402
from jaxdit.serve.metrics import Metrics, compile_counts, listen_for_compiles  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
#: The mesh of `jaxdit generate`'s reference (multiprocess_worker.MESH_FLAGS).
CONFIG = ParallelConfig(cfg=2, ring=2, ulysses=2)
#: The request checked against `jaxdit generate` (its PNG enlarges tiny-digits' 16x16 by SCALE).
DIGIT, SEED, SCALE = worker.DIGIT, worker.DIGIT_SEED, worker.PNG_SCALE
#: The largest step count the test server takes, and the long requests' count (one compiled program
#: serves 1-63 steps). Long requests also run on a slowed device (``slow``): STEP_DELAY_S more per step.
MAX_STEPS, LONG = 100, 60
STEP_DELAY_S = 0.05


def _load_script():
    spec = importlib.util.spec_from_file_location("load_test", REPO / "scripts" / "load_test.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["load_test"] = module
    spec.loader.exec_module(module)
    return module


load_test = _load_script()


def _small(png: bytes) -> np.ndarray:
    """`jaxdit generate`'s PNG of a digit (enlarged by SCALE) at its 16x16."""
    big = np.asarray(Image.open(io.BytesIO(png)))
    small = big[::SCALE, ::SCALE]
    assert (np.repeat(np.repeat(small, SCALE, 0), SCALE, 1) == big).all()
    return small


@pytest.fixture(scope="module")
def generated() -> np.ndarray:
    """`jaxdit generate`'s picture of DIGIT with SEED on the same mesh, at 16x16."""
    return _small(worker.generated_png())


@pytest.fixture(scope="module")
def engine() -> Engine:
    listen_for_compiles()
    mesh = CONFIG.make_mesh(jax.devices()[: CONFIG.num_devices])
    engine = Engine.load(None, mesh, limits=EngineLimits(max_steps=MAX_STEPS))
    engine.warm_up([engine.request_for(16, 16)])
    return engine


class Server:
    """A scheduler + HTTP server around the shared engine; stopped when the test ends."""

    def __init__(self, engine: Engine, body_timeout: float = 30.0, **options) -> None:
        self.metrics = Metrics()
        self.scheduler = Scheduler(engine, self.metrics, **options)
        self.service = Service(self.scheduler, body_timeout=body_timeout)
        self.url = f"http://127.0.0.1:{self.service.port}"

    def post(self, body, path="/v1/images/generations", content_type="application/json", timeout=120):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read()), response.headers
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), e.headers

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def metric(self, name: str, **labels) -> float:
        text = self.get("/metrics")[1].decode()
        label_text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        pattern = rf"^{name}{{{label_text}}} (\S+)$" if labels else rf"^{name} (\S+)$"
        match = re.search(pattern, text, re.MULTILINE)
        return float(match[1]) if match else 0.0

    def steps_run(self) -> int:
        return int(self.metric("jaxdit_step_seconds_count"))

    def wait_running(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.scheduler._running is None or self.scheduler._running.steps_done < 2:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.005)


@pytest.fixture
def slow(engine, monkeypatch):
    """Every denoising step takes STEP_DELAY_S longer, as on a slower device: requests last long enough
    to be queued behind, timed out, disconnected from and shut down on."""
    generate = engine.pipe.generate

    def slowly(call):
        step = call.callback
        return generate(
            call.replace(callback=lambda *a: time.sleep(STEP_DELAY_S) or step(*a)) if step else call
        )

    monkeypatch.setattr(engine.pipe, "generate", slowly)


@pytest.fixture
def server(engine, request):
    servers = []

    def start(**options) -> Server:
        servers.append(Server(engine, **options))
        return servers[-1]

    yield start
    for s in servers:
        s.service.stop()


def _png(b64: str) -> np.ndarray:
    data = base64.b64decode(b64)
    assert data.startswith(load_test.PNG_SIGNATURE)
    return np.asarray(Image.open(io.BytesIO(data)))


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_concurrent_requests_match_generate(engine, generated, server):
    """40 requests from 8 clients, 4 digits x 2 seeds interleaved: each answer is the picture one request
    alone makes, and (7, seed 3) is `jaxdit generate`'s; nothing compiles; memory stays flat."""
    s = server(max_queue=64)
    combos = [(d, seed) for d in "0279" for seed in (SEED, 11)]
    alone = {}  # what one request makes by itself, straight from the pipeline (no HTTP, no queue)
    for d, seed in combos:
        g = schema.image_request({"prompt": d, "seed": seed}, engine.card)
        alone[d, seed] = _png(base64.b64encode(engine.generate(g).files[0]).decode())
    assert (alone[DIGIT, SEED] == generated).all(), "the server's pipeline differs from jaxdit generate's"

    body = lambda i: {"prompt": combos[i % len(combos)][0], "seed": combos[i % len(combos)][1]}
    load_test.run(s.url, 8, 8, body)  # the HTTP stack's own first-use allocations
    compiled_before, rss_before = compile_counts(), _rss_bytes()
    results, seconds = load_test.run(s.url, 40, 8, body)
    compiled_after, rss_after = compile_counts(), _rss_bytes()

    for r in results:
        assert r.status == 200 and r.error is None, (r.status, r.error)
        assert len(r.images) == 1
        picture = np.asarray(Image.open(io.BytesIO(r.images[0])))
        assert picture.shape == (16, 16) and picture.dtype == np.uint8
        assert (picture == alone[tuple(body(r.index).values())]).all(), f"request {r.index}"
    summary = load_test.report(results, seconds)
    print(
        f"40 requests / 8 clients: {summary['requests_per_second']:.1f} req/s, p50 "
        f"{1000 * summary['p50']:.0f} ms, p99 {1000 * summary['p99']:.0f} ms; RSS {rss_before / 2**20:.1f} -> "
        f"{rss_after / 2**20:.1f} MiB"
    )
    assert compiled_after == compiled_before, "a request compiled a program after start-up"
    assert s.metric("jaxdit_requests_total", kind="image", outcome="completed") == 48
    assert s.metric("jaxdit_compilations_total") == compiled_after[0]
    # Measured growth is a few MiB at most (allocator noise); a leak of every request's buffers or
    # threads would show as more.
    assert rss_after - rss_before < 32 * 2**20, f"RSS grew {(rss_after - rss_before) / 2**20:.1f} MiB"


BAD_REQUESTS = [
    # (body or raw bytes, content type, status, the field named, a word of the message)
    ({"prompt": "7", "size": "1024x1024"}, "application/json", 400, "size", "16x16"),
    ({"prompt": "7", "size": "big"}, "application/json", 400, "size", "WIDTHxHEIGHT"),
    ({"prompt": "7", "steps": 0}, "application/json", 400, "steps", f"1..{MAX_STEPS}"),
    ({"prompt": "7", "steps": MAX_STEPS + 1}, "application/json", 400, "steps", f"1..{MAX_STEPS}"),
    ({"prompt": "7", "steps": "20"}, "application/json", 400, "steps", "integer"),
    ({"prompt": "7" * 2001}, "application/json", 400, "prompt", "at most 2000"),
    ({"prompt": "cat"}, "application/json", 400, "prompt", "single digit"),
    ({"size": "16x16"}, "application/json", 400, "prompt", "required"),
    ({"prompt": "7", "n": 0}, "application/json", 400, "n", "1..4"),
    ({"prompt": "7", "n": 2}, "application/json", 400, "n", "not compiled"),
    ({"prompt": "7", "true_cfg_scale": 1.0}, "application/json", 400, "true_cfg_scale", "cfg=2"),
    (b'{"prompt": "7", "true_cfg_scale": NaN}', "application/json", 400, "true_cfg_scale", "finite"),
    ({"prompt": "7", "negative_prompt": "cat"}, "application/json", 400, "negative_prompt", "digit"),
    # it ran one branch, the picture of the request without it:
    (
        {"prompt": "7", "negative_prompt": "3", "true_cfg_scale": 1.0},
        "application/json",
        400,
        "negative_prompt",
        "turns off",
    ),  # noqa: E501
    ({"prompt": "7", "guidance": 3.5}, "application/json", 400, "guidance", "change nothing"),
    ({"prompt": "7", "seed": -1}, "application/json", 400, "seed", "0.."),
    ({"prompt": "7", "response_format": "url"}, "application/json", 400, "response_format", "b64_json"),
    ({"prompt": "7", "model": "dall-e-3"}, "application/json", 400, "model", "tiny-digits"),
    ({"prompt": "7", "step": 5}, "application/json", 400, "step", "unknown"),
    (b'{"prompt": "7",', "application/json", 400, "body", "malformed JSON"),
    (b"[1, 2]", "application/json", 400, "body", "JSON object"),
    (b"\xff\xfe", "application/json", 400, "body", "UTF-8"),
    (b'{"prompt": "7"}', "text/plain", 415, "Content-Type", "application/json"),
    (b"x" * (2 << 20), "application/json", 413, "body", "bytes"),
]


def test_bad_requests_name_the_field_and_never_reach_the_devices(server, monkeypatch):
    s = server()
    for body, content_type, status, param, word in BAD_REQUESTS:
        code, answer, _ = s.post(body, content_type=content_type)
        error = answer["error"]
        assert (code, error["param"]) == (status, param), (body if len(body) < 100 else body[:50], answer)
        assert word in error["message"], error
    assert s.steps_run() == 0, "a bad request reached the devices"
    assert (
        s.metric("jaxdit_requests_total", kind="image", outcome="rejected_bad_request")
        == len(BAD_REQUESTS) - 1
    )
    assert s.metric("jaxdit_requests_total", kind="image", outcome="rejected_shape") == 1
    code, body = s.get("/v1/videos/nope")
    assert code == 404
    code, answer, _ = s.post({"prompt": "7"}, path="/v1/videos")
    assert code == 404 and "POST /v1/images/generations" in answer["error"]["message"]
    assert s.post({"prompt": "7", "seed": SEED})[0] == 200  # the server is still serving

    def unwritable(path, flag="--output"):
        raise ValueError(f"{flag} {path}: cannot write")

    # The server writes no file: its checks do not depend on a writable working folder.
    monkeypatch.setattr(preflight, "check_writable", unwritable)
    assert s.post({"prompt": "7", "seed": SEED})[0] == 200


def _raw(port: int, data: bytes, pause: float = 0.0, read_timeout: float = 10.0) -> tuple[bytes, float]:
    """Send ``data`` over a raw socket (``pause`` s between its two halves); the answer and its seconds."""
    import socket

    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as conn:
        half = len(data) // 2
        conn.sendall(data[:half])
        time.sleep(pause)
        conn.sendall(data[half:])
        answer = b""
        while True:  # until the server closes the connection
            chunk = conn.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer, time.monotonic() - start


def test_slow_or_short_bodies_and_unknown_routes_get_json_errors(server):
    """Before: a body shorter than its Content-Length (or trickled) was never answered nor closed, and
    unknown routes answered plain text. Now: a 408 within the body timeout, connection closed; 404/405 in
    the service's error shape; the server keeps serving."""
    s = server(body_timeout=1.0)
    body = json.dumps({"prompt": "7"}).encode()
    head = (
        f"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body) + 40}\r\n\r\n"
    ).encode()
    answer, seconds = _raw(s.service.port, head + body)  # 40 bytes never come
    assert answer.startswith(b"HTTP/1.1 408") and seconds < 5, (answer[:200], seconds)
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["param"] == "body" and "did not arrive within 1 s" in error["message"]
    code, raw = s.get("/v1/nothing")
    assert code == 404 and json.loads(raw)["error"]["message"] == "no route /v1/nothing"
    request = urllib.request.Request(s.url + "/healthz", data=b"{}", method="POST")
    try:
        urllib.request.urlopen(request, timeout=10)
        raise AssertionError("POST /healthz was accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 405 and "POST is not allowed on /healthz" in json.loads(e.read())["error"]["message"]
    assert s.post({"prompt": "7", "seed": SEED})[0] == 200


class _Store:
    """The coordination service's key-value store, as lockstep uses it, in memory."""

    def __init__(self) -> None:
        self.values, self.lock = {}, threading.Lock()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.lock:
            assert allow_overwrite or key not in self.values
            self.values[key] = value

    def key_value_dir_get(self, prefix):
        with self.lock:
            return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def test_a_follower_that_stops_beating_is_named_by_healthz_and_requests(server):
    """Before: a dead follower of a two-process serve went unnoticed until a request blocked in a
    collective (then a 500 with a raw Gloo message). Now its silent heartbeat makes /healthz answer 503
    naming it, and new requests 503 before they reach the devices."""
    from jaxdit.serve import lockstep

    store = _Store()
    leader = lockstep.Leader(store, 2, lost_after=0.3)
    time.sleep(0.4)
    assert leader.lost() == [], "a follower not yet heard from (still compiling) was counted lost"
    beat = lockstep.Heartbeat(store, 1, every=0.02)
    time.sleep(0.1)
    assert leader.lost() == []
    time.sleep(0.4)
    assert leader.lost() == [], "a beating follower was counted lost"
    beat.stop()
    time.sleep(0.5)
    assert leader.lost() == [1]

    s = server(lockstep=leader)
    code, raw = s.get("/healthz")
    health = json.loads(raw)
    assert code == 503 and health["status"] == "process_lost" and health["lost_processes"] == [1], health
    code, answer, _ = s.post({"prompt": "7", "seed": SEED})
    assert code == 503 and "process(es) 1 of this server stopped answering" in answer["error"]["message"]
    assert s.steps_run() == 0


def test_full_queue_answers_429_with_retry_after(server, slow):
    s = server(max_queue=1, request_timeout=60, shutdown_grace=0)
    answers = {}
    long = lambda name: answers.__setitem__(name, s.post({"prompt": "1", "steps": LONG}))
    running = threading.Thread(target=long, args=("running",))
    running.start()
    s.wait_running()
    queued = threading.Thread(target=long, args=("queued",))
    queued.start()
    while s.scheduler.queue_depth < 1:
        time.sleep(0.005)
    assert s.metric("jaxdit_queue_depth") == 1
    code, answer, headers = s.post({"prompt": "2"})
    assert code == 429 and answer["error"]["type"] == "rate_limit_error", answer
    assert int(headers["Retry-After"]) >= 1
    assert "queue is full" in answer["error"]["message"]
    s.service.stop()  # ends both long requests: the running one is stopped at shutdown's grace
    running.join(30), queued.join(30)
    assert answers["queued"][0] == 503 and "shutting down" in answers["queued"][1]["error"]["message"]


def test_request_past_its_deadline_answers_504(server, slow):
    s = server(request_timeout=0.5)
    start = time.monotonic()
    code, answer, _ = s.post({"prompt": "3", "steps": LONG})
    elapsed = time.monotonic() - start
    assert code == 504 and answer["error"]["type"] == "timeout_error", answer
    pattern = rf"^timed out after 0.5 s \((\d+) of {LONG} steps done\)$"
    steps = int(re.search(pattern, answer["error"]["message"])[1])
    assert 0 < steps < LONG and elapsed < 5, (steps, elapsed)
    assert s.metric("jaxdit_requests_total", kind="image", outcome="timeout") == 1
    assert s.post({"prompt": "3", "seed": SEED, "steps": 2})[0] == 200  # one inside the deadline


def test_client_disconnect_stops_the_generation(server, slow):
    s = server()
    body = json.dumps({"prompt": "4", "steps": LONG}).encode()
    with socket.create_connection(("127.0.0.1", s.service.port)) as conn:
        conn.sendall(
            b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        s.wait_running()
    gone = time.monotonic()
    while s.metric("jaxdit_requests_total", kind="image", outcome="disconnected") < 1:
        assert time.monotonic() - gone < 5, "the disconnect was not noticed"
        time.sleep(0.01)
    steps = s.steps_run()
    assert steps < LONG / 2, f"{steps} steps ran: the generation went on after the client left"
    assert s.post({"prompt": "4", "seed": SEED})[0] == 200


def test_error_inside_a_generation_fails_that_request_only(engine, server, monkeypatch):
    s = server()
    generate = engine.pipe.generate

    def broken(call):
        if call.seed == 666:
            raise FloatingPointError("injected fault")
        return generate(call)

    monkeypatch.setattr(engine.pipe, "generate", broken)
    code, answer, _ = s.post({"prompt": "5", "seed": 666})
    assert code == 500 and answer["error"]["type"] == "server_error"
    assert "FloatingPointError: injected fault" in answer["error"]["message"]
    assert s.post({"prompt": "5", "seed": 1})[0] == 200
    assert s.metric("jaxdit_requests_total", kind="image", outcome="failed") == 1


def test_graceful_shutdown_finishes_the_running_request_and_answers_the_queue(server, slow):
    s = server(max_queue=4, shutdown_grace=30)
    answers = {}
    ask = lambda name, steps: answers.__setitem__(name, s.post({"prompt": "6", "steps": steps, "seed": SEED}))
    running = threading.Thread(target=ask, args=("running", LONG))
    running.start()
    s.wait_running()
    waiting = [threading.Thread(target=ask, args=(f"queued{i}", 20)) for i in range(2)]
    for t in waiting:
        t.start()
    while s.scheduler.queue_depth < 2:
        time.sleep(0.005)
    s.service.stop()
    for t in [running, *waiting]:
        t.join(30)
    assert answers["running"][0] == 200, answers["running"]  # finished within the grace period
    for i in range(2):
        code, answer, _ = answers[f"queued{i}"]
        assert code == 503 and "shutting down" in answer["error"]["message"]
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(s.url + "/healthz", timeout=5)


def test_new_shapes_compile_once(engine, server):
    # Programs built, compiled or read from the persistent cache (the suite shares one across tests).
    built = lambda: sum(compile_counts())
    s = server(new_shapes="compile")
    before = built()
    code, answer, _ = s.post({"prompt": "8", "n": 2, "seed": SEED})
    assert code == 200 and len(answer["data"]) == 2
    first = built()
    assert first > before, "a new batch size compiled nothing"
    assert s.post({"prompt": "9", "n": 2, "seed": 5})[0] == 200
    assert built() == first, "the second request of the new shape compiled again"
    health = json.loads(s.get("/healthz")[1])
    assert health["shapes"] == ["16x16 n=1 1-63 steps with CFG", "16x16 n=2 1-63 steps with CFG"], health


def test_serve_flags_checked_before_anything_loads():
    """PipeFusion's flags, and the start-up shapes against them, refused before jax starts or weights load."""
    import argparse

    from jaxdit.serve import command

    def check(*flags: str):
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        return command.check(parser.parse_args(["--emulate_devices", "8", "--port", "0", *flags]))

    plan = check(*PF_FLAGS)
    assert plan.config == PF_CONFIG
    with pytest.raises(ValueError, match="apply to PipeFusion"):
        check("--warmup_steps", "2", "--ulysses_degree", "8")
    with pytest.raises(ValueError, match="start-up shapes: num_pipeline_patch=3 does not divide"):
        check(*PF_FLAGS, "--num_pipeline_patch", "3")
    with pytest.raises(ValueError, match="start-up shapes: warmup_steps=5 exceeds the 4 denoising steps"):
        check(*PF_FLAGS[:-1], "5", "--step_counts", "20,4")
    # Before: a bad host, or a port in use, failed only after the model had loaded and compiled.
    import socket

    with pytest.raises(ValueError, match=r"--host '999.1.1.1' is not an address to listen at"):
        check("--host", "999.1.1.1", "--ulysses_degree", "2", "--ring_degree", "4")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        with pytest.raises(ValueError, match=f"--port {port} is in use at 127.0.0.1"):
            check("--port", port, "--ulysses_degree", "2", "--ring_degree", "4")
    # Before: nan answered every request 504 "after nan s", inf was accepted, and a nan initialization
    # timeout waited for ever.
    for flag in ("--request_timeout", "--initialization_timeout", "--shutdown_grace"):
        for value in ("nan", "inf", "-1"):
            with pytest.raises(ValueError, match=f"{flag} must be a finite number of seconds"):
                check(flag, value, "--ulysses_degree", "2", "--ring_degree", "4")


def test_video_requests_checked_against_the_card():
    card = schema.ModelCard(
        name="wan",
        kind="video",
        default_size=(832, 480),
        size_multiple=16,
        default_steps=50,
        default_guidance=5.0,
        default_negative="",
        default_frames=81,
    )
    g = schema.video_request({"prompt": "a fox", "seconds": "2"}, card)
    assert (g.num_frames, g.width, g.height, g.steps, g.guidance, g.negative_prompt) == (
        33,
        832,
        480,
        50,
        5.0,
        "",
    )
    g = schema.video_request({"prompt": "a fox", "num_frames": 5, "size": "64x48", "seed": 9}, card)
    assert (g.num_frames, g.size, g.seed) == (5, "64x48", 9)
    assert schema.Generation.from_json(g.to_json()) == g
    for body, param, word in [
        ({"prompt": "a", "num_frames": 6}, "num_frames", "4k + 1"),
        ({"prompt": "a", "seconds": 100}, "seconds", "at most 129"),
        ({"prompt": "a", "seconds": "1e308"}, "seconds", "at most 3600"),  # was an OverflowError (500)
        ({"prompt": "a", "seconds": "soon"}, "seconds", "positive number"),
        ({"prompt": "a", "seconds": 2, "num_frames": 5}, "seconds", "not both"),
        ({"prompt": "a", "size": "100x48"}, "size", "multiples of 16"),
        ({"prompt": "a", "n": 2}, "n", "unknown"),
    ]:
        with pytest.raises(schema.RequestError) as e:
            schema.video_request(body, card)
        assert e.value.param == param and word in e.value.message, e.value.message


#: PipeFusion as the README runs it on tiny-digits, with its warm-up step given as a server flag.
PF_FLAGS = ("--use_cfg_parallel", "--pipefusion_parallel_degree", "2", "--ulysses_degree", "2")
PF_FLAGS += ("--warmup_steps", "1")
PF_CONFIG = ParallelConfig(cfg=2, pipefusion=2, ulysses=2)


def test_pipefusion_mesh_serves_generate_pictures_compiled_at_start_up(monkeypatch, tmp_path):
    """Requests on a PipeFusion mesh: `jaxdit generate`'s picture for the same flags and seed, nothing
    compiled after start-up, progress after the warm-up step and after the pipelined phase, cancellation
    at the warm-up step, the exact step count as the compiled shape.

    `jaxdit generate` runs in this process on the served pipeline (its ``build`` hands it over; both call
    ``tiny_digits(mesh)``, and the plain mesh's test compares separately built ones): the programs compile
    once, which also shows a second caller reuses them."""
    from jaxdit import cli
    from jaxdit import generate as cli_generate

    mesh = PF_CONFIG.make_mesh(jax.devices()[: PF_CONFIG.num_devices])
    engine = Engine.load(None, mesh, limits=EngineLimits(max_steps=MAX_STEPS), warmup_steps=1)
    engine.warm_up([engine.request_for(16, 16)])
    compiled = compile_counts()

    def build(r, generate_mesh):
        assert r.source == "bundled" and r.parallel() == PF_CONFIG and r.warmup_steps == 1
        return engine.pipe

    monkeypatch.setattr(cli_generate, "build", build)
    path = tmp_path / "digit.png"
    argv = ["generate", "--prompt", DIGIT, "--seed", str(SEED), "--output", str(path), *PF_FLAGS]
    assert cli.main(argv) == 0
    reference = _small(path.read_bytes())

    s = Server(engine, max_queue=8)
    try:
        asks = [{"prompt": DIGIT, "seed": SEED}, {"prompt": "2", "seed": 5}, {"prompt": DIGIT, "seed": SEED}]
        answers = [None] * len(asks)
        ask = lambda i: answers.__setitem__(i, s.post(asks[i]))
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [a[0] for a in answers] == [200] * 3, answers
        for i in (0, 2):
            assert (_png(answers[i][1]["data"][0]["b64_json"]) == reference).all(), "not generate's picture"
        # 20 steps: the warm-up step (its time includes encoding the prompt), then 19 in one phase.
        assert s.metric("jaxdit_step_seconds_count") == 3 * 19
        code, answer, _ = s.post({"prompt": "3", "steps": 19})
        assert code == 400 and answer["error"]["param"] == "steps", answer
        assert "it serves: 16x16 n=1 20 steps with CFG" in answer["error"]["message"], answer
    finally:
        s.service.stop()

    g = schema.image_request({"prompt": "4"}, engine.card)
    seen = []
    engine.generate(g, lambda done, total: seen.append((done, total)) is None)
    assert seen == [(1, 20), (20, 20)], seen
    seen.clear()
    with pytest.raises(GenerationCancelled):
        engine.generate(g, lambda done, total: seen.append((done, total)) is not None)
    assert seen == [(1, 20)], "the run went on after the warm-up step said stop"
    assert compile_counts() == compiled, "a request compiled a program after start-up"


def _fuzz_bodies(rng: np.random.Generator, count: int):
    """Random and malformed bodies: bytes, truncated or deep JSON, wrong types and absurd numbers."""
    fields = ["prompt", "size", "seed", "steps", "guidance", "negative_prompt", "model", "n", "extra"]
    values = [None, True, -1, 0, 1e308, -1e308, 2**70, "1e308", "", "x" * 5000, [], {}, [1, [2]], "nan", 3.5]
    yield b"[" * 100_000  # nesting far past the parser's recursion limit
    yield b'{"prompt": "7", "seed": ' + b"9" * 5000 + b"}"
    for _ in range(count):
        kind = rng.integers(4)
        if kind == 0:
            yield rng.bytes(int(rng.integers(0, 200)))
        elif kind == 1:
            text = json.dumps({"prompt": "7", "steps": 1, "seed": int(rng.integers(100))}).encode()
            yield text[: int(rng.integers(len(text)))]
        else:
            body = {"prompt": "7", "steps": 1}
            for _ in range(int(rng.integers(1, 4))):
                body[fields[rng.integers(len(fields))]] = values[rng.integers(len(values))]
            yield json.dumps(body).encode()


def test_fuzzed_bodies_get_json_answers_and_the_server_stays_healthy(server):
    """Every answer to a random or malformed body is a JSON error (4xx) or a picture; the server still
    serves after them. Bounded: 60 bodies, loopback, at most 1 denoising step each."""
    s = server()
    rng = np.random.default_rng(33)
    start = time.monotonic()
    for body in _fuzz_bodies(rng, 60):
        code, answer, _ = s.post(body, timeout=60)  # a non-JSON answer fails in json.loads
        if code == 200:
            assert answer["data"], answer
        else:
            assert 400 <= code < 500 and answer["error"]["message"], (body[:80], code, answer)
    assert time.monotonic() - start < 120
    assert s.get("/healthz")[0] == 200
    assert s.post({"prompt": "7", "seed": SEED})[0] == 200
