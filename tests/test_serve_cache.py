"""``jaxdit serve`` with a feature cache per request, on the bundled tiny-digits (cfg2: the two guidance
branches on two devices).

One engine allows MagCache and First-Block-Cache and compiles both at their default thresholds at
start-up (as ``jaxdit serve --caches magcache,fbcache`` does). A request naming MagCache at another
threshold is served by the same program (its plan is data) and answers the picture ``pipe(...,
cache=MagCache(threshold=...))`` draws; First-Block-Cache's threshold is traced into its step, so a new one
is a new shape (refused under ``--new_shapes refuse``). Bad cache fields get a 400 naming the field before
any device runs.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from PIL import Image  # noqa: E402

from jaxdit.cache import MagCache  # noqa: E402
from jaxdit.mesh import ParallelConfig  # noqa: E402
from jaxdit.pipelines.output import to_uint8  # noqa: E402
from jaxdit.serve import schema  # noqa: E402
from jaxdit.serve.command import Service  # noqa: E402
from jaxdit.serve.engine import Engine  # noqa: E402
from jaxdit.serve.jobs import Scheduler  # noqa: E402
from jaxdit.serve.metrics import Metrics, compile_counts, listen_for_compiles  # noqa: E402

CONFIG = ParallelConfig(cfg=2)
CACHES = ("magcache", "fbcache")
STEPS = 12


@pytest.fixture(scope="module")
def engine() -> Engine:
    listen_for_compiles()
    mesh = CONFIG.make_mesh(jax.devices()[: CONFIG.num_devices])
    engine = Engine.load(None, mesh, caches=CACHES)
    engine.warm_up([engine.request_for(16, 16, steps=STEPS, cache=c) for c in (None, *CACHES)])
    return engine


@pytest.fixture(scope="module")
def server(engine):
    service = Service(Scheduler(engine, Metrics()))
    yield f"http://127.0.0.1:{service.port}"
    service.stop()


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url + "/v1/images/generations", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _pixels(answer: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(answer["data"][0]["b64_json"]))))


def test_magcache_thresholds_share_one_program_and_match_pipe(engine, server):
    """Two MagCache thresholds: no compilation after start-up, each answer the picture ``pipe`` draws with
    that threshold directly (a path that skips the request plumbing), and the higher threshold skips more."""
    before = compile_counts()[0]
    plain = engine.request_for(16, 16, steps=STEPS)
    skipped = []
    for threshold in (0.05, 0.5):
        code, answer = _post(
            server,
            {"prompt": plain.prompt, "steps": STEPS, "cache": "magcache", "cache_threshold": threshold},
        )
        assert code == 200, answer
        direct = engine.pipe.generate(engine.call(plain).replace(cache=MagCache(threshold=threshold)))
        reference = to_uint8(direct.images)[0]
        assert np.array_equal(np.asarray(Image.fromarray(reference)), _pixels(answer)), threshold
        assert direct.cache.devices_agree
        skipped.append(direct.cache.skipped_blocks)
    assert skipped[1] > skipped[0], skipped
    assert compile_counts()[0] == before, "a MagCache threshold compiled a new program"


def test_a_new_traced_threshold_is_a_new_shape(engine, server):
    """First-Block-Cache's threshold is in its step: the default is served, another one refused by name."""
    code, answer = _post(server, {"prompt": "3", "steps": STEPS, "cache": "fbcache"})
    assert code == 200, answer
    code, answer = _post(server, {"prompt": "3", "steps": STEPS, "cache": "fbcache", "cache_threshold": 0.9})
    assert code == 400 and answer["error"]["param"] == "cache", answer
    assert "steps fbcache threshold 0.9 with CFG was not compiled at start-up" in answer["error"]["message"]


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"cache": "dbcache"}, "cache", "allows the feature caches magcache, fbcache"),
        ({"cache": 3}, "cache", "allows the feature caches"),
        ({"cache": "magcache", "cache_threshold": -0.1}, "cache_threshold", "finite number in (0, 1]"),
        ({"cache": "magcache", "cache_threshold": 0}, "cache_threshold", "finite number in (0, 1]"),
        ({"cache": "magcache", "cache_threshold": 1e9}, "cache_threshold", "finite number in (0, 1]"),
        ({"cache": "magcache", "cache_threshold": "0.1"}, "cache_threshold", "must be a number"),
        ({"cache": "magcache", "cache_threshold": True}, "cache_threshold", "must be a number"),
        ({"cache_threshold": 0.1}, "cache_threshold", "needs a cache"),
    ],
)
def test_bad_cache_fields_are_refused_by_name(engine, body, param, words):
    with pytest.raises(schema.RequestError) as refused:
        schema.image_request({"prompt": "4", **body}, engine.card)
    assert refused.value.param == param and words in refused.value.message, refused.value.message


