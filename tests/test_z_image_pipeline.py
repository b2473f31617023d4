"""Z-Image's pipeline against diffusers' ``ZImagePipeline`` from the same tiny saved folder
(``z_image_tiny.pipeline``: random weights, offline tokenizer) with the project's noise (numpy
``default_rng(seed).standard_normal`` in the latent grid): two prompts of different lengths, Turbo
without guidance on ulysses2 x ring2, the base model's guidance (with truncation) on cfg2 x ulysses2 and its norm-capped guidance on
ulysses2 x ring2.
Final latents within 1e-4 relative, pictures within 1.5/255."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import z_image_tiny as tiny

from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.z_image import ZImagePipeline

FAST = {"xla_backend_optimization_level": 0}  # quick CPU compiles; numerics are what is tested
PROMPTS = ["a photo of a cat on a mat", "a big blue house with a tree at sunset and a small dog on a red mat"]
HEIGHT, WIDTH, STEPS, SEED = 32, 48, 3, 7


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zimage") / "Z-Image-tiny"
    tiny.pipeline(folder)
    return folder


_REFERENCES: dict[str, tuple] = {}


def _diffusers(folder, **call):
    """diffusers' latents and pictures for this call, computed once per call in this file."""
    key = repr(sorted(call.items()))
    if key not in _REFERENCES:
        _REFERENCES[key] = _diffusers_run(folder, **call)
    return _REFERENCES[key]


def _diffusers_run(folder, **call):
    import torch
    from diffusers import ZImagePipeline as Reference

    pipe = Reference.from_pretrained(folder)
    noise = latent_ops.initial_noise(SEED, (len(PROMPTS), 4, HEIGHT // 2, WIDTH // 2))
    common = dict(
        height=HEIGHT, width=WIDTH, num_inference_steps=STEPS, latents=torch.from_numpy(noise), **call
    )
    # diffusers writes the chat template into the prompt lists it is given: fresh lists for each call.
    fresh = lambda: {k: list(v) if isinstance(v, list) else v for k, v in common.items()}  # noqa: E731
    with torch.no_grad():
        lat = pipe(list(PROMPTS), output_type="latent", **fresh()).images.numpy()
        img = pipe(list(PROMPTS), output_type="np", **fresh()).images
    return lat, np.asarray(img)


def _ours(folder, pc, **call):
    pipe = ZImagePipeline.from_pretrained(
        folder, pc.make_mesh(jax.devices()[: pc.num_devices]), compiler_options=FAST
    )
    out = pipe(
        list(PROMPTS),
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=STEPS,
        seed=SEED,
        progress=False,
        **call,
    )
    return out.latents, (np.asarray(out.images) + 1) / 2


def _check(got, want):
    (lat, img), (want_lat, want_img) = got, want
    err = float(np.abs(lat - want_lat).max() / np.abs(want_lat).max())
    pix = float(np.abs(img - want_img).max())
    print(f"latents {err:.2e} relative, pixels {pix * 255:.3f}/255")
    assert err <= 1e-4
    assert pix <= 1.5 / 255


def test_turbo_on_ulysses2_ring2_matches_diffusers(folder):
    _check(
        _ours(folder, ParallelConfig(ulysses=2, ring=2), guidance_scale=0.0),
        _diffusers(folder, guidance_scale=0.0),
    )


def test_base_guidance_with_truncation_on_cfg2_ulysses2_matches_diffusers(folder):
    call = dict(guidance_scale=2.0, cfg_truncation=0.5, negative_prompt=["blue sky", "a dog"])
    _check(_ours(folder, ParallelConfig(cfg=2, ulysses=2), **call), _diffusers(folder, **call))


def test_base_guidance_normalised_on_ring2_ulysses2_matches_diffusers(folder):
    """``cfg_normalization=True`` caps each image's guided norm at its positive prediction's: the norms
    add over the sequence shards and skip the pad tokens; without the cap diffusers lands elsewhere."""
    call = dict(guidance_scale=4.0, cfg_normalization=True)
    want = _diffusers(folder, **call)
    _check(_ours(folder, ParallelConfig(ring=2, ulysses=2), **call), want)
    uncapped = _diffusers(folder, guidance_scale=4.0)[0]
    assert np.abs(uncapped - want[0]).max() > 100 * 1e-4 * np.abs(want[0]).max()


def test_data2_tensor2_splits_the_two_prompts_and_matches_diffusers(folder):
    """Data parallelism: the batch's rows (two prompts of different caption lengths, both CFG branches)
    split over the data axis, each keeping its own caption length; the guided norm cap stays per image."""
    call = dict(guidance_scale=4.0, cfg_normalization=True)
    _check(_ours(folder, ParallelConfig(data=2, tensor=2), **call), _diffusers(folder, **call))


def test_turbo_refuses_cfg_parallel(folder):
    pipe = ZImagePipeline.from_pretrained(folder, ParallelConfig(cfg=2).make_mesh(jax.devices()[:2]))
    with pytest.raises(ValueError, match="cfg=2 .*runs no classifier-free guidance"):
        pipe(PROMPTS, height=HEIGHT, width=WIDTH, num_inference_steps=1, guidance_scale=0.0, progress=False)


def test_embeddings_of_the_wrong_width_are_named(folder):
    pipe = ZImagePipeline.from_pretrained(folder, ParallelConfig().make_mesh(jax.devices()[:1]))
    with pytest.raises(ValueError, match=r"shape \(7, 16\): this model takes \[L_i, 32\]"):
        pipe(prompt_embeds=[np.zeros((7, 16), np.float32)], height=HEIGHT, width=WIDTH, guidance_scale=0.0)
