"""``jaxdit serve`` video jobs for HunyuanVideo 1.5 text to video: the tiny ``HunyuanVideo15Pipeline`` folder
saved by diffusers with its text encoders (``hunyuan_video15_folder.py``), served on cfg2 (2 emulated
devices, one guidance branch each). ``POST /v1/videos`` with a prompt with quoted text runs to an MP4 whose
frames (as handed to the encoder) are diffusers' from the reloaded folder with the project's noise (numpy
``default_rng(seed).standard_normal`` of [1, 4, F', H/16, W/16]), the CFG scale the folder guider's. The
service's queueing, progress and cancelling are tested with Wan in test_serve_video.py.

Image to video: the tiny ``HunyuanVideo15ImageToVideoPipeline`` folder (``hf.save_i2v``) on cfg2, a job
whose ``image`` is a 56 x 40 PNG (the first frame; drawn at its size bucket 64 x 48, ``size`` left out)
against diffusers' pipeline from the reloaded folder; a job without a first frame, with a first frame of
an aspect no bucket fits (8 x 200), or with a size other than the bucket gets a 400 naming the field
before anything is queued.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import time
import urllib.error
import urllib.request

import hunyuan_video15_folder as hf
import jax
import numpy as np
import pytest
import tolerance as tol
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
av = pytest.importorskip("av")

from jaxdit.mesh import ParallelConfig  # noqa: E402
from jaxdit.pipelines import latents as latent_ops  # noqa: E402
from jaxdit.serve import command  # noqa: E402
from jaxdit.serve import engine as engine_module  # noqa: E402
from jaxdit.serve.command import Service  # noqa: E402
from jaxdit.serve.engine import Engine  # noqa: E402
from jaxdit.serve.jobs import Scheduler  # noqa: E402
from jaxdit.serve.metrics import Metrics  # noqa: E402

PROMPT = 'a cat walks on grass, sign reading "hello"'
W, H, FRAMES, STEPS, SEED = 48, 32, 5, 3, 7


def _call(url: str, method: str = "GET", body: dict | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _wait(url: str, job_id: str) -> dict:
    deadline = time.monotonic() + 300
    while (job := json.loads(_call(f"{url}/v1/videos/{job_id}")[1]))["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    return job


def _png(picture: np.ndarray) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(picture).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _check_frames(frames: np.ndarray, want: np.ndarray, bound_of: str) -> None:
    """The served frames are rounded to counts (as jaxdit.pipelines.output.to_uint8 does); diffusers' are
    floats: half a count of rounding plus the frames' bound of the float comparison."""
    error = float(np.abs(frames / 255.0 - want).max())
    counts = np.abs(frames.astype(np.int16) - np.round(want * 255).astype(np.int16))
    bound = 0.5 / 255 + tol.PIXELS[bound_of].limit
    print(
        f"\nserved frames vs diffusers: {error:.3e} (bound {bound:.3e}); {int((counts > 0).sum())} counts off by one"
    )
    assert error <= bound and counts.max() <= 1, (error, counts.max())


