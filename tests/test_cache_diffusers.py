"""Feature caches against diffusers and against the published TeaCache for Wan, on tiny random models.

- First-Block-Cache, FLUX: the tiny diffusers ``FluxPipeline`` folder of tests/tiny_pipelines.py runs
  in diffusers with ``transformer.enable_cache(FirstBlockCacheConfig(threshold))`` (diffusers 0.42.1,
  ``hooks/first_block_cache.py``) and in jaxdit with ``cache=FirstBlockCache(threshold)`` on ring2 x
  ulysses2: the same steps skip and the latents agree within ``tolerance.TORCH_LOOP``. The random model's
  block-0 residual changes by ~0.55-1.25 from step to step, so the test's threshold is 0.9 (decisions
  1 1 1 0 0 0 1 0 0 1: consecutive skips, each compared with the last FULL step's residual; every ratio
  is >= 0.05 from the threshold, so float rounding cannot flip one).
- First-Block-Cache, Wan: the tiny diffusers ``WanTransformer3DModel`` of tests/wan_tiny.py in
  diffusers' own loop with ``apply_first_block_cache``, without CFG (diffusers keeps one cache state per
  guidance branch, jaxdit one for both: they compare only with one branch), against jaxdit on ring2 x
  ulysses2 (45 video tokens over 4 shards: 3 padded tokens masked out of the metric); threshold 1.2;
  the latents within ``tolerance.TORCH_LOOP``.
- TeaCache, Wan: the skip pattern against a reference of TeaCache4Wan2.1's ``teacache_forward`` fed the
  time embeddings diffusers' model computes at diffusers' UniPC timesteps (torch: nothing of jaxdit's),
  with CFG and one accumulator per branch (the identity polynomial: see the test); and the same latents
  and decisions on cfg2 x ring2 x tensor2 as on one device (``tolerance.SAME_SEED``).
"""

import copy
import functools

import jax
import numpy as np
import pytest
import tiny_pipelines
import tolerance as tol
import wan_tiny
from test_cache_policies import teacache_wan_reference

from jaxdit.cache import FirstBlockCache, TeaCache
from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines import latents as latent_ops

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache  # noqa: E402
from diffusers.hooks import first_block_cache as diffusers_fbc  # noqa: E402

FAST = {"xla_backend_optimization_level": 0}
PROMPT = "a small red cube"


@pytest.fixture
def diffusers_decisions(monkeypatch):
    """Every decision diffusers' First-Block-Cache head hook takes (True = compute the other blocks)."""
    decisions = []
    original = diffusers_fbc.FBCHeadBlockHook._should_compute_remaining_blocks

    def spy(self, residual):
        decisions.append(bool(original(self, residual)))
        return decisions[-1]

    monkeypatch.setattr(diffusers_fbc.FBCHeadBlockHook, "_should_compute_remaining_blocks", spy)
    return decisions


def test_flux_first_block_cache_matches_diffusers(diffusers_decisions):
    from jaxdit.pipelines.flux import FluxPipeline

    folder, ref_pipe = tiny_pipelines.flux()
    case = dict(height=40, width=48, num_inference_steps=10, guidance_scale=3.5, max_sequence_length=16)
    threshold = 0.9
    noise = latent_ops.initial_noise(0, (1, 4, 20, 24))
    pipe = copy.deepcopy(ref_pipe)  # the hooks stay on this copy, not on the session's shared pipeline
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    with torch.no_grad():
        ref = pipe(
            PROMPT, latents=torch.from_numpy(latent_ops.pack(noise)), output_type="latent", **case
        ).images.numpy()

    ours = FluxPipeline.from_pretrained(folder, ParallelConfig(ring=2, ulysses=2), compiler_options=FAST)
    out = ours(PROMPT, seed=0, output_type="latent", progress=False, cache=FirstBlockCache(threshold), **case)
    print(f"FLUX First-Block-Cache: diffusers {np.asarray(diffusers_decisions, int)}, jaxdit")
    print(f"{out.cache.ran.astype(int)} ratios {np.round(out.cache.ratios, 3)}")
    assert out.cache.ran.tolist() == diffusers_decisions
    assert 0 < out.cache.full_steps < 10
    tol.check(latent_ops.pack(out.latents), ref, tol.TORCH_LOOP, "FLUX First-Block-Cache vs diffusers")


WAN_STEPS, WAN_SHIFT = 6, 3.0
WAN_LATENT = (1, wan_tiny.OUT_CHANNELS, 3, 6, 10)  # 45 video tokens


