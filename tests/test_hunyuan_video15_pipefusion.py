"""HunyuanVideo 1.5 with PipeFusion: the pipelined phase (stale K/V) against the serial reference of the
same semantics on the unsharded model (``hunyuan_video15_pipefusion_reference.py``), text to video and
image to video, on pipefusion2 x ulysses2 (4 emulated devices).

The tiny transformer (``hunyuan_video15_folder.py``: two refiner and two dual-stream blocks, 1 x 1
patches) is saved by diffusers and loaded by ``load_model`` into both layouts. 5 frames of 64 x 48 pixels
are a 2 x 4 x 3 latent grid: 4 patches of one latent row per frame (6 video tokens, 3 per sequence
shard), the full pipeline of 2 passes x 2 stages; the prompt (7 tokens, 5 real in the conditional branch
and 3 in the unconditional one) and the glyph (5 tokens, 2 and 0 real) are cut into 4 chunks of 2 (the
last padded), each padded to the 2 sequence shards. One warm-up step, then three pipelined steps with
CFG (scale 6; cfg=1: both branches on each device, and cfg2 x pipefusion2). Image to video adds the first frame's condition
channels and 9 image tokens (4 chunks of 3, padded to 4).
"""

from __future__ import annotations

import hunyuan_video15_folder as hf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol
from hunyuan_video15_pipefusion_reference import serial_stale_kv
from pipefusion_helpers import six_step_cache

from converters.hunyuan_video15 import CHECKPOINTS
from jaxdit.mesh import DeviceMesh, ParallelConfig
from jaxdit.pipelines.assemble import load_model
from jaxdit.pipelines.hunyuan_video15 import HunyuanVideo15Pipeline
from jaxdit.pipelines.hunyuan_video15_i2v import HunyuanVideo15ImageToVideoPipeline
from jaxdit.pipelines.pipefusion.hunyuan_video15 import PipeFusionHunyuanVideo15, default_num_patches
from jaxdit.pipelines.request import GenerationRequest

pytest.importorskip("diffusers")

FAST = {"xla_backend_optimization_level": 0}
PATCHES = 4
CALL = dict(height=64, width=48, num_frames=5, num_inference_steps=4, seed=3, guidance_scale=6.0)
IMAGE_TOKENS = 9
PIPEFUSION2_ULYSSES2 = ParallelConfig(pipefusion=2, ulysses=2)


@pytest.fixture(scope="module")
def transformer(tmp_path_factory):
    path = tmp_path_factory.mktemp("hvpf") / "transformer"
    hf.pipeline().transformer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def embeds():
    return {
        **hf.embeddings([5], [2], text=7, glyph=5),
        **hf.embeddings([3], [0], 7, 5, seed=1, prefix="negative_"),
    }


