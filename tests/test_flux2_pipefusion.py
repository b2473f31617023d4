"""FLUX.2 [klein]'s pipelined PipeFusion phase (stale K/V) against a serial reference of the same semantics
written on the unsharded model (full softmax over the patch's fresh K/V and the other patches' buffered
K/V, nothing of the runner's programs), on the tiny saved folder with two reference pictures:
pipefusion2 x ulysses2, 4 patches of 2 image rows, a 10-token text chunk and a 145-token reference chunk
each (padded to 146 for the 2 sequence shards: padded keys in play), one warm-up step then three
pipelined ones. The reference tokens are context: carried by their patch, buffered, never stepped.

The reference (``flux2_pipefusion_reference.py``, shared with dev's test) runs the steps in order and,
within a step, the patches in order, as the pipeline's schedule orders every layer.
"""

from __future__ import annotations

import flux2_klein_tiny as tiny
import jax
import numpy as np
import pytest
import tolerance as tol
from flux2_pipefusion_reference import serial_stale_kv
from PIL import Image
from pipefusion_helpers import six_step_cache

from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines.flux2 import Flux2KleinPipeline
from jaxdit.pipelines.request import GenerationRequest

pytest.importorskip("diffusers")

FAST = {"xla_backend_optimization_level": 0}
PATCHES = 4
CALL = dict(
    prompt="a photo of a cat on a mat", height=32, width=48, num_inference_steps=4, seed=3,
    max_sequence_length=40, guidance_scale=1.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny.pipeline(tmp_path_factory.mktemp("flux2pf") / "klein")


@pytest.fixture(scope="module")
def pictures():
    """Two pictures of 68 x 68 pixels (diffusers' least side is 64): 17 x 17 = 289 reference tokens each,
    578 in all: 145 per patch (the last one 143), padded to 146 for the 2 shards."""
    rng = np.random.default_rng(11)
    return [Image.fromarray(rng.integers(0, 256, (68, 68, 3), dtype=np.uint8)) for _ in range(2)]


def test_pipelined_pipefusion_with_references_matches_the_serial_reference(folder, pictures):
    pc = ParallelConfig(pipefusion=2, ulysses=2)
    pipe = Flux2KleinPipeline.from_pretrained(folder, pc.make_mesh(jax.devices()[:4]), compiler_options=FAST)
    one = Flux2KleinPipeline.from_pretrained(folder, ParallelConfig().make_mesh(jax.devices()[:1]))
    call = dict(CALL, image=pictures)
    got = pipe(num_pipeline_patch=PATCHES, warmup_steps=1, output_type="latent", progress=False, **call)
    prepared = one.prepare(GenerationRequest.of(**call))
    assert prepared.inputs.context["reference_hidden_states"].shape[1] == 578
    want = prepared.to_latents(serial_stale_kv(one, prepared.inputs, PATCHES))
    serial = one(output_type="latent", progress=False, **call).latents
    err = float(np.abs(got.latents - want).max() / np.abs(want).max())
    drift = float(np.abs(serial - want).max() / np.abs(serial).max())
    print(f"pipelined vs serial reference {err:.2e}; the serial reference vs the plain run {drift:.2e}")
    tol.check(got.latents, want, tol.PIPEFUSION, "FLUX.2 pipelined PipeFusion vs the serial reference")
    assert drift > 1e-3  # stale K/V changed the result: the comparison is not the plain run's


#: Host-planned caches under PipeFusion (jaxdit/pipelines/pipefusion/cache.py) over 6 steps with the two
#: reference pictures: MagCache on made-up ratios (threshold 0.5, at most 2 skips in a row: steps 1, 2,
#: 4, 5 skipped), TaylorSeer (interval 2, one warm-up step: 1, 3, 5 skipped).
CACHE_CASES = {"magcache": [1, 0, 0, 1, 0, 0], "taylorseer": [1, 0, 1, 0, 1, 0]}


@pytest.mark.parametrize("name", list(CACHE_CASES))
def test_host_planned_cache_matches_the_serial_reference(folder, pictures, tmp_path, name):
    """pipefusion2 x ulysses2 with a cache vs the serial reference with the same plan and stale K/V (a
    skipped step: the output layer on the embedded image plus the kept residual); the cache moves the
    result against uncached PipeFusion."""
    cache, order = six_step_cache(name, tmp_path)
    pc = ParallelConfig(pipefusion=2, ulysses=2)
    pipe = Flux2KleinPipeline.from_pretrained(folder, pc.make_mesh(jax.devices()[:4]), compiler_options=FAST)
    one = Flux2KleinPipeline.from_pretrained(folder, ParallelConfig().make_mesh(jax.devices()[:1]))
    call = dict(CALL, image=pictures, num_inference_steps=6)
    got = pipe(
        num_pipeline_patch=PATCHES, warmup_steps=1, output_type="latent", progress=False, cache=cache, **call
    )
    print(f"\n{name}: {got.cache.describe()}")
    plan = CACHE_CASES[name]
    np.testing.assert_array_equal(got.cache.ran, np.asarray(plan, bool))
    prepared = one.prepare(GenerationRequest.of(**call))
    want = prepared.to_latents(
        serial_stale_kv(one, prepared.inputs, PATCHES, tuple(bool(r) for r in plan), order)
    )
    uncached = prepared.to_latents(serial_stale_kv(one, prepared.inputs, PATCHES))
    tol.check(
        got.latents, want, tol.PIPEFUSION, f"FLUX.2 {name} pipefusion2 x ulysses2 vs the serial reference"
    )
    drift = tol.max_error(got.latents, uncached)
    print(f"vs uncached PipeFusion: {drift:.1e}; mean {np.abs(got.latents - uncached).mean():.3e}")
    _CACHED[name] = got.latents
    if len(_CACHED) == 2:  # the two plans give two results
        print(f"magcache vs taylorseer: {tol.max_error(_CACHED['magcache'], _CACHED['taylorseer']):.1e}")
    assert drift > 100 * tol.PIPEFUSION.allowed(np.abs(want).max())


_CACHED: dict = {}
