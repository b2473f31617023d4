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

    def check(*flags: str):
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        return command.check(parser.parse_args(["--emulate_devices", "2", "--port", "0", *flags]))

    assert check("--caches", "magcache, dbcache", "--use_cfg_parallel").caches == ("magcache", "dbcache")
    with pytest.raises(ValueError, match="--caches 'magcash': magcash; the caches are dbcache, fbcache"):
        check("--caches", "magcash", "--use_cfg_parallel")
    with pytest.raises(ValueError, match="cannot serve --caches magcache: .*pipefusion"):
        check("--caches", "magcache", "--pipefusion_parallel_degree", "2")
