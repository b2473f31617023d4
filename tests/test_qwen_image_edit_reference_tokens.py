"""Qwen-Image-Edit's reference tokens without Edit-2511's ``zero_cond_t`` (they take the step's modulation,
as the denoised tokens do) on the layouts ``test_qwen_image_edit_strategies.py`` checks on Edit-2511: the
tiny Edit-2509 folder (``QwenImageEditPlusPipeline``, two pictures: 448 reference tokens) and the original
Qwen-Image-Edit folder (``QwenImageEditPipeline``, one picture: 256), both from ``qwen_image_edit_folder.py``,
true CFG 4.0, fp32, against the same call on one device:

- PipeFusion (pipefusion2 x ulysses2) with every step a warm-up step (the serial computation on another
  mesh, so the one-device run is its reference);
- PipeFusion's pipelined phase (one warm-up step, then stale K/V) against the strategies file's serial
  reference of the same semantics on the unsharded model;
- First-Block-Cache on ulysses2 x ring2 (the reference tokens padded to the ring's shards): the one-device
  run's skip decisions and latents.

Bounds: SAME_SEED, PIPEFUSION (``tolerance.py``).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import tolerance as tol
from PIL import Image

pytest.importorskip("torch")
pytest.importorskip("diffusers")

import qwen_image_edit_folder as edit_folder  # noqa: E402
import test_qwen_image_edit_strategies as strategies  # noqa: E402  (its serial PipeFusion reference)

from jaxdit.cache import FirstBlockCache  # noqa: E402
from jaxdit.mesh import ParallelConfig  # noqa: E402
from jaxdit.pipelines.qwen_image_edit import QwenImageEditPipeline  # noqa: E402
from jaxdit.pipelines.request import GenerationRequest  # noqa: E402

FAST = {"xla_backend_optimization_level": 0}
STEPS, PATCHES = strategies.STEPS, strategies.PATCHES  # the serial reference reads the strategies' own
CALL = dict(strategies.CALL, num_images_per_prompt=1)
#: The folder, the pictures it reads and their reference tokens (256 for the 24x24 picture, 192 the other).
VARIANTS = {"edit-2509": ("plus", 2, 256 + 192), "edit": ("edit", 1, 256)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    edit_folder.patch_areas(patch)
    yield edit_folder.save(tmp_path_factory.mktemp("qwen_image_edit_reference_tokens"))
    patch.undo()


def _mesh(config: ParallelConfig):
    return config.make_mesh(jax.devices()[: config.num_devices])


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, saved):
    """(pictures, reference token count, the one-device pipeline and its latents, pipefusion2 x ulysses2)."""
    which, count, tokens = VARIANTS[request.param]
    folder = saved["folders"][which]
    pictures = [Image.open(p).convert("RGB") for p in saved["paths"][:count]]
    one = QwenImageEditPipeline.from_pretrained(folder, _mesh(ParallelConfig()), compiler_options=FAST)
    assert not one.model.config.zero_cond_t
    want = one(pictures, **CALL, output_type="latent", progress=False).latents
    pipefusion = QwenImageEditPipeline.from_pretrained(
        folder, _mesh(ParallelConfig(pipefusion=2, ulysses=2)), compiler_options=FAST
    )
    return dict(
        name=request.param, folder=folder, pictures=pictures, tokens=tokens, one=one, want=want, pf=pipefusion
    )


def test_pipefusion_warmup_only_matches_one_device(case):
    got = case["pf"](
        case["pictures"],
        **CALL,
        warmup_steps=STEPS,
        num_pipeline_patch=PATCHES,
        output_type="latent",
        progress=False,
    ).latents
    tol.check(got, case["want"], tol.SAME_SEED, f"{case['name']} PipeFusion warm-up only vs one device")


def test_pipelined_pipefusion_matches_the_serial_reference(case):
    got = case["pf"](
        case["pictures"],
        **CALL,
        warmup_steps=1,
        num_pipeline_patch=PATCHES,
        output_type="latent",
        progress=False,
    ).latents
    prepared = case["one"].prepare(GenerationRequest.of(image=case["pictures"], **CALL))
    assert prepared.inputs.context["reference_hidden_states"].shape[1] == case["tokens"]
    want = prepared.to_latents(strategies._serial_pipefusion(case["one"], prepared.inputs))
    tol.check(got, want, tol.PIPEFUSION, f"{case['name']} pipelined PipeFusion vs the serial reference")
    plain = case["want"]
    assert np.abs(plain - want).max() > 1e-3 * np.abs(plain).max()  # stale K/V changed the result


def test_first_block_cache_on_ulysses2_ring2_matches_one_device(case):
    """A threshold far above the random model's changes: decisions nowhere near a boundary; it skips."""
    sharded = QwenImageEditPipeline.from_pretrained(
        case["folder"], _mesh(ParallelConfig(ulysses=2, ring=2)), compiler_options=FAST
    )
    cache = FirstBlockCache(threshold=10.0)
    want = case["one"](case["pictures"], **CALL, cache=cache, output_type="latent", progress=False)
    got = sharded(case["pictures"], **CALL, cache=cache, output_type="latent", progress=False)
    assert not want.cache.ran.all() and got.cache.devices_agree, want.cache.ran
    np.testing.assert_array_equal(got.cache.ran, want.cache.ran)
    tol.check(got.latents, want.latents, tol.SAME_SEED, f"{case['name']} FBCache, ulysses2 x ring2 vs one")
    plain = case["want"]
    assert np.abs(want.latents - plain).max() > 1e-3 * np.abs(plain).max()  # it skipped work
