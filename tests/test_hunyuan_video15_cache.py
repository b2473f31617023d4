"""First-Block-Cache on HunyuanVideo 1.5 (``jaxdit.cache`` through the family's cache seam), on the tiny
saved ``HunyuanVideo15Pipeline`` folder from embeddings, 6 steps of CFG.

The cache starts at the first dual-stream block (``CACHE_FROM``: the token refiner runs every step) and
compares the video stream's residual there. A threshold of 1e-9 (the policy refuses 0) runs every step:
exactly the uncached run. A threshold the random model's residual changes cross skips some steps, and the
run on cfg2 x ulysses2 (one decision for both guidance branches, the video tokens split over ulysses)
takes the one-device run's decisions and latents.
diffusers registers no First-Block-Cache block for this transformer, so there is no diffusers reference.
"""

from __future__ import annotations

import hunyuan_video15_folder as hf
import jax
import numpy as np
import pytest
import tolerance as tol

from jaxdit.cache import FirstBlockCache, TeaCache
from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines.hunyuan_video15 import HunyuanVideo15Pipeline

CALL = dict(height=32, width=48, num_frames=5, num_inference_steps=6, output_type="latent", progress=False)
FAST = {"xla_backend_optimization_level": 0}  # quick CPU compiles; numerics are what is tested
THRESHOLD = 1.1  # the residual changes by 0.9-1.8 a step here (printed)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hunyuan_video15_cache") / "folder"
    hf.save(folder)
    emb = {**hf.embeddings([6], [2]), **hf.embeddings([3], [0], seed=1, prefix="negative_")}

    def make(pc):
        return HunyuanVideo15Pipeline.from_pretrained(
            folder, pc.make_mesh(jax.devices()[: pc.num_devices]), compiler_options=FAST
        )

    pipes = {pc.describe(): make(pc) for pc in (ParallelConfig(), ParallelConfig(cfg=2, ulysses=2))}
    return pipes, emb


def test_a_tiny_threshold_is_the_uncached_run(case):
    pipes, emb = case
    pipe = pipes["cfg2 x ulysses2"]
    plain = pipe(**emb, seed=3, **CALL)
    cached = pipe(**emb, seed=3, cache=FirstBlockCache(threshold=1e-9), **CALL)
    assert cached.cache.ran.all() and cached.cache.devices_agree and cached.cache.skipped_blocks == 0
    np.testing.assert_array_equal(cached.latents, plain.latents)


def test_skipping_on_a_mesh_takes_the_one_device_decisions(case):
    pipes, emb = case
    one = pipes["single device"]
    want = one(**emb, seed=3, cache=FirstBlockCache(THRESHOLD), **CALL)
    plain = one(**emb, seed=3, **CALL)
    print(f"one device: ran {want.cache.ran.astype(int)}, ratios {np.round(want.cache.ratios, 4)}")
    assert 0 < want.cache.full_steps < len(want.cache.ran)  # some steps skipped, some ran
    finite = want.cache.ratios[np.isfinite(want.cache.ratios)]
    assert np.abs(finite - THRESHOLD).min() > 0.05  # no decision within rounding of the threshold
    # 4 blocks a step (2 refiner, 2 dual-stream); a skipped step runs the refiners and the first block.
    assert (want.cache.blocks_per_step, want.cache.always_run) == (4, 3)
    assert float(np.abs(want.latents - plain.latents).max()) > 1e-3  # skipping changed the result
    got = pipes["cfg2 x ulysses2"](**emb, seed=3, cache=FirstBlockCache(THRESHOLD), **CALL)
    assert got.cache.ran.tolist() == want.cache.ran.tolist() and got.cache.devices_agree
    tol.check(got.latents, want.latents, tol.SAME_SEED, "First-Block-Cache cfg2 x ulysses2 vs one device")


def test_teacache_without_a_calibration_names_it(case):
    pipes, emb = case
    with pytest.raises(ValueError, match="TeaCache has no published coefficients.*--calibrate_teacache"):
        pipes["cfg2 x ulysses2"](**emb, cache=TeaCache(), **CALL)
