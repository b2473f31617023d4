"""The diffusers call arguments every pipeline takes: latents=, output_type="pil", num_images_per_prompt."""

import jax
import numpy as np
import pytest
from PIL import Image

from jaxdit import ParallelConfig
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.base import to_pil
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.pipelines.tiny_digits import tiny_digits

CALL = dict(height=16, width=16, num_inference_steps=3, progress=False)


@pytest.fixture(scope="module")
def pipe():
    return tiny_digits(ParallelConfig(ulysses=2).make_mesh(jax.devices()[:2]))


def test_latents_replace_the_seeds_noise(pipe):
    seeded = pipe(["3", "5"], seed=4, **CALL)
    noise = latent_ops.initial_noise(4, (2, 1, 16, 16))
    given = pipe(["3", "5"], latents=noise, seed=123, **CALL)  # the seed is then unused
    np.testing.assert_array_equal(given.latents, seeded.latents)
    other = pipe(["3", "5"], latents=noise[::-1].copy(), **CALL)
    assert np.abs(other.latents - seeded.latents).max() > 0.1
    with pytest.raises(
        ValueError, match=r"latents have shape \(1, 1, 16, 16\); this request needs \(2, 1, 16, 16\)"
    ):
        pipe(["3", "5"], latents=noise[:1], **CALL)


def test_output_type_pil(pipe):
    out = pipe(["1", "2"], output_type="pil", **CALL)
    arrays = pipe(["1", "2"], **CALL)
    assert isinstance(out.images, list) and all(isinstance(i, Image.Image) for i in out.images)
    expected = np.round((np.clip(arrays.images, -1, 1) + 1) * 127.5).astype(np.uint8)
    np.testing.assert_array_equal(np.stack([np.asarray(i) for i in out.images]), expected)
    videos = to_pil(np.zeros((1, 3, 4, 4, 3)))
    assert len(videos) == 1 and len(videos[0]) == 3 and videos[0][0].size == (4, 4)
    with pytest.raises(ValueError, match="output_type must be one of np, pil, latent"):
        pipe("1", output_type="torch", **CALL)


def test_num_images_per_prompt_repeats_each_prompt_as_diffusers(pipe):
    out = pipe(["0", "7"], num_images_per_prompt=2, **CALL)
    assert out.images.shape == (4, 16, 16)
    # Rows are (prompt, image): diffusers repeats each prompt's embeddings n times, consecutively, and
    # draws one noise sample per row; row i equals the row i of a call with the expanded prompt list.
    expanded = pipe(["0", "0", "7", "7"], **CALL)
    np.testing.assert_array_equal(out.latents, expanded.latents)
    with pytest.raises(ValueError, match="num_images_per_prompt must be >= 1"):
        pipe("0", num_images_per_prompt=0, **CALL)


def test_sizes_default_to_what_the_model_draws(pipe):
    """The bundled model draws 16x16 (it took FLUX's 1024x1024: a 4096-token run of a 16x16 model);
    FLUX itself keeps diffusers' 1024x1024."""
    out = pipe("4", num_inference_steps=2, progress=False)
    assert out.images.shape == (1, 16, 16)
    assert type(pipe).call_defaults()["height"] == type(pipe).call_defaults()["width"] == 1024


def test_request_rejects_non_finite_numbers():
    with pytest.raises(ValueError, match="true_cfg_scale must be a finite number"):
        GenerationRequest(true_cfg_scale=float("nan")).check()
    with pytest.raises(ValueError, match="latents hold NaN or inf"):
        GenerationRequest(latents=np.full((1, 1, 2, 2), np.inf)).check()


def test_generate_dtype_reaches_the_bundled_model():
    """``jaxdit generate --dtype bfloat16`` on tiny-digits (it was silently float32)."""
    import jax.numpy as jnp

    from jaxdit.generate import GenerateRequest, build

    pipe = build(GenerateRequest(dtype="bfloat16"), ParallelConfig().make_mesh(jax.devices()[:1]))
    assert pipe.model.dtype == jnp.bfloat16
    out = pipe("3", num_inference_steps=2, progress=False)
    assert out.images.shape == (1, 16, 16) and np.isfinite(out.images).all()
