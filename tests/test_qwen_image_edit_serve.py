"""``jaxdit serve`` with input pictures, on the tiny Qwen-Image-Edit-2509 folder of
``qwen_image_edit_folder.py`` (ulysses2, fp32): the card takes 1 to 3 pictures (the family's
``image_count``, the server's ``max_images``); two pictures sent base64-encoded in the JSON body (one with
a data-URL prefix) come back as the picture the pipeline makes from the same files; the warm-up request
brings its own grey picture; and hostile bodies (truncated base64, a truncated file, a non-picture, a GIF,
a 16-bit picture, an oversize picture, a picture too narrow for the pipeline's resizing, too many or no
pictures, an oversize body) each get one 4xx naming ``image`` (or ``body``), and none reaches the devices.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import re
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest
from PIL import Image

pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import qwen_image_edit_folder as edit_folder  # noqa: E402

from jaxdit.mesh import ParallelConfig  # noqa: E402
from jaxdit.pipelines import output  # noqa: E402
from jaxdit.serve import schema  # noqa: E402
from jaxdit.serve.command import Service  # noqa: E402
from jaxdit.serve.engine import Engine, EngineLimits  # noqa: E402
from jaxdit.serve.jobs import Scheduler  # noqa: E402
from jaxdit.serve.metrics import Metrics  # noqa: E402

FAST = {"xla_backend_optimization_level": 0}
H, W = 32, 40
#: The test server's limits: pictures of at most 1000 pixels (the test's are 576 and 720), bodies of 64 KiB.
MAX_IMAGE_PIXELS, MAX_BODY = 1000, 64 << 10
BODY = dict(prompt="a red car at sunset", negative_prompt="a big dog", true_cfg_scale=4.0)
BODY.update(size=f"{W}x{H}", steps=2, seed=5)
#: A picture too narrow for the pipeline: at the tests' VAE area (64^2) its copy would be 0x320 pixels.
NARROW = (100, 4, 3)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(the engine, the two pictures' files as bytes, the folder)."""
    patch = pytest.MonkeyPatch()
    edit_folder.patch_areas(patch)
    saved = edit_folder.save(tmp_path_factory.mktemp("qwen_image_edit_serve"))
    mesh = ParallelConfig(ulysses=2).make_mesh(jax.devices()[:2])
    limits = EngineLimits(max_steps=8, max_image_pixels=MAX_IMAGE_PIXELS, max_body_bytes=MAX_BODY)
    engine = Engine.load(str(saved["folders"]["plus"]), mesh, limits=limits, compiler_options=FAST)
    yield engine, [p.read_bytes() for p in saved["paths"]], str(saved["folders"]["plus"])
    patch.undo()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _file(array: np.ndarray, format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=format)
    return buffer.getvalue()


def _post(url: str, body: dict | bytes) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match[1]) if match else 0.0


def test_the_card_takes_one_to_three_pictures_and_warm_up_brings_one(case):
    engine = case[0]
    card = engine.card
    assert (card.images, card.max_image_pixels, card.max_body_bytes) == ((1, 3), MAX_IMAGE_PIXELS, MAX_BODY)
    warm = engine.request_for(W, H, steps=2)  # the default: one grey picture of the output's size
    assert warm.image_sizes == ((W, H),)
    # `jaxdit serve --image_sizes 24x24+36x20`: the served request's pictures, so refuse-mode serves it
    served = engine.request_for(W, H, steps=2, pictures=((24, 24), (36, 20)))
    served = dataclasses.replace(served, negative_prompt=BODY["negative_prompt"], true_cfg_scale=4.0)
    engine.warm_up([warm, served])
    assert {engine.shape_key(warm), engine.shape_key(served)} <= engine.compiled
    assert "from 40x32" in engine.describe(engine.shape_key(warm))


