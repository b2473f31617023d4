"""First-Block-Cache on Z-Image (``jaxdit.cache``): the tiny saved ``ZImagePipeline`` folder, Turbo
(no guidance) and the base model's guidance, on one device and on meshes. The cache's first block is the
noise refiner's first block (the first stack jaxdit's cache runs), its metric the image stream.

The random model's block-0 residual changes by ~1.19-1.50 a step; threshold 1.35 skips some steps and
runs others (each ratio measured is >= 0.01 from it, far above rounding). A threshold of 1e-6 runs every step: exactly the uncached run.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import tolerance as tol
import z_image_tiny as tiny

from jaxdit.cache import FirstBlockCache, TeaCache
from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines.z_image import ZImagePipeline

CALL = dict(height=32, width=48, num_inference_steps=6, progress=False, output_type="latent")
FAST = {"xla_backend_optimization_level": 0}  # quick CPU compiles; numerics are what is tested
PROMPT = "a photo of a cat on a mat"


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zimage") / "Z-Image-tiny"
    tiny.pipeline(folder)
    make = (
        lambda pc: ZImagePipeline.from_pretrained(  # noqa: E731
            folder, pc.make_mesh(jax.devices()[: pc.num_devices]), compiler_options=FAST
        )
    )
    return (
        make(ParallelConfig()),
        make(ParallelConfig(ring=2, ulysses=2)),
        make(ParallelConfig(cfg=2, ulysses=2)),
    )


def test_a_tiny_threshold_is_the_uncached_run(pipes):
    _, mesh, _ = pipes
    plain = mesh(PROMPT, guidance_scale=0.0, **CALL)
    cached = mesh(PROMPT, guidance_scale=0.0, cache=FirstBlockCache(threshold=1e-6), **CALL)
    assert cached.cache.ran.all() and cached.cache.devices_agree
    np.testing.assert_array_equal(cached.latents, plain.latents)


@pytest.mark.parametrize("guidance", [0.0, 2.0], ids=["turbo", "base-cfg"])
def test_skips_the_same_steps_on_every_mesh(pipes, guidance):
    one, ring_ulysses, cfg_ulysses = pipes
    mesh = cfg_ulysses if guidance else ring_ulysses
    want = one(PROMPT, guidance_scale=guidance, cache=FirstBlockCache(threshold=1.35), **CALL)
    got = mesh(PROMPT, guidance_scale=guidance, cache=FirstBlockCache(threshold=1.35), **CALL)
    print(f"decisions {want.cache.ran.astype(int)} ratios {np.round(want.cache.ratios, 3)}")
    assert 0 < want.cache.full_steps < CALL["num_inference_steps"]
    assert got.cache.ran.tolist() == want.cache.ran.tolist() and got.cache.devices_agree
    tol.check(got.latents, want.latents, tol.SAME_SEED, "Z-Image First-Block-Cache, mesh vs one device")
    uncached = one(PROMPT, guidance_scale=guidance, **CALL).latents
    assert np.abs(uncached - want.latents).max() > 1e-3 * np.abs(uncached).max()  # skipping changed it


def test_teacache_names_what_it_lacks(pipes):
    _, mesh, _ = pipes
    with pytest.raises(ValueError, match="TeaCache is not available for Z"):
        mesh(PROMPT, guidance_scale=0.0, cache=TeaCache(), **CALL)
