"""``jaxdit serve``'s engine on a tiny Z-Image folder (ring2 x ulysses2): a Turbo request (guidance 0,
one branch) and a guided one give the pictures the pipeline gives for the same call, and any guidance
above 0 counts as classifier-free guidance, as diffusers' ``ZImagePipeline`` decides it."""

from __future__ import annotations

import dataclasses
import io

import jax
import numpy as np
import pytest
import z_image_tiny as tiny
from PIL import Image

from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines import output
from jaxdit.serve.engine import Engine, EngineLimits


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zimage") / "Z-Image-tiny"
    tiny.pipeline(folder)
    mesh = ParallelConfig(ring=2, ulysses=2).make_mesh(jax.devices()[:4])
    return Engine.load(str(folder), mesh, limits=EngineLimits(max_steps=8))


@pytest.mark.parametrize("guidance", [0.0, 0.5])
def test_engine_pictures_are_the_pipelines(engine, guidance):
    g = dataclasses.replace(engine.request_for(48, 32, steps=3), prompt="a red car", guidance=guidance)
    engine.check(g)
    assert engine.uses_cfg(g) == (guidance > 0)
    served = np.asarray(Image.open(io.BytesIO(engine.generate(g).files[0])))
    call = engine.call(g)
    want = output.to_uint8(engine.pipe.generate(call).images)[0]
    assert served.shape == (32, 48, 3)
    np.testing.assert_array_equal(served, want)