def test_non_finite_threshold_over_http_and_a_server_without_caches(engine, server):
    """NaN (Python's JSON reads it) never reaches the devices; a card without caches names the flag."""
    request = urllib.request.Request(
        server + "/v1/images/generations",
        b'{"prompt": "4", "cache": "magcache", "cache_threshold": NaN}',
        {"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 400
    assert json.loads(refused.value.read())["error"]["param"] == "cache_threshold"
    bare = schema.ModelCard("tiny", schema.IMAGE, (16, 16), 16, 8, None)
    with pytest.raises(schema.RequestError, match=r"none \(start it with --caches"):
        schema.image_request({"prompt": "4", "cache": "magcache"}, bare)


def test_serve_caches_flag_checked_before_anything_loads():
    import argparse

    from jaxdit.serve import command

    def check(*flags: str, devices: int = 2):
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        return command.check(parser.parse_args(["--emulate_devices", str(devices), "--port", "0", *flags]))

    assert check("--caches", "magcache, dbcache", "--use_cfg_parallel").caches == ("magcache", "dbcache")
    with pytest.raises(ValueError, match="--caches 'magcash': magcash; the caches are dbcache, fbcache"):
        check("--caches", "magcash", "--use_cfg_parallel")
    assert check("--caches", "magcache,taylorseer", *PF_FLAGS, devices=4).caches == ("magcache", "taylorseer")
    # The caches that decide from the data cannot run on PipeFusion: refused with the reason, by name.
    with pytest.raises(ValueError, match="cannot serve --caches fbcache: .*First-Block-Cache decides"):
        check("--caches", "magcache,fbcache", *PF_FLAGS, devices=4)


#: A PipeFusion mesh (pipefusion2 x ulysses2) with one synchronous warm-up step, as the server takes it.
PF_FLAGS = ("--pipefusion_parallel_degree", "2", "--ulysses_degree", "2", "--warmup_steps", "1")
PF_STEPS = 8


def test_pipefusion_mesh_serves_host_planned_caches_with_one_program_per_step_count():
    """On a PipeFusion mesh MagCache and TaylorSeer are served: after start-up (each compiled at its
    default) two MagCache thresholds whose plans have different counts of full steps run the same
    programs (the plan, its length included, is data of the pipelined loop), and each answer is the
    picture ``pipe(..., cache=MagCache(threshold=...))`` draws."""
    listen_for_compiles()
    programs = lambda: sum(compile_counts())  # noqa: E731 (a program loaded from the disk cache counts too)
    start = programs()
    mesh = ParallelConfig(pipefusion=2, ulysses=2).make_mesh(jax.devices()[:4])
    engine = Engine.load(None, mesh, caches=("magcache", "taylorseer"), warmup_steps=1)
    warm = [engine.request_for(16, 16, steps=PF_STEPS, cache=c) for c in ("magcache", "taylorseer")]
    engine.warm_up(warm)
    before = programs()
    assert before > start, "the start-up compiled nothing: the count would not see a new program"
    plain = engine.request_for(16, 16, steps=PF_STEPS)
    full_steps = []
    for threshold in (0.1, 0.6):
        g = dataclasses.replace(plain, cache="magcache", cache_threshold=threshold)
        assert engine.shape_key(g) == engine.shape_key(warm[0]), "a threshold changed the served shape"
        served = engine.generate(g)
        direct = engine.pipe.generate(engine.call(plain).replace(cache=MagCache(threshold=threshold)))
        assert np.array_equal(to_uint8(direct.images)[0], np.asarray(Image.open(io.BytesIO(served.files[0]))))
        assert direct.cache.setting.endswith("under PipeFusion (host plan)"), direct.cache.setting
        full_steps.append(int(direct.cache.ran.sum()))
    print(f"\nfull steps of {PF_STEPS} at MagCache 0.1 / 0.6: {full_steps}")
    assert full_steps[0] > full_steps[1], full_steps  # two plans of different lengths, one program
    assert programs() == before, "a MagCache threshold on PipeFusion compiled a new program"
