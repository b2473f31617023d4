"""PipeFusion (arXiv 2405.14430) for Wan 2.2: A14B's two experts (T2V; I2V with condition channels and no
CLIP) and TI2V-5B's first frame with per-token timesteps, on the tiny Wan 2.2 transformers of
tests/tiny_pipelines.py (2 heads, 2 blocks; ``WanPipeline.from_checkpoint`` of the diffusers folders).

- warm-up only (warmup_steps = steps) is the plain loop's computation on another mesh: the PipeFusion
  pipeline equals the single-device pipeline (tolerance.SAME_SEED), with the expert switch inside the run;
- the pipelined segments (warmup 1: stale K/V) equal the serial reference of the same semantics
  (tests/pipefusion_wan_reference.py: each expert's run of steps restarts with its own warm-up step; TI2V's
  first frame and per-token timesteps taken per patch) at tolerance.PIPEFUSION, as Wan 2.1's
  (tests/test_pipefusion_wan.py);
- each step runs the expert the plain loop runs (the segments against the plain loop's picks);
- ``jaxdit generate``'s checks and ``jaxdit plan`` accept Wan 2.2 presets on PipeFusion.

``jaxdit generate --pipefusion_parallel_degree 2`` from a prompt to an MP4 on the two-expert folder, against
diffusers, is in tests/test_wan22_pipelines.py.

5 UniPC steps at shift 3: t = 999, 923, 818, 667, 429, so both boundaries (0.875, 0.9) give the experts
(high, high, low, low, low): with warmup 1 each expert has a pipelined phase.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
import tiny_pipelines
import tolerance as tol
from pipefusion_wan_reference import stale_kv_reference, warmup_steps_of

from jaxdit.cache import MagCache, TaylorSeer, magcache
from jaxdit.families import load_params
from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines.pipefusion.segments import Segment, expert_segments
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.pipelines.wan import WanPipeline

FAST = {"xla_backend_optimization_level": 0}
STEPS, FRAMES, SEED, GUIDANCE, GUIDANCE_2, SHIFT = 5, 5, 0, 5.0, 3.0, 3.0
TEXT_DIM, TEXT_TOKENS = 16, 6
#: (height, width): 2 latent frames x 3 x 4 tokens for A14B (Wan 2.1 VAE), 2 x 2 x 3 for TI2V (16x VAE).
SIZES = {"t2v": (48, 64), "i2v": (48, 64), "ti2v": (64, 96)}
EXPERTS = (0, 0, 1, 1, 1)
#: The meshes: patches of whole latent rows (A14B: 3 rows, M = 3; TI2V: 2 rows, M = 2).
MESHES = {
    "t2v": dict(pipefusion=2, ulysses=2),
    "i2v": dict(cfg=2, pipefusion=2),
    "ti2v": dict(pipefusion=2, ulysses=2),
}
PATCHES = {"t2v": 3, "i2v": 3, "ti2v": 2}


@functools.cache
def _call(variant: str) -> dict:
    """The call's keyword arguments: text embeddings, and the image conditioning of I2V / TI2V."""
    rng = np.random.default_rng(8)
    text = (1, TEXT_TOKENS, TEXT_DIM)
    h, w = SIZES[variant]
    kwargs = dict(
        prompt_embeds=rng.standard_normal(text).astype(np.float32),
        negative_prompt_embeds=rng.standard_normal(text).astype(np.float32),
        height=h,
        width=w,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        flow_shift=SHIFT,
        seed=SEED,
        output_type="latent",
        progress=False,
    )
    if variant == "i2v":  # 4 mask + 16 image-latent channels, no CLIP features (Wan 2.2 I2V-A14B)
        kwargs["condition"] = rng.standard_normal((1, 20, 2, h // 8, w // 8)).astype(np.float32)
    if variant == "ti2v":  # the first frame's latent (48 channels of the Wan 2.2 VAE)
        kwargs["condition"] = rng.standard_normal((1, tiny_pipelines.TI2V_Z, 1, h // 16, w // 16))
        kwargs["condition"] = kwargs["condition"].astype(np.float32)
    if variant != "ti2v":
        kwargs["guidance_scale_2"] = GUIDANCE_2
    return kwargs


@functools.cache
def _pipe(variant: str, **degrees) -> WanPipeline:
    folder, _, _ = tiny_pipelines.wan22(variant)
    return WanPipeline.from_checkpoint(folder, ParallelConfig(**degrees), compiler_options=FAST)


@functools.cache
def _plain(variant: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """The single-device pipeline's latents and the expert each step ran (recorded as it asks for it)."""
    pipe = _pipe(variant)
    picks, ask = [], pipe.denoiser.experts
    if ask is not None:
        pipe.denoiser.experts = lambda expert: picks.append(expert) or ask(expert)
    try:
        latents = pipe(**_call(variant)).latents
    finally:
        pipe.denoiser.experts = ask
    return latents, tuple(picks[1:])  # Denoiser.run asks for step 0's once more to record the step


def _pipefusion(variant: str, warmup: int) -> tuple[np.ndarray, tuple[Segment, ...]]:
    pipe = _pipe(variant, **MESHES[variant])
    out = pipe(**_call(variant), num_pipeline_patch=PATCHES[variant], warmup_steps=warmup).latents
    return out, pipe.denoiser.runner.last_segments


def _ran(segments: tuple[Segment, ...]) -> tuple[int, ...]:
    return tuple(s.expert for s in segments for _ in range(s.steps))


def test_expert_segments():
    assert expert_segments((), 5, 2) == (Segment(None, 0, 5, 2),)
    assert expert_segments(EXPERTS, 5, 1) == (Segment(0, 0, 2, 1), Segment(1, 2, 3, 1))
    # A segment shorter than the warm-up runs all its steps synchronously.
    assert expert_segments(EXPERTS, 5, 3) == (Segment(0, 0, 2, 2), Segment(1, 2, 3, 3))
    assert [s.pipelined for s in expert_segments((0, 1, 1), 3, 1)] == [0, 1]
    assert warmup_steps_of(EXPERTS, 5, 1) == [True, False, True, False, False]  # the reference's
    with pytest.raises(ValueError, match="4 experts for 5 steps"):
        expert_segments(EXPERTS[:4], 5, 1)


@pytest.mark.parametrize("variant", list(MESHES))
def test_warmup_only_equals_the_plain_loop(variant):
    """Every step synchronous: the plain loop's computation on a PipeFusion mesh, both experts (A14B)
    switching at the plain loop's step, with their own guidance scales."""
    plain, picks = _plain(variant)
    out, segments = _pipefusion(variant, STEPS)
    what = f"Wan 2.2 {variant}, {MESHES[variant]}, M={PATCHES[variant]}, warm-up only, vs one device"
    tol.check(out, plain, tol.SAME_SEED, what)
    if variant == "ti2v":
        assert segments == (Segment(None, 0, STEPS, STEPS),)
    else:
        assert picks == _ran(segments) == EXPERTS


@pytest.mark.parametrize("variant", ["t2v", "ti2v"])
def test_pipelined_segments_equal_a_serial_reference_of_stale_kv(variant):
    out, segments = _pipefusion(variant, 1)
    pipe = _pipe(variant)
    prepared = pipe.prepare(pipe.with_defaults(GenerationRequest(**_call(variant))))
    folder, _, _ = tiny_pipelines.wan22(variant)
    names = ("transformer", "transformer_2") if variant != "ti2v" else ("transformer",)
    models = [load_params(folder / name, pipe.mesh, jnp.float32)[1] for name in names]
    reference = prepared.to_latents(stale_kv_reference(models, prepared.inputs, PATCHES[variant], 1))
    what = f"Wan 2.2 {variant}, {MESHES[variant]}, warmup 1, vs the serial reference of stale K/V"
    tol.check(out, reference, tol.PIPEFUSION, what)
    plain, _ = _plain(variant)
    drift = tol.max_error(out, plain)
    print(f"vs the plain loop (stale K/V): {drift:.1e}")
    assert drift > 100 * tol.PIPEFUSION.allowed(np.abs(reference).max())  # stale K/V really is used
    if variant == "t2v":  # each expert pipelines after its own warm-up step
        assert segments == (Segment(0, 0, 2, 1), Segment(1, 2, 3, 1))


#: Host-planned caches across A14B's expert switch (jaxdit/pipelines/pipefusion/cache.py): each expert's
#: warm-up step (0 and 2) is forced full. MagCache on made-up ratios (both branches; the tiny folder ships
#: none) plans F.FF. (step 3 full in the second expert's pipelined phase, step 4 skipped right after it in
#: the same program); TaylorSeer interval 2 (one warm-up step) plans F.F.F (step 4 pipelined after a skip).
CACHE_PLANS = {"magcache": (1, 0, 1, 1, 0), "taylorseer": (1, 0, 1, 0, 1)}


@pytest.fixture(scope="module")
def wan22_caches(tmp_path_factory):
    path = tmp_path_factory.mktemp("magcache") / "ratios.json"
    magcache.save_ratios(str(path), np.asarray([[1.0, 1.0, 1.0, 0.5, 1.0]] * 2))
    return {
        "magcache": MagCache(threshold=0.3, ratios=str(path)),
        "taylorseer": TaylorSeer(interval=2, order=1, warmup=1),
    }


@pytest.mark.parametrize("name", list(CACHE_PLANS))
def test_host_planned_cache_across_the_expert_switch_equals_the_serial_reference(name, wan22_caches):
    """A14B T2V, pipefusion2 x ulysses2, M = 3: the plan's skipped steps stay within an expert's segment,
    each segment runs the same pipelined program on its own full steps, and the result equals the serial
    reference of stale K/V with the same plan (each expert's head on the kept residual, or its Taylor
    forecast, which crosses the switch as on a plain mesh); the cache moves it against uncached PipeFusion."""
    variant, cache = "t2v", wan22_caches[name]
    pipe = _pipe(variant, **MESHES[variant])
    out = pipe(**_call(variant), num_pipeline_patch=PATCHES[variant], warmup_steps=1, cache=cache)
    print(f"\n{name}: {out.cache.describe()}")
    np.testing.assert_array_equal(out.cache.ran, np.asarray(CACHE_PLANS[name], bool))
    assert pipe.denoiser.runner.last_segments == (Segment(0, 0, 2, 1), Segment(1, 2, 3, 1))
    plain = _pipe(variant)
    prepared = plain.prepare(plain.with_defaults(GenerationRequest(**_call(variant))))
    folder, _, _ = tiny_pipelines.wan22(variant)
    models = [load_params(folder / n, plain.mesh, jnp.float32)[1] for n in ("transformer", "transformer_2")]
    order = getattr(cache, "order", 0)
    ran = tuple(bool(r) for r in CACHE_PLANS[name])
    reference = prepared.to_latents(
        stale_kv_reference(models, prepared.inputs, PATCHES[variant], 1, ran=ran, order=order)
    )
    tol.check(out.latents, reference, tol.PIPEFUSION, f"{name} across the expert switch vs the reference")
    uncached, _ = _pipefusion(variant, 1)
    drift = tol.max_error(out.latents, uncached)
    print(f"vs uncached PipeFusion: {drift:.1e}")
    assert drift > 100 * tol.PIPEFUSION.allowed(np.abs(reference).max())


def test_generate_and_plan_accept_wan22_presets_on_pipefusion(tmp_path):
    """The request checks (headers only) and ``jaxdit plan``: Wan 2.2 on PipeFusion runs, it is no longer
    'modelled only'."""
    from jaxdit.generate import GenerateRequest, check_request
    from jaxdit.plan.latency import Hardware
    from jaxdit.plan.search import evaluate
    from jaxdit.plan.workload import Workload

    text = np.zeros((1, 512, 4096), np.float16)
    np.savez(tmp_path / "both.npz", prompt_embeds=text, negative_prompt_embeds=text)
    (tmp_path / "weights").mkdir()
    for model, size in (("wan2.2-t2v-a14b", {}), ("wan2.2-ti2v-5b", dict(height=704, width=1280))):
        request = GenerateRequest(
            model=model,
            weights=str(tmp_path / "weights"),
            prompt_embeds=str(tmp_path / "both.npz"),
            pipefusion_parallel_degree=2,
            warmup_steps=2,
            **size,
        )
        check_request(request)
    for name in ("wan2.2-t2v-a14b", "wan2.2-ti2v-5b"):
        plan = evaluate(
            Workload.create(name), ParallelConfig(cfg=2, pipefusion=2, ulysses=2), Hardware(memory_gb=141)
        )
        assert not plan.reasons and not any("modelled only" in note for note in plan.notes), plan.notes