@functools.cache
def _wan_conditioning():
    rng = np.random.default_rng(5)
    text = (1, wan_tiny.text_len(False), wan_tiny.TEXT_DIM)
    return {
        "prompt_embeds": rng.standard_normal(text).astype(np.float32),
        "negative_prompt_embeds": rng.standard_normal(text).astype(np.float32),
    }


@functools.cache
def _wan_pipeline(degrees: tuple):
    from jaxdit.pipelines.wan import WanPipeline

    config = ParallelConfig(**dict(degrees))
    return WanPipeline.from_checkpoint(wan_tiny.diffusers_folder(False), config, compiler_options=FAST)


def _wan_call(degrees: tuple, cache, guidance: float):
    conditioning = (
        _wan_conditioning() if guidance > 1 else {"prompt_embeds": _wan_conditioning()["prompt_embeds"]}
    )
    return _wan_pipeline(degrees)(
        **conditioning,
        height=48,
        width=80,
        num_frames=9,
        num_inference_steps=WAN_STEPS,
        guidance_scale=guidance,
        flow_shift=WAN_SHIFT,
        seed=0,
        output_type="latent",
        progress=False,
        cache=cache,
    )


def _diffusers_scheduler():
    from diffusers import UniPCMultistepScheduler

    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=WAN_SHIFT
    )
    scheduler.set_timesteps(WAN_STEPS)
    return scheduler


def test_wan_first_block_cache_matches_diffusers(diffusers_decisions):
    # The random model's block-0 residual changes by 0.77-1.5 a step: 1.2 gives 1 0 1 0 1 0 (each ratio
    # >= 0.2 from the threshold; steps 2 and 4 compare with the residual of the step before the skip).
    threshold = 1.2
    # A fresh model from the saved folder, as a user loads it (a copy of the shared test model would carry
    # the hook registry a diffusers pipeline call may have left on it).
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(wan_tiny.diffusers_folder(False))
    apply_first_block_cache(model, FirstBlockCacheConfig(threshold=threshold))
    scheduler = _diffusers_scheduler()
    latents = torch.from_numpy(latent_ops.initial_noise(0, WAN_LATENT))
    text = torch.from_numpy(_wan_conditioning()["prompt_embeds"])
    with torch.no_grad():
        for t in scheduler.timesteps:
            with model.cache_context("cond"):
                v = model(hidden_states=latents, timestep=t.expand(1), encoder_hidden_states=text).sample
            latents = scheduler.step(v, t, latents).prev_sample

    out = _wan_call((("ring", 2), ("ulysses", 2)), FirstBlockCache(threshold), guidance=1.0)
    print(f"Wan First-Block-Cache: diffusers {np.asarray(diffusers_decisions, int)}, jaxdit")
    print(f"{out.cache.ran.astype(int)} ratios {np.round(out.cache.ratios, 3)}")
    assert out.cache.ran.tolist() == diffusers_decisions
    assert 0 < out.cache.full_steps < WAN_STEPS
    tol.check(out.latents, latents.numpy(), tol.TORCH_LOOP, "Wan First-Block-Cache vs diffusers")


def test_wan_teacache_follows_teacache4wan_on_every_mesh():
    # The random model's time embedding changes by 0.9-1.4 a step, far outside the range the published
    # polynomials were fitted on (they map it to ~1000): the identity polynomial and 1.5 give 1 0 1 0 1 1.
    coefficients, threshold = (1.0, 0.0), 1.5
    cache = TeaCache(threshold=threshold, coefficients=coefficients)
    model = wan_tiny.model(False)
    with torch.no_grad():
        # TeaCache4Wan2.1's metric input ``e``: the time embedding before the six-way projection.
        embeddings = np.stack(
            [
                model.condition_embedder.time_embedder(
                    model.condition_embedder.timesteps_proj(t.expand(2)).float()
                ).numpy()
                for t in _diffusers_scheduler().timesteps
            ]
        )  # [steps, branches, E]: both branches see the step's timestep
    expected = teacache_wan_reference(embeddings, threshold, coefficients)

    single = _wan_call((), cache, guidance=5.0)
    sharded = _wan_call((("cfg", 2), ("ring", 2), ("tensor", 2)), cache, guidance=5.0)
    print(f"Wan TeaCache: reference {np.asarray(expected, int)}, jaxdit {single.cache.ran.astype(int)}")
    print(sharded.cache.describe())
    assert single.cache.ran.tolist() == expected == sharded.cache.ran.tolist()
    assert 0 < single.cache.full_steps < WAN_STEPS
    assert sharded.cache.devices_agree and sharded.cache.devices == 8
    tol.check(
        sharded.latents, single.latents, tol.SAME_SEED, "Wan TeaCache, cfg2 x ring2 x tensor2 vs one device"
    )
    assert jax.device_count() == 8
