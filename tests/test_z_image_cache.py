"""First-Block-Cache on Z-Image (``jaxdit.cache``) against diffusers' hook, on the tiny saved
``ZImagePipeline`` folder: Turbo (no guidance) on ring2 x ulysses2 and the base model's guidance on
cfg2 x ulysses2.

The cache's first block is the first joint layer, its metric that layer's residual on the whole joint
[image; caption] stream: what diffusers' ``apply_first_block_cache`` does (diffusers 0.42.1,
``hooks/first_block_cache.py``: it takes the model's ``layers`` list, the refiners are not in it). Two
things stop that hook from running on Z-Image as shipped, and the test supplies them: the hook reads the
block's input by the name ``hidden_states`` (Z-Image's blocks call it ``x``: pointed at argument 0), and
``ZImagePipeline`` opens no cache context (one context for the whole call: the pipeline batches both
guidance branches into one forward, so one state decides for both, as jaxdit's one decision does).

The random model's first-layer residual changes by ~1.33-1.54 a step; threshold 1.425 skips steps 1-3
and runs 0, 4, 5 in both cases (every ratio is >= 0.014 from it, far above rounding). A threshold of
1e-6 runs every step: exactly the uncached run. MagCache (no published ratios) runs from a calibration
it records on the same folder, and is refused without one.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import z_image_tiny as tiny

from jaxdit.cache import FirstBlockCache, MagCache
from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.z_image import ZImagePipeline

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache  # noqa: E402
from diffusers.hooks import first_block_cache as diffusers_fbc  # noqa: E402
from diffusers.hooks._helpers import TransformerBlockRegistry  # noqa: E402
from diffusers.hooks.hooks import CacheContext, _set_cache_context  # noqa: E402

CALL = dict(height=32, width=48, num_inference_steps=6, output_type="latent")
FAST = {"xla_backend_optimization_level": 0}  # quick CPU compiles; numerics are what is tested
PROMPT = "a photo of a cat on a mat"
SEED, THRESHOLD = 0, 1.425


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zimage") / "Z-Image-tiny"
    tiny.pipeline(folder)
    return folder


@pytest.fixture(scope="module")
def pipes(folder):
    make = (
        lambda pc: ZImagePipeline.from_pretrained(  # noqa: E731
            folder, pc.make_mesh(jax.devices()[: pc.num_devices]), compiler_options=FAST
        )
    )
    return {0.0: make(ParallelConfig(ring=2, ulysses=2)), 2.0: make(ParallelConfig(cfg=2, ulysses=2))}


def _diffusers(folder, guidance: float, threshold: float | None):
    """diffusers' latents and its head hook's decisions (True: the other blocks ran) for one prompt."""
    from diffusers import ZImagePipeline as Reference
    from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock

    pipe = Reference.from_pretrained(folder)
    decisions = []
    if threshold is not None:
        metadata = TransformerBlockRegistry.get(ZImageTransformerBlock)
        metadata._cached_parameter_indices = {"hidden_states": 0}  # the block's `x`
        apply_first_block_cache(pipe.transformer, FirstBlockCacheConfig(threshold=threshold))
        _set_cache_context(pipe.transformer, CacheContext("joint"))
        head = pipe.transformer.layers[0]._diffusers_hook.get_hook(diffusers_fbc._FBC_LEADER_BLOCK_HOOK)
        original = head._should_compute_remaining_blocks

        def spy(residual):
            decisions.append(bool(original(residual)))
            return decisions[-1]

        head._should_compute_remaining_blocks = spy
    noise = latent_ops.initial_noise(SEED, (1, 4, CALL["height"] // 2, CALL["width"] // 2))
    with torch.no_grad():
        out = pipe([PROMPT], latents=torch.from_numpy(noise), guidance_scale=guidance, **CALL)
    return out.images.numpy(), decisions


def _relative(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("guidance", [0.0, 2.0], ids=["turbo-ring2xulysses2", "base-cfg2xulysses2"])
def test_first_block_cache_matches_diffusers(folder, pipes, guidance):
    want, decisions = _diffusers(folder, guidance, THRESHOLD)
    got = pipes[guidance](
        PROMPT, guidance_scale=guidance, seed=SEED, progress=False, cache=FirstBlockCache(THRESHOLD), **CALL
    )
    print(f"diffusers {np.asarray(decisions, int)}, jaxdit {got.cache.ran.astype(int)}")
    print(f"ratios {np.round(got.cache.ratios, 4)}, latents {_relative(got.latents, want):.2e} relative")
    assert got.cache.ran.tolist() == decisions == [True, False, False, False, True, True]
    assert got.cache.devices_agree
    assert _relative(got.latents, want) <= 1e-4  # the pipeline's bound against diffusers
    uncached, _ = _diffusers(folder, guidance, None)
    assert _relative(uncached, want) > 1e-2  # skipping changed it


def test_a_tiny_threshold_is_the_uncached_run(pipes):
    mesh = pipes[0.0]
    plain = mesh(PROMPT, guidance_scale=0.0, progress=False, **CALL)
    cached = mesh(PROMPT, guidance_scale=0.0, progress=False, cache=FirstBlockCache(threshold=1e-6), **CALL)
    assert cached.cache.ran.all() and cached.cache.devices_agree
    assert cached.cache.skipped_blocks == 0
    np.testing.assert_array_equal(cached.latents, plain.latents)


def test_the_report_counts_the_refiners_as_always_run(pipes):
    out = pipes[0.0](
        PROMPT, guidance_scale=0.0, seed=SEED, progress=False, cache=FirstBlockCache(THRESHOLD), **CALL
    )
    # 4 blocks a step (noise refiner, context refiner, 2 joint layers); a skipped step runs 3 of them.
    assert (out.cache.blocks_per_step, out.cache.always_run) == (4, 3)
    assert out.cache.skipped_blocks == 3


def test_magcache_without_ratios_names_the_calibration(pipes):
    # No ratios are published for Z-Image (TeaCache likewise: tests/test_z_image_teacache.py).
    with pytest.raises(ValueError, match="--calibrate_magcache FILE.*--magcache_ratios FILE"):
        pipes[0.0](PROMPT, guidance_scale=0.0, progress=False, cache=MagCache(), **CALL)


def test_magcache_from_a_calibration(pipes, tmp_path):
    """MagCache's ratios recorded on Z-Image (its hook: the image tokens leaving the last joint layer),
    written to a file and read back: the run follows MagCache's rule on them (host-planned)."""
    from jaxdit.cache.calibrate import calibrate, save_calibration_file
    from jaxdit.cache.magcache import magcache_pattern

    mesh = pipes[0.0]
    ratios = calibrate(mesh, PROMPT, guidance_scale=0.0, seed=SEED, progress=False, **CALL)
    assert ratios.shape == (1, CALL["num_inference_steps"]) and np.all(np.abs(ratios[0, 1:] - 1) < 0.5)
    path = str(tmp_path / "z-image-mag.json")
    save_calibration_file(path, ratios, source="tests/test_z_image_cache.py")
    cache = MagCache(ratios=path, threshold=0.5)
    got = mesh(PROMPT, guidance_scale=0.0, seed=SEED, progress=False, cache=cache, **CALL).cache
    want = magcache_pattern(np.round(ratios, 5), 0.5, max_skips=2, retention=0.2, forced=[0])
    print(f"ratios {np.round(ratios[0], 4)}, ran {got.ran.astype(int)}")
    assert got.ran.tolist() == want.tolist() and not got.ran.all() and got.devices_agree
