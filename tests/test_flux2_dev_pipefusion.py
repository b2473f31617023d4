"""FLUX.2 [dev]'s pipelined PipeFusion phase (stale K/V) against the serial reference of the same semantics
on the unsharded model (``flux2_pipefusion_reference.py``, klein's test's reference), with the guidance
input dev's pipeline prepares: pipefusion2 x ulysses2, 4 patches of 2 image rows, one warm-up step then
three pipelined ones, two reference pictures (a 145-token chunk each patch, padded to 146 for the 2
sequence shards).

The tiny dev transformer (``flux2_tiny``, a guidance embedding) is saved by diffusers and loaded by
``load_model`` into both layouts (PipeFusion's stage slots and the plain model); the pipeline takes
prompt embeddings and a fixed stand-in for the VAE encoder (4 x 4 mean pools of the pixels through a fixed
linear map: the reference tokens are context, what makes them does not matter here). Guidance matters:
the serial reference at another scale differs, so a pipelined phase that dropped or misplaced the guidance
input fails the comparison.
"""

from __future__ import annotations

import flux2_tiny
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol
from flux2_pipefusion_reference import serial_stale_kv
from PIL import Image
from pipefusion_helpers import six_step_cache

from converters.flux2 import CHECKPOINTS
from jaxdit.mesh import DeviceMesh, ParallelConfig
from jaxdit.pipelines.assemble import load_model
from jaxdit.pipelines.flux2_dev import Flux2Pipeline
from jaxdit.pipelines.pipefusion.flux2 import PipeFusionFlux2
from jaxdit.pipelines.request import GenerationRequest

pytest.importorskip("diffusers")

FAST = {"xla_backend_optimization_level": 0}
PATCHES = 4
FACTOR = 2  # the stand-in VAE's factor: 4 pixels per packed token, as klein's tiny folder
CHANNELS = flux2_tiny.CONFIG["in_channels"]


@pytest.fixture(scope="module")
def transformer(tmp_path_factory):
    path = tmp_path_factory.mktemp("flux2devpf") / "transformer"
    flux2_tiny.transformer(seed=66).save_pretrained(path)
    return path


def _encode_image(pixels: np.ndarray) -> tuple[np.ndarray, int, int]:
    """[1, 3, H, W] -> ([1, H/4 * W/4, C] tokens, H/4, W/4): 4 x 4 mean pools through a fixed map."""
    mix = np.random.default_rng(5).standard_normal((3, CHANNELS)).astype(np.float32)
    _, _, h, w = pixels.shape
    f = 2 * FACTOR
    pooled = pixels[0].reshape(3, h // f, f, w // f, f).mean((2, 4)).reshape(3, -1).T
    return (pooled @ mix + 0.1)[None], h // f, w // f


def _pipeline(path, parallel: ParallelConfig, devices) -> Flux2Pipeline:
    where = DeviceMesh.of(parallel.make_mesh(devices))
    model = load_model(path, where, jnp.float32, CHECKPOINTS, staged=PipeFusionFlux2)
    return Flux2Pipeline(
        model, where, encode_image=_encode_image, vae_scale_factor=FACTOR, compiler_options=FAST
    )


@pytest.fixture(scope="module")
def call():
    """Two pictures of 68 x 68 pixels: 17 x 17 = 289 reference tokens each, 578 in all."""
    rng = np.random.default_rng(12)
    pictures = [Image.fromarray(rng.integers(0, 256, (68, 68, 3), dtype=np.uint8)) for _ in range(2)]
    text = rng.standard_normal((1, 40, flux2_tiny.CONFIG["joint_attention_dim"])).astype(np.float32)
    return dict(
        prompt_embeds=text, image=pictures, height=32, width=48, num_inference_steps=4, seed=3,
        guidance_scale=3.5,
    )  # fmt: skip


def test_dev_pipelined_pipefusion_matches_the_serial_reference(transformer, call):
    pipe = _pipeline(transformer, ParallelConfig(pipefusion=2, ulysses=2), jax.devices()[:4])
    one = _pipeline(transformer, ParallelConfig(), jax.devices()[:1])
    got = pipe(num_pipeline_patch=PATCHES, warmup_steps=1, output_type="latent", progress=False, **call)
    prepared = one.prepare(GenerationRequest.of(**call))
    context = prepared.inputs.context
    assert context["reference_hidden_states"].shape[1] == 578
    np.testing.assert_array_equal(context["guidance"], [3.5])
    want = prepared.to_latents(serial_stale_kv(one, prepared.inputs, PATCHES))
    serial = one(output_type="latent", progress=False, **call).latents
    other = one.prepare(GenerationRequest.of(**dict(call, guidance_scale=1.0)))
    unguided = other.to_latents(serial_stale_kv(one, other.inputs, PATCHES))
    err = float(np.abs(got.latents - want).max() / np.abs(want).max())
    drift = float(np.abs(serial - want).max() / np.abs(serial).max())
    moved = float(np.abs(unguided - want).max() / np.abs(want).max())
    print(
        f"pipelined vs serial reference {err:.2e}; the serial reference vs the plain run {drift:.2e}; "
        f"guidance 1 vs 3.5 in the reference {moved:.2e}"
    )
    tol.check(got.latents, want, tol.PIPEFUSION, "FLUX.2 [dev] pipelined PipeFusion vs the serial reference")
    assert drift > 1e-3  # stale K/V changed the result: the comparison is not the plain run's
    assert moved > 1e-3  # the guidance input matters: dropping it would fail the comparison


#: MagCache (made-up ratios, threshold 0.5) and TaylorSeer (interval 2, one warm-up step) over 6 steps.
DEV_CACHE_PLANS = {"magcache": [1, 0, 0, 1, 0, 0], "taylorseer": [1, 0, 1, 0, 1, 0]}


@pytest.mark.parametrize("name", list(DEV_CACHE_PLANS))
def test_dev_host_planned_cache_matches_the_serial_reference(transformer, call, tmp_path, name):
    """pipefusion2 x ulysses2 with a cache vs the serial reference with the same plan: a skipped step's
    output layer reads the step conditioning with dev's embedded guidance; the cache moves the result."""
    cache, order = six_step_cache(name, tmp_path)
    pipe = _pipeline(transformer, ParallelConfig(pipefusion=2, ulysses=2), jax.devices()[:4])
    one = _pipeline(transformer, ParallelConfig(), jax.devices()[:1])
    run = dict(call, num_inference_steps=6)
    pipe.check_pipefusion_cache(name)  # what pipe(...) checks: the pipeline class's pipefusion_caches
    got = pipe(
        num_pipeline_patch=PATCHES, warmup_steps=1, output_type="latent", progress=False, cache=cache, **run
    )
    print(f"\n{name}: {got.cache.describe()}")
    plan = DEV_CACHE_PLANS[name]
    np.testing.assert_array_equal(got.cache.ran, np.asarray(plan, bool))
    prepared = one.prepare(GenerationRequest.of(**run))
    want = prepared.to_latents(
        serial_stale_kv(one, prepared.inputs, PATCHES, tuple(bool(r) for r in plan), order)
    )
    uncached = prepared.to_latents(serial_stale_kv(one, prepared.inputs, PATCHES))
    err = tol.check(got.latents, want, tol.PIPEFUSION, f"FLUX.2 [dev] {name} vs the serial reference")
    drift = tol.max_error(got.latents, uncached)
    print(f"vs the serial reference {err:.1e}; vs uncached PipeFusion {drift:.1e}")
    assert drift > 100 * tol.PIPEFUSION.allowed(np.abs(want).max())