def test_served_video_is_diffusers(tmp_path, monkeypatch):
    import diffusers

    folder = tmp_path / "HunyuanVideo-1.5-tiny"
    hf.save(folder, with_text=True)
    pipe = diffusers.HunyuanVideo15Pipeline.from_pretrained(folder)
    noise = torch.from_numpy(latent_ops.initial_noise(SEED, (1, 4, (FRAMES - 1) // 4 + 1, H // 16, W // 16)))
    with torch.no_grad():
        want = pipe(
            PROMPT,
            height=H,
            width=W,
            num_frames=FRAMES,
            num_inference_steps=STEPS,
            latents=noise,
            output_type="np",
        ).frames[0]

    encoded, write_mp4 = [], engine_module._mp4
    monkeypatch.setattr(
        engine_module, "_mp4", lambda frames, fps: encoded.append(frames) or write_mp4(frames, fps)
    )
    config = ParallelConfig(cfg=2)
    engine = Engine.load(str(folder), config.make_mesh(jax.devices()[: config.num_devices]))
    assert engine.card.kind == "video" and engine.card.fps == 24
    engine.warm_up([engine.request_for(W, H, 1, FRAMES, STEPS)])  # the server compiles shapes at start-up
    encoded.clear()  # the warm-up's video
    service = Service(Scheduler(engine, Metrics()))
    url = f"http://127.0.0.1:{service.port}"
    try:
        body = {"prompt": PROMPT, "size": f"{W}x{H}", "num_frames": FRAMES, "steps": STEPS, "seed": SEED}
        code, answer = _call(f"{url}/v1/videos", "POST", body)
        assert code == 200, answer
        job_id = json.loads(answer)["id"]
        deadline = time.monotonic() + 300
        while (job := json.loads(_call(f"{url}/v1/videos/{job_id}")[1]))["status"] not in (
            "completed",
            "failed",
        ):
            assert time.monotonic() < deadline, job
            time.sleep(0.05)
        assert job["status"] == "completed" and job["steps_done"] == STEPS, job
        code, mp4 = _call(f"{url}/v1/videos/{job_id}/content")
    finally:
        service.stop()
    assert code == 200 and mp4[4:8] == b"ftyp"
    with av.open(io.BytesIO(mp4)) as container:
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert (len(decoded), *decoded[0].shape) == (FRAMES, H, W, 3)
    (frames,) = encoded
    assert frames.dtype == np.uint8 and frames.shape == want.shape == (FRAMES, H, W, 3)
    _check_frames(frames, want, "hunyuanvideo1.5")


PICTURE = (40, 56)  # height, width: the tiny transformer's (target size 64) size bucket is 48 x 64
BUCKET_W, BUCKET_H = 64, 48


def test_served_image_to_video_is_diffusers(tmp_path, monkeypatch):
    import diffusers
    from PIL import Image

    folder = tmp_path / "HunyuanVideo-1.5-i2v-tiny"
    hf.save_i2v(folder)
    picture = np.random.default_rng(3).integers(0, 256, (*PICTURE, 3), dtype=np.uint8)
    pipe = diffusers.HunyuanVideo15ImageToVideoPipeline.from_pretrained(folder)
    shape = (1, 4, (FRAMES - 1) // 4 + 1, BUCKET_H // 16, BUCKET_W // 16)
    noise = torch.from_numpy(latent_ops.initial_noise(SEED, shape))
    with torch.no_grad():
        want = pipe(
            image=Image.fromarray(picture),
            prompt=PROMPT,
            num_frames=FRAMES,
            num_inference_steps=STEPS,
            latents=noise,
            output_type="np",
        ).frames[0]

    encoded, write_mp4 = [], engine_module._mp4
    monkeypatch.setattr(
        engine_module, "_mp4", lambda frames, fps: encoded.append(frames) or write_mp4(frames, fps)
    )

    # `jaxdit serve`'s start-up shapes against the pictures the warm-up sends, before anything loads.
    def start_up(*flags: str):
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        argv = ["--emulate_devices", "2", "--port", "0", "--weights", str(folder), "--use_cfg_parallel"]
        return command.check(parser.parse_args([*argv, "--frames", str(FRAMES), *flags]))

    assert start_up("--sizes", "64x48", "--image_sizes", "56x40").sizes == ((64, 48),)
    assert start_up("--sizes", "64x64").sizes == ((64, 64),)  # a 64 x 64 grey frame: the square bucket
    with pytest.raises(ValueError, match="size bucket 48x64"):
        start_up("--sizes", "80x48", "--image_sizes", "56x40")

    config = ParallelConfig(cfg=2)
    engine = Engine.load(str(folder), config.make_mesh(jax.devices()[: config.num_devices]))
    assert engine.card.kind == "video" and engine.card.images == (1, 1)
    assert engine.card.default_size == (80, 48)  # a 16:9 picture's bucket; a job's picture decides its own
    engine.warm_up([engine.request_for(BUCKET_W, BUCKET_H, 1, FRAMES, STEPS, pictures=(PICTURE[::-1],))])
    encoded.clear()  # the warm-up's video
    service = Service(Scheduler(engine, Metrics()))
    url = f"http://127.0.0.1:{service.port}"
    body = {"prompt": PROMPT, "num_frames": FRAMES, "steps": STEPS, "seed": SEED}
    try:
        refusals = {
            "no first frame": (body, "image is required"),
            "an 8 x 200 first frame": (
                {**body, "image": _png(np.zeros((8, 200, 3), np.uint8))},
                "aspect ratio is beyond 8:1",
            ),
            "another size": ({**body, "image": _png(picture), "size": "48x48"}, "size bucket"),
        }
        for what, (bad, says) in refusals.items():
            code, answer = _call(f"{url}/v1/videos", "POST", bad)
            error = json.loads(answer)["error"]
            assert code == 400 and says in error["message"], (what, code, answer)
            assert error["param"] == ("size" if what == "another size" else "image"), (what, error)
        assert not encoded  # refused before any job ran
        code, answer = _call(f"{url}/v1/videos", "POST", {**body, "image": _png(picture)})
        assert code == 200, answer
        job_id = json.loads(answer)["id"]
        job = _wait(url, job_id)
        assert job["status"] == "completed" and job["steps_done"] == STEPS, job
        code, mp4 = _call(f"{url}/v1/videos/{job_id}/content")
    finally:
        service.stop()
    assert code == 200 and mp4[4:8] == b"ftyp"
    (frames,) = encoded
    assert frames.dtype == np.uint8 and frames.shape == want.shape == (FRAMES, BUCKET_H, BUCKET_W, 3)
    _check_frames(frames, want, "hunyuanvideo1.5_i2v")
