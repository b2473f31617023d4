"""``jaxdit serve``'s engine on a tiny FLUX.2 [klein] folder (ring2 x ulysses2, text-to-image): a request
to the distilled model and a guided one to the base model give the pictures the pipeline gives for the
same call (the distilled model runs one branch whatever the scale, as diffusers' ``Flux2KleinPipeline``
does; the base model guides for a scale above 1). The engine's program key counts the branches the
pipeline runs: one for the distilled model at scale 4 (the family's ``uses_cfg`` reads the folder's
``is_distilled``), two for the base model, as many as the prepared text batch holds per picture."""

from __future__ import annotations

import dataclasses
import io

import flux2_klein_tiny as tiny
import jax
import numpy as np
import pytest
from PIL import Image

from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines import output
from jaxdit.serve.engine import Engine, EngineLimits

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2serve")
    distilled = tiny.pipeline(root / "klein")
    return {"distilled": distilled, "base": tiny.base_copy(distilled, root / "klein-base")}


@pytest.mark.parametrize("kind, guidance", [("distilled", 4.0), ("base", 3.0)])
def test_engine_pictures_are_the_pipelines(folders, kind, guidance):
    mesh = ParallelConfig(ring=2, ulysses=2).make_mesh(jax.devices()[:4])
    engine = Engine.load(str(folders[kind]), mesh, limits=EngineLimits(max_steps=8))
    g = dataclasses.replace(engine.request_for(48, 32, steps=3), prompt="a red car", guidance=guidance)
    engine.check(g)
    guided = kind == "base"
    assert engine.uses_cfg(g) is guided
    assert engine.shape_key(g)[engine.shape_fields.index("guidance")] is guided
    inputs = engine.pipe.prepare(engine.call(g)).inputs
    assert inputs.cfg is guided
    assert len(inputs.context["encoder_hidden_states"]) == g.n * (2 if guided else 1)
    served = np.asarray(Image.open(io.BytesIO(engine.generate(g).files[0])))
    want = output.to_uint8(engine.pipe.generate(engine.call(g)).images)[0]
    assert served.shape == (32, 48, 3)
    np.testing.assert_array_equal(served, want)
