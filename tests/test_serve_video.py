"""``jaxdit serve`` video jobs end to end with a tiny random Wan 2.1 pipeline folder (diffusers layout), on
one device (the service's mesh handling is tested with tiny-digits in test_serve.py and across processes).

``POST /v1/videos`` queues a job and answers at once; ``GET /v1/videos/{id}`` shows its progress in steps;
``GET /v1/videos/{id}/content`` gives an MP4 of the frames the pipeline's own call makes for that request
(compared before encoding: x264 does not always encode the same frames to the same bytes); ``DELETE``
cancels a running job after its current step, then forgets it.
"""

from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
av = pytest.importorskip("av")

import tiny_pipelines  # noqa: E402

from jaxdit.mesh import ParallelConfig  # noqa: E402
from jaxdit.serve import engine as engine_module  # noqa: E402
from jaxdit.serve import schema  # noqa: E402
from jaxdit.serve.command import Service  # noqa: E402
from jaxdit.serve.engine import Engine  # noqa: E402
from jaxdit.serve.jobs import Scheduler  # noqa: E402
from jaxdit.serve.metrics import Metrics, compile_counts  # noqa: E402

FAST = {"xla_backend_optimization_level": 0}
SIZE, FRAMES, STEPS = (32, 32), 5, 50
PROMPT = "a red fox running in snow"


@pytest.fixture(scope="module")
def served():
    folder = tiny_pipelines.wan_folder()
    config = ParallelConfig()
    mesh = config.make_mesh(jax.devices()[: config.num_devices])
    engine = Engine.load(str(folder), mesh, compiler_options=FAST)
    assert engine.card.kind == "video" and engine.card.default_steps == STEPS
    engine.warm_up([engine.request_for(*SIZE, 1, FRAMES)])
    service = Service(Scheduler(engine, Metrics()))
    yield engine, f"http://127.0.0.1:{service.port}"
    service.stop()


def _call(url: str, method: str = "GET", body: dict | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _frames(mp4: bytes) -> np.ndarray:
    with av.open(io.BytesIO(mp4)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def _poll(url: str, until, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        code, body = _call(url)
        assert code == 200, body
        job = json.loads(body)
        if until(job):
            return job
        assert time.monotonic() < deadline, f"job stuck: {job}"
        time.sleep(0.01)


def test_video_job_runs_to_an_mp4_and_a_running_job_cancels(served, monkeypatch):
    engine, url = served
    encoded = []  # the frames each generation hands to the MP4 writer
    write_mp4 = engine_module._mp4
    monkeypatch.setattr(
        engine_module, "_mp4", lambda frames, fps: encoded.append(frames) or write_mp4(frames, fps)
    )
    request = {"prompt": PROMPT, "size": f"{SIZE[0]}x{SIZE[1]}", "num_frames": FRAMES, "seed": 1}
    compiled = compile_counts()

    code, body = _call(f"{url}/v1/videos", "POST", request)
    assert code == 200, body
    job = json.loads(body)
    assert (
        job["object"] == "video"
        and job["status"] in ("queued", "in_progress")
        and job["steps_total"] == STEPS
    )
    seen = []
    done = _poll(
        f"{url}/v1/videos/{job['id']}", lambda j: seen.append(j["steps_done"]) or j["status"] == "completed"
    )
    assert done["steps_done"] == STEPS and done["progress"] == 100 and done["num_frames"] == FRAMES
    assert seen == sorted(seen), "progress went backwards"

    code, mp4 = _call(f"{url}/v1/videos/{job['id']}/content")
    assert code == 200 and mp4[4:8] == b"ftyp"
    frames = _frames(mp4)
    assert frames.shape == (FRAMES, SIZE[1], SIZE[0], 3)
    engine.generate(schema.video_request(request, engine.card))  # the pipeline's own call
    assert len(encoded) == 2 and (encoded[0] == encoded[1]).all(), "the served video is not the pipeline's"
    # (The MP4 itself is not compared byte for byte: x264's threads gave identical frames different
    # encodings in 1 of about 8 runs on a loaded machine.)

    # A long job, cancelled while it runs: it stops after its current step.
    code, body = _call(f"{url}/v1/videos", "POST", dict(request, seed=2))
    job_id = json.loads(body)["id"]
    _poll(f"{url}/v1/videos/{job_id}", lambda j: j["steps_done"] >= 2)
    code, body = _call(f"{url}/v1/videos/{job_id}", "DELETE")
    assert code == 200 and json.loads(body)["id"] == job_id
    cancelled = _poll(f"{url}/v1/videos/{job_id}", lambda j: j["status"] == "cancelled")
    assert 2 <= cancelled["steps_done"] < STEPS, cancelled
    assert cancelled["error"]["message"] == f"cancelled ({cancelled['steps_done']} of {STEPS} steps done)"
    code, body = _call(f"{url}/v1/videos/{job_id}/content")
    assert code == 409 and "cancelled" in json.loads(body)["error"]["message"]
    code, body = _call(f"{url}/v1/videos/{job_id}", "DELETE")  # a finished job is forgotten
    assert code == 200 and json.loads(body) == {"id": job_id, "object": "video.deleted", "deleted": True}
    assert _call(f"{url}/v1/videos/{job_id}")[0] == 404
    assert compile_counts() == compiled, "a served video shape compiled again"

    # The step count's bucket is part of the program (1-63 steps share one): 70 is a new shape, refused.
    code, body = _call(f"{url}/v1/videos", "POST", dict(request, steps=70))
    error = json.loads(body)["error"]
    assert code == 400 and error["param"] == "steps" and "not compiled" in error["message"], error
    assert np.isfinite(done["created_at"])