def _first_frame(pictures, frames, height, width):
    """A stand-in for the VAE and SigLIP encoders: fixed image tokens and condition channels (the first
    latent frame's 4 latents and a mask of 1 there), what makes them does not matter here."""
    rng = np.random.default_rng(7)
    embeds = rng.standard_normal((1, IMAGE_TOKENS, 12)).astype(np.float32)
    f = (frames - 1) // 4 + 1
    condition = np.zeros((1, 5, f, height // 16, width // 16), np.float32)
    condition[:, :4, 0] = rng.standard_normal((1, 4, height // 16, width // 16))
    condition[:, 4, 0] = 1.0
    return embeds, condition


def _pipelines(path, cls, parallel=PIPEFUSION2_ULYSSES2, **options):
    """(the pipeline on ``parallel``'s 4 devices, the plain one on one device) from the saved folder."""

    def make(parallel, devices):
        where = DeviceMesh.of(parallel.make_mesh(devices))
        model = load_model(path, where, jnp.float32, CHECKPOINTS, staged=PipeFusionHunyuanVideo15)
        return cls(model, where, compiler_options=FAST, **options)

    return make(parallel, jax.devices()[:4]), make(ParallelConfig(), jax.devices()[:1])


I2V = (
    HunyuanVideo15ImageToVideoPipeline,
    {"first_frame": _first_frame},
    {"image": np.zeros((64, 48, 3), np.uint8)},
)
CASES = {  # the picture's bucket is 64 x 48
    "t2v pipefusion2 x ulysses2": (HunyuanVideo15Pipeline, {}, {}),
    "i2v pipefusion2 x ulysses2": I2V,
    # The branches on two devices: each holds one branch's rows of the per-row prompt and glyph masks.
    "t2v cfg2 x pipefusion2": (HunyuanVideo15Pipeline, {"parallel": ParallelConfig(cfg=2, pipefusion=2)}, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipelined_pipefusion_matches_the_serial_reference(transformer, embeds, case):
    cls, options, extra = CASES[case]
    pipe, one = _pipelines(transformer, cls, **options)
    call = {**CALL, **embeds, **extra}
    got = pipe(num_pipeline_patch=PATCHES, warmup_steps=1, output_type="latent", progress=False, **call)
    prepared = one.prepare(one.with_defaults(GenerationRequest.of(**call)))
    assert prepared.inputs.grid == (2, 4, 3)
    image = prepared.inputs.context.get("image_embeds")
    assert (None if image is None else image.shape[1]) == (IMAGE_TOKENS if "i2v" in case else None)
    want = prepared.to_latents(serial_stale_kv(one, prepared.inputs, PATCHES))
    exact = prepared.to_latents(
        serial_stale_kv(one, prepared.inputs, PATCHES, warmup=CALL["num_inference_steps"])
    )
    serial = one(output_type="latent", progress=False, **call).latents
    err = float(np.abs(got.latents - want).max() / np.abs(want).max())
    drift = float(np.abs(serial - want).max() / np.abs(serial).max())
    self_check = float(np.abs(serial - exact).max() / np.abs(serial).max())
    print(
        f"\n{case}: pipelined vs serial reference {err:.2e}; the serial reference vs the plain run "
        f"{drift:.2e}; the reference with every step a warm-up vs the plain run {self_check:.2e}"
    )
    tol.check(exact, serial, tol.PIPEFUSION, f"{case}: the reference's warm-up steps vs the plain run")
    tol.check(
        got.latents,
        want,
        tol.PIPEFUSION,
        f"HunyuanVideo 1.5 {case} pipelined PipeFusion vs the serial reference",
    )
    assert drift > 1e-3  # stale K/V changed the result: the comparison is not the plain run's


def test_default_patches_and_refusals(transformer, embeds):
    assert default_num_patches(2, (2, 4, 3), 2) == 4  # the full pipeline: 2 passes x 2 stages
    assert default_num_patches(2, (2, 2, 3), 2) == 2  # too few rows for 4: P
    assert default_num_patches(2, (31, 30, 53), 2) == 5  # 480p: 30 rows, 4 does not divide them
    # jaxdit generate's check before any weight loads (the family's), and the runner's own.
    from types import SimpleNamespace

    from jaxdit.families.hunyuan_video15 import HUNYUAN_VIDEO15
    from jaxdit.models.hunyuan_video15_config import HunyuanVideo15Config

    config = HunyuanVideo15Config(num_layers=2, num_refiner_layers=2, num_attention_heads=4)
    request = dict(height=64, width=48, num_frames=5, num_inference_steps=4, warmup_steps=None)
    check = lambda pc, **r: HUNYUAN_VIDEO15.check_pipefusion(  # noqa: E731
        SimpleNamespace(**{**request, "num_pipeline_patch": None, **r}), config, pc, 16
    )
    check(PIPEFUSION2_ULYSSES2)
    with pytest.raises(ValueError, match="does not divide the 4 latent rows"):
        check(PIPEFUSION2_ULYSSES2, num_pipeline_patch=3)
    with pytest.raises(ValueError, match="exceeds the model's 2 dual-stream blocks"):
        check(ParallelConfig(pipefusion=4))
    with pytest.raises(ValueError, match="MeanFlow"):
        HUNYUAN_VIDEO15.check_pipefusion(
            SimpleNamespace(**request, num_pipeline_patch=None),
            HunyuanVideo15Config(num_layers=2, num_attention_heads=4, use_meanflow=True),
            PIPEFUSION2_ULYSSES2,
            16,
        )
    pipe, _ = _pipelines(transformer, HunyuanVideo15Pipeline)
    with pytest.raises(ValueError, match="num_pipeline_patch=3 does not divide the 4 latent rows"):
        pipe(num_pipeline_patch=3, output_type="latent", progress=False, **CALL, **embeds)


#: Host-planned caches under PipeFusion (jaxdit/pipelines/pipefusion/cache.py) over 6 steps: MagCache on
#: made-up ratios of both branches (threshold 0.5, at most 2 skips in a row: steps 1, 2, 4, 5 skipped, the
#: first two by the warm-up step's program), TaylorSeer (interval 2, one warm-up step: 1, 3, 5 skipped).
CACHE_STEPS = 6
CACHE_CASES = {
    "magcache cfg2 x pipefusion2": (ParallelConfig(cfg=2, pipefusion=2), [1, 0, 0, 1, 0, 0]),
    "taylorseer pipefusion2 x ulysses2": (PIPEFUSION2_ULYSSES2, [1, 0, 1, 0, 1, 0]),
}


@pytest.mark.parametrize("case", list(CACHE_CASES))
def test_host_planned_cache_matches_the_serial_reference(transformer, embeds, tmp_path, case):
    """Both passes (refiner up, dual-stream down) skipped on a skipped step: the output layer on the
    embedded video plus the residual of every block kept per patch (or its Taylor forecast), against the
    serial reference with the same plan and stale K/V; the cache moves the result."""
    parallel, plan = CACHE_CASES[case]
    cache, order = six_step_cache("magcache" if case.startswith("magcache") else "taylorseer", tmp_path, 2)
    pipe, one = _pipelines(transformer, HunyuanVideo15Pipeline, parallel)
    call = {**CALL, **embeds, "num_inference_steps": CACHE_STEPS}
    got = pipe(
        num_pipeline_patch=PATCHES, warmup_steps=1, output_type="latent", progress=False, cache=cache, **call
    )
    print(f"\n{case}: {got.cache.describe()}")
    np.testing.assert_array_equal(got.cache.ran, np.asarray(plan, bool))
    prepared = one.prepare(one.with_defaults(GenerationRequest.of(**call)))
    ran = tuple(bool(r) for r in plan)
    want = prepared.to_latents(serial_stale_kv(one, prepared.inputs, PATCHES, 1, ran, order))
    uncached = prepared.to_latents(serial_stale_kv(one, prepared.inputs, PATCHES))
    tol.check(got.latents, want, tol.PIPEFUSION, f"HunyuanVideo 1.5 {case} vs the serial reference")
    drift = tol.max_error(got.latents, uncached)
    print(f"vs uncached PipeFusion: {drift:.1e}")
    assert drift > 100 * tol.PIPEFUSION.allowed(np.abs(want).max())
