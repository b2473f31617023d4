"""``jaxdit serve`` on a tiny FLUX.2 [klein] folder (``flux2_klein_tiny.py``, ulysses2 x ring2) with two
reference pictures of different sizes sent base64-encoded (one with a data-URL prefix) in the request
body: the card takes 0 to 3 pictures (the family's "several", the server's ``max_images``), the checked
request carries both pictures' sizes, and the served picture is the one the pipeline makes from the same
files (the editing path's reference tokens through the serve seam, not text-to-image); a picture under
the pipeline's 64-pixel side is refused at validation (the family's ``picture_problem``), not on the
devices."""

from __future__ import annotations

import base64
import io

import flux2_klein_tiny as tiny
import jax
import numpy as np
import pytest
from PIL import Image

from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines import output
from jaxdit.serve import schema
from jaxdit.serve.engine import Engine, EngineLimits

pytest.importorskip("diffusers")

FAST = {"xla_backend_optimization_level": 0}
W, H = 48, 32
BODY = dict(prompt="a red car", size=f"{W}x{H}", steps=3, seed=7, guidance=1.0)


def _png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def test_served_edit_with_two_references_is_the_pipelines(tmp_path):
    folder = tiny.pipeline(tmp_path / "klein")
    mesh = ParallelConfig(ulysses=2, ring=2).make_mesh(jax.devices()[:4])
    engine = Engine.load(str(folder), mesh, limits=EngineLimits(max_steps=8), compiler_options=FAST)
    assert engine.card.images == (0, 3)
    rng = np.random.default_rng(3)
    files = [_png(rng.integers(0, 256, shape, np.uint8)) for shape in ((64, 80, 3), (68, 68, 3))]
    texts = [base64.b64encode(f).decode("ascii") for f in files]
    g = schema.image_request({**BODY, "image": [texts[0], "data:image/png;base64," + texts[1]]}, engine.card)
    assert g.image_sizes == ((80, 64), (68, 68))
    engine.check(g)
    small = base64.b64encode(_png(np.zeros((40, 56, 3), np.uint8))).decode("ascii")
    with pytest.raises(schema.RequestError, match="image\\[1\\] is 56x40 pixels, .* at least 64 pixels"):
        schema.image_request({**BODY, "image": [texts[0], small]}, engine.card)  # the pipeline's limit
    served = np.asarray(Image.open(io.BytesIO(engine.generate(g).files[0])))
    pictures = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    want = engine.pipe(
        pictures,
        BODY["prompt"],
        height=H,
        width=W,
        num_inference_steps=3,
        guidance_scale=1.0,
        seed=7,
        progress=False,
    ).images
    assert served.shape == (H, W, 3)
    np.testing.assert_array_equal(served, output.to_uint8(want)[0])