def _hostile(files: list[bytes]) -> list[tuple[object, str]]:
    """(the ``image`` field, a word of the one error it must get)."""
    good = _b64(files[0])
    rng = np.random.default_rng(0)
    big = _file(rng.integers(0, 256, (40, 40, 3), np.uint8))
    narrow = _file(rng.integers(0, 256, NARROW, np.uint8))
    deep = io.BytesIO()
    Image.fromarray(rng.integers(0, 65535, (8, 8), np.uint16)).save(deep, format="PNG")  # mode I;16
    return [
        (good[:-3], "not valid base64"),  # truncated base64: its padding is gone
        (good[:10] + "!" + good[11:], "not valid base64"),
        (_b64(files[0][: len(files[0]) // 2]), "cannot be decoded"),  # a truncated file, valid base64
        (_b64(b"GIF? no: plain text, not a picture"), "not a PNG, JPEG or WebP picture"),
        (_b64(_file(rng.integers(0, 256, (8, 8, 3), np.uint8), "GIF")), "not a PNG, JPEG or WebP"),
        (_b64(deep.getvalue()), "mode I;16"),
        (_b64(big), "40x40 = 1600 pixels; this server takes at most 1000"),
        ([good] * 4, "takes 1 to 3 pictures, got 4"),
        ([], "takes 1 to 3 pictures, got 0"),
        (7, "must be a base64 string"),
        ("", "is empty"),
        # a narrow picture the pipeline's resizing cannot handle (its VAE copy would be 0 pixels wide)
        (_b64(narrow), "image is 4x100 pixels, which Qwen-Image-Edit-2509-tiny cannot take: its VAE copy"),
        ([good, _b64(narrow)], "image[1] is 4x100 pixels"),
    ]


def test_hostile_pictures_get_one_error_each_before_the_queue(case):
    engine, files = case[:2]
    for value, word in _hostile(files):
        with pytest.raises(schema.RequestError) as e:
            schema.image_request({**BODY, "image": value}, engine.card)
        assert (e.value.status, e.value.param) == (400, "image") and word in e.value.message, (
            word,
            e.value.message,
        )
    with pytest.raises(schema.RequestError, match="image is required: .* edits pictures"):
        schema.image_request(BODY, engine.card)
    one = dataclasses.replace(engine.card, images=(1, 1))  # the original Edit's card
    with pytest.raises(schema.RequestError, match="takes 1 pictures, got 2"):
        schema.image_request({**BODY, "image": [_b64(f) for f in files]}, one)
    none = dataclasses.replace(engine.card, images=(0, 0))  # a text-to-image model's
    with pytest.raises(schema.RequestError, match="takes no input pictures"):
        schema.image_request({**BODY, "image": _b64(files[0])}, none)


def test_served_edit_is_the_pipelines_and_hostile_bodies_never_reach_the_devices(case):
    engine, files = case[:2]
    metrics = Metrics()
    service = Service(Scheduler(engine, metrics))  # new shapes refused: the warm-up compiled this one
    url = f"http://127.0.0.1:{service.port}/v1/images/generations"
    try:
        for value, word in _hostile(files):
            code, answer = _post(url, {**BODY, "image": value})
            assert (code, answer["error"]["param"]) == (400, "image") and word in answer["error"]["message"]
        code, answer = _post(url, {**BODY, "image": "A" * MAX_BODY})  # over the body limit
        assert code == 413 and answer["error"]["param"] == "body", answer
        text = metrics.text().decode()
        assert _metric(text, "jaxdit_step_seconds_count") == 0, "a bad request reached the devices"
        rejected = _metric(text, 'jaxdit_requests_total{kind="image",outcome="rejected_bad_request"}')
        assert rejected == len(_hostile(files)) + 1
        images = [_b64(files[0]), "data:image/png;base64," + _b64(files[1])]
        code, answer = _post(url, {**BODY, "image": images})
        assert code == 200, answer
    finally:
        service.stop()
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(answer["data"][0]["b64_json"]))))
    pictures = [np.asarray(Image.open(io.BytesIO(f)).convert("RGB")) for f in files]
    call = {k: v for k, v in BODY.items() if k not in ("size", "steps")}
    want = engine.pipe(pictures, **call, height=H, width=W, num_inference_steps=2, progress=False).images
    assert served.shape == (H, W, 3)
    np.testing.assert_array_equal(served, output.to_uint8(want)[0])


def test_the_pipeline_refuses_the_narrow_picture_as_serve_does(case):
    """The limit serve checks is the pipeline's own: its call refuses the picture before any work."""
    engine, files = case[:2]
    good = np.asarray(Image.open(io.BytesIO(files[0])).convert("RGB"))
    narrow = np.zeros(NARROW, np.uint8)
    with pytest.raises(ValueError, match=r"input picture 1 \(4x100 pixels\): its VAE copy would be 0x320"):
        engine.pipe([good, narrow], prompt=BODY["prompt"], height=H, width=W, progress=False)
    assert engine.card.picture_problem(24, 24) is None  # the test's pictures are taken


def test_jaxdit_generate_refuses_the_narrow_picture_before_loading(case, tmp_path):
    from jaxdit.generate_checks import check_request
    from jaxdit.generate_request import GenerateRequest

    narrow = tmp_path / "narrow.png"
    Image.fromarray(np.zeros(NARROW, np.uint8)).save(narrow)
    with pytest.raises(
        ValueError, match=r"--image .*narrow.png is 4x100 pixels, which .* its VAE copy would be"
    ):
        check_request(GenerateRequest(weights=case[2], prompt="a car", image=str(narrow)), output=False)


def test_picture_flags_are_checked_before_anything_loads(case):
    import argparse

    from jaxdit.serve import command

    def check(*flags: str):
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        return command.check(
            parser.parse_args(["--emulate_devices", "2", "--ulysses_degree", "2", "--port", "0", *flags])
        )

    folder = case[2]
    plan = check("--weights", folder, "--image_sizes", "24x24+36x20,40x32", "--caches", "fbcache")
    assert plan.image_sizes == (((24, 24), (36, 20)), ((40, 32),)) and plan.caches == ("fbcache",)
    assert check("--weights", folder).image_sizes is None  # the start-up checks bring a picture
    with pytest.raises(ValueError, match="takes 1 to 3 pictures, got 4"):
        check("--weights", folder, "--image_sizes", "8x8+8x8+8x8+8x8")
    with pytest.raises(
        ValueError, match="--image_sizes 4x100: .* cannot edit it: its VAE copy would be 0x320"
    ):
        check("--weights", folder, "--image_sizes", "24x24+4x100")
    with pytest.raises(ValueError, match="--image_sizes takes WxH"):
        check("--weights", folder, "--image_sizes", "24")
    with pytest.raises(ValueError, match="--image_sizes: .* takes no input pictures"):
        check("--image_sizes", "24x24")  # the bundled tiny-digits
    for flag in ("--max_images", "--max_image_pixels"):
        with pytest.raises(ValueError, match=f"{flag} must be >= 1, got 0"):
            check(flag, "0")
    with pytest.raises(ValueError, match="--max_body_bytes must be >= 1024, got 10"):
        check("--max_body_bytes", "10")
