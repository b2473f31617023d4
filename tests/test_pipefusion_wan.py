"""PipeFusion (arXiv 2405.14430) for Wan 2.1 on the tiny random Wan model of tests/wan_tiny.py.

- stages: each device holds 1/P of the blocks (ceil, padded), measured on real arrays and, for
  wan2.1-t2v-14b at P = 2, 4, 8, from abstract shapes;
- warm-up only (warmup_steps = steps) equals the serial ``WanPipeline`` (fp32; the same computation on
  another mesh: tests/tolerance.py SAME_SEED);
- the pipelined phase equals an independent serial reference of PipeFusion's stale-K/V semantics with
  per-patch UniPC state, on meshes with cfg, ulysses, ring, tensor and padded stage slots (PIPEFUSION);
- quality against the serial result (PSNR) with 1 and 2 warm-up steps;
- the compiled programs' collectives are exactly the permutes of activations, latents and cfg's
  prediction (+ Ulysses' all-to-alls inside a stage), with the cost model's bytes;
- ``jaxdit generate``'s checks of the PipeFusion flags for Wan.

The video: 9 frames at 64x64 -> latent [2, 4, 3, 8, 8] -> a 3 x 4 x 4 token grid (48 tokens, 4 latent
rows after patchify); CFG with guidance 5, UniPC with shift 3.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol
import wan_tiny
from flax import nnx
from jax import lax
from pipefusion_helpers import ReferenceContext, TaylorResiduals, collectives, make_mesh

from jaxdit.cache import MagCache, TaylorSeer, magcache
from jaxdit.families import load_params
from jaxdit.generate import GenerateRequest, check_request
from jaxdit.mesh import ParallelConfig
from jaxdit.models import wan
from jaxdit.models.layers import rope_angles
from jaxdit.parallel.pipefusion import PipeSchedule
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines import pipefusion_wan as pw
from jaxdit.pipelines.wan import WanPipeline, swap_features
from jaxdit.samplers import unipc

FAST = {"xla_backend_optimization_level": 0}
BATCH, STEPS, GUIDANCE, SHIFT, SEED = 2, 3, 5.0, 3.0, 0
FRAMES, HEIGHT, WIDTH = 9, 64, 64
GRID = (3, 4, 4)
#: Quality runs: more steps, so that the warm-up steps are a small part of the trajectory.
QUALITY_STEPS = 8


@functools.cache
def _conditioning() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    text = (BATCH, wan_tiny.text_len(False), wan_tiny.TEXT_DIM)
    return {
        "prompt_embeds": rng.standard_normal(text).astype(np.float32),
        "negative_prompt_embeds": rng.standard_normal(text).astype(np.float32),
    }


def _kwargs(steps: int = STEPS) -> dict:
    return dict(
        _conditioning(),
        height=HEIGHT,
        width=WIDTH,
        num_frames=FRAMES,
        num_inference_steps=steps,
        guidance_scale=GUIDANCE,
        flow_shift=SHIFT,
        seed=SEED,
        output_type="latent",
        progress=False,
    )


@functools.cache
def _serial_pipe() -> WanPipeline:
    folder = wan_tiny.diffusers_folder(False)
    return WanPipeline.from_checkpoint(folder, ParallelConfig(), compiler_options=FAST)


@functools.cache
def _serial(steps: int = STEPS) -> np.ndarray:
    return _serial_pipe()(**_kwargs(steps)).latents


@functools.cache
def _pipe(**degrees) -> pw.PipeFusionWanPipeline:
    model = pw.PipeFusionWan.load(wan_tiny.diffusers_folder(False), make_mesh(**degrees), jnp.float32)
    return pw.PipeFusionWanPipeline(model, compiler_options=FAST)


@functools.cache
def _run(warmup: int, patches: int, steps: int = STEPS, patch_by: str = "rows", **degrees) -> np.ndarray:
    pipe = _pipe(**degrees)
    out = pipe(**_kwargs(steps), num_pipeline_patch=patches, warmup_steps=warmup, patch_by=patch_by)
    return out.latents


# --------------------------------------------------------------------------------------------------------
# Parameters per device
# --------------------------------------------------------------------------------------------------------


def _block_bytes(config: wan.WanConfig, itemsize: int) -> tuple[int, int]:
    """(one block, everything else) in bytes; norm/modulation tables are fp32 whatever the dtype."""
    model = wan.abstract_model(config, jnp.bfloat16 if itemsize == 2 else jnp.float32)
    blocks = rest = 0
    for path, var in nnx.to_flat_state(nnx.state(model)):
        size = math.prod(var.shape) * jnp.dtype(var.dtype).itemsize
        if path[0] == "blocks":
            blocks += size
        else:
            rest += size
    return blocks // config.num_layers, rest


def test_wan14b_parameters_per_device_at_p2_p4_p8():
    config = wan.WanConfig.preset("wan2.1-t2v-14b")
    block, rest = _block_bytes(config, 2)
    full = block * config.num_layers + rest
    print(
        f"\nwan2.1-t2v-14b bf16: {full / 2**30:.2f} GiB in all; a block {block / 2**20:.0f} MiB, "
        f"embeddings + head {rest / 2**20:.0f} MiB ({rest / full:.1%}, replicated)"
    )
    for p in (2, 4, 8):
        model = pw.PipeFusionWan.abstract(config, make_mesh(pipefusion=p), jnp.bfloat16)
        measured = model.param_bytes_per_device()
        assert measured == math.ceil(config.num_layers / p) * block + rest
        print(
            f"P={p}: {measured / 2**30:.2f} GiB per device ({measured / full:.3f} of the model; 1/P = {1 / p:.3f})"
        )


def test_tiny_model_stage_slots_on_real_arrays():
    # 2 blocks. P=2: one per device. P=4: 4 slots, device s holds block s for s < 2, zeros after.
    plain = load_params(wan_tiny.diffusers_folder(False), make_mesh())[1]
    key = ("blocks", "self_attn", "q", "kernel")
    expected = np.asarray(nnx.state(plain)["blocks"]["self_attn"]["q"]["kernel"].get_value())
    block, rest = _block_bytes(plain.config, 4)
    for p in (2, 4):
        model = pw.PipeFusionWan.load(wan_tiny.diffusers_folder(False), make_mesh(pipefusion=p), jnp.float32)
        q = dict(nnx.to_flat_state(model.state))[key].get_value()
        assert q.shape[0] == p and all(sh.data.shape[0] == 1 for sh in q.addressable_shards)
        for slot, layer in enumerate(model.order):
            want = expected[layer] if layer >= 0 else np.zeros_like(expected[0])
            np.testing.assert_array_equal(np.asarray(q[slot]), want)
        assert model.param_bytes_per_device() == block + rest
    relaid = pw.PipeFusionWan.from_model(plain, make_mesh(pipefusion=4))
    np.testing.assert_array_equal(
        np.asarray(dict(nnx.to_flat_state(relaid.state))[key].get_value()), np.asarray(q)
    )


# --------------------------------------------------------------------------------------------------------
# Exactness
# --------------------------------------------------------------------------------------------------------


def test_warmup_only_equals_the_serial_pipeline():
    # pipefusion2 x ulysses2 x tensor2: each patch's tokens split over two Ulysses members, heads over two.
    mesh = dict(pipefusion=2, ulysses=2, tensor=2)
    what = f"warmup_steps = steps = {STEPS}, {mesh}, M=2: PipeFusion vs serial"
    tol.check(_run(STEPS, 2, **mesh), _serial(), tol.SAME_SEED, what)


@functools.cache
def _reference(
    steps: int, warmup: int, patches: int, patch_by: str = "rows", ran: tuple | None = None, order: int = 0
) -> np.ndarray:
    """PipeFusion's semantics written directly on the unsharded model: per step, per patch in order,
    every layer attending to its fresh K/V and the other patches' latest buffered K/V; UniPC on each
    patch with that patch's slice of the sampler state (as a separate state per patch).

    ``ran`` (a host-planned cache's plan, ``jaxdit.pipelines.pipefusion.cache``): each full step keeps
    per patch the residual of all blocks (the blocks' output minus the patch embedding); each skipped
    step runs, per patch, the head on the embedding plus the kept residual (``order`` > 0: its Taylor
    forecast), then UniPC on the patch's own state, and writes no K/V."""
    _, model = load_params(wan_tiny.diffusers_folder(False), make_mesh(), jnp.float32)
    c = model.config
    cond = _conditioning()
    text = jnp.asarray(np.concatenate([cond["negative_prompt_embeds"], cond["prompt_embeds"]]))
    latent = (BATCH, c.out_channels, 3, HEIGHT // 8, WIDTH // 8)
    g = pw.Geometry(GRID, patches, 1, 1, 2 * BATCH, BATCH, text.shape[1], patch_by=patch_by)
    x = g.to_patches(np.asarray(wan.patchify(latent_ops.initial_noise(SEED, latent), c.patch_size)), 1)
    positions = g.to_patches(wan.token_positions(GRID), 0)  # [M, n, 3]
    schedule = unipc.set_timesteps(unipc.UniPCConfig(flow_shift=SHIFT), steps)
    graphdef, stacked = nnx.split(model.blocks)
    layer = lambda i: nnx.merge(graphdef, jax.tree.map(lambda a: a[i], stacked))

    def embedded(xs):
        return model.patch_embedding(jnp.concatenate([xs, xs])).astype(jnp.float32)

    def head(h, t):
        temb = model.embed_conditions(jnp.full((2 * BATCH,), t, jnp.float32), text)[0]
        shift, scale = (model.head_modulation[...][None] + temb[:, None, :]).transpose(1, 0, 2)[:, :, None]
        h = wan.layer_norm(h, c.eps) * (1 + scale) + shift
        pred = swap_features(model.head(h), math.prod(c.patch_size), c.out_channels)
        uncond, cond_ = jnp.split(pred, 2)
        return uncond + GUIDANCE * (cond_ - uncond)

    def forward(xs, pos, t, patch, buffers):
        buffers = dict(buffers)
        _, mod, txt, _ = model.embed_conditions(jnp.full((2 * BATCH,), t, jnp.float32), text)
        angles = rope_angles(pos, c.rope_axes_dim, c.rope_theta)[None]
        h = start = embedded(xs)
        for i in range(c.num_layers):
            h = layer(i)(h, mod, txt, None, angles, ReferenceContext(buffers, i, patch))
        return head(h, t), buffers, h - start

    def sampler_step(x, state, m, step, v):
        """UniPC on patch ``m`` with its own slice of the sampler state."""
        xs = lax.dynamic_index_in_dim(x, m, 1, keepdims=False)
        own = unipc.UniPCState(step, *(lax.dynamic_index_in_dim(a, m, 1, keepdims=False) for a in state[1:]))
        xs, own = unipc.step(schedule, own, xs, v)
        put = lambda a, b: lax.dynamic_update_index_in_dim(a, b, m, 1)
        state = unipc.UniPCState(step + 1, *(put(a, b) for a, b in zip(state[1:], own[1:], strict=True)))
        return put(x, xs), state

    @jax.jit
    def full_step(x, state, buffers_unused=None):
        flat = x.reshape(BATCH, -1, x.shape[-1])
        t = jnp.asarray(schedule.timesteps)[state.step_index].astype(jnp.float32)
        v, buffers, residual = forward(flat, jnp.asarray(positions).reshape(-1, 3), t, None, {})
        split = lambda a: jnp.moveaxis(a.reshape(a.shape[0], patches, -1, *a.shape[2:]), 1, 0)
        flat_state = jax.tree.map(lambda a: a.reshape(flat.shape) if a.ndim else a, state)
        x_new, s = unipc.step(schedule, flat_state, flat, v)
        s = jax.tree.map(lambda a: a.reshape(x.shape) if a.ndim else a, s)
        kv = {k: tuple(map(split, kv)) for k, kv in buffers.items()}
        return x_new.reshape(x.shape), s, kv, split(residual)

    @jax.jit
    def patch_step(x, state, m, step, buffers):
        xs = lax.dynamic_index_in_dim(x, m, 1, keepdims=False)
        t = jnp.asarray(schedule.timesteps)[step].astype(jnp.float32)
        v, buffers, residual = forward(xs, jnp.asarray(positions)[m], t, m, buffers)
        return *sampler_step(x, state, m, step, v), buffers, residual

    @jax.jit
    def skip_step(x, state, m, step, residual):
        xs = lax.dynamic_index_in_dim(x, m, 1, keepdims=False)
        t = jnp.asarray(schedule.timesteps)[step].astype(jnp.float32)
        return sampler_step(x, state, m, step, head(embedded(xs) + residual, t))

    x = jnp.asarray(x)
    state = unipc.init_state(x)
    buffers = None
    ran = (True,) * steps if ran is None else ran
    cache, last, full = TaylorResiduals(patches, order), 0, 0
    for step in range(steps):
        if step < warmup:
            x, state, buffers, residual = full_step(x, state)
            for m in range(patches):
                cache.refresh(m, residual[m], step - last, full)
        elif ran[step]:
            for m in range(patches):
                x, state, buffers, residual = patch_step(x, state, jnp.int32(m), jnp.int32(step), buffers)
                cache.refresh(m, residual, step - last, full)
        else:
            for m in range(patches):
                x, state = skip_step(x, state, jnp.int32(m), jnp.int32(step), cache.forecast(m, step - last))
        if ran[step]:
            last, full = step, full + 1
    tokens = swap_features(g.from_patches(np.asarray(x), 1), c.out_channels, math.prod(c.patch_size))
    return np.asarray(wan.unpatchify(tokens, GRID, c.patch_size, c.out_channels))


# The pipelined phase vs the serial reference of stale K/V: the reference attends with a full softmax
# (``reference_attention``), the pipeline with the tiled kernel, log-sum-exp merges and (cfg2) the
# branches on two devices; fp32 rounding differences of ~1e-6 in one forward reach the latents through
# the guidance ``u + 5 (c - u)`` (weights -4 and 5). The bound is tolerance.PIPEFUSION (relative to the
# latents' scale), which covers this and the measured values it states.


@pytest.mark.parametrize(
    "mesh, patches",
    [
        (dict(pipefusion=2, cfg=2, ulysses=2), 2),  # M = P (a full pipeline), cfg's exchange per patch
        (dict(pipefusion=4, ring=2), 4),  # padded stage slots (2 blocks on 4 stages), Ring in a stage
    ],
)
def test_pipelined_phase_equals_a_serial_reference_of_stale_kv(mesh, patches):
    out = _run(1, patches, **mesh)
    reference = _reference(STEPS, 1, patches)
    what = f"{mesh}, M={patches}, warmup 1, vs the serial reference of stale K/V"
    tol.check(out, reference, tol.PIPEFUSION, what)
    drift = tol.max_error(out, _serial())
    print(f"vs serial (stale K/V): {drift:.1e}")
    assert drift > 100 * tol.PIPEFUSION.allowed(np.abs(reference).max())  # stale K/V really is used


#: Host-planned caches under PipeFusion (jaxdit/pipelines/pipefusion/cache.py): MagCache on made-up
#: ratios (both branches; the tiny model ships none) that skip steps 2, 3, 5 and 6 of 8 at threshold 0.5,
#: and TaylorSeer (interval 3, order 1: the same steps).
MAGCACHE_RATIOS = [[1.0, 1.0, 0.99, 0.98, 0.97, 0.96, 0.95, 0.9]] * 2


@pytest.fixture(scope="module")
def wan_caches(tmp_path_factory):
    path = tmp_path_factory.mktemp("magcache") / "ratios.json"
    magcache.save_ratios(str(path), np.asarray(MAGCACHE_RATIOS))
    return {
        "magcache": MagCache(threshold=0.5, ratios=str(path)),
        "taylorseer": TaylorSeer(interval=3, order=1),
    }


@pytest.mark.parametrize(
    "name, mesh",
    [("magcache", dict(pipefusion=2, cfg=2)), ("taylorseer", dict(pipefusion=2, ulysses=2))],
)
def test_host_planned_cache_equals_the_serial_reference_with_per_patch_unipc(name, mesh, wan_caches):
    """A skipped step's UniPC update (the head on the patch embedding plus the kept residual or its
    Taylor forecast, the patch's own multistep state) and the stale K/V after it, against the serial
    reference with the same plan; the cache moves the result against uncached PipeFusion."""
    cache, steps = wan_caches[name], QUALITY_STEPS
    out = _pipe(**mesh)(**_kwargs(steps), num_pipeline_patch=2, warmup_steps=1, cache=cache)
    ran = out.cache.ran
    print(f"\n{name} on {mesh}: {out.cache.describe()}")
    np.testing.assert_array_equal(ran, [True, True, False, False, True, False, False, True])
    order = getattr(cache, "order", 0)
    reference = _reference(steps, 1, 2, "rows", tuple(bool(r) for r in ran), order)
    tol.check(out.latents, reference, tol.PIPEFUSION, f"{name}, {mesh}, M=2 vs the serial reference")
    drift = tol.max_error(out.latents, _reference(steps, 1, 2))
    print(f"vs uncached PipeFusion: {drift:.1e}")
    assert drift > 100 * tol.PIPEFUSION.allowed(np.abs(reference).max())


def test_patches_by_frames_follow_the_same_semantics():
    out = _run(1, 3, patch_by="frames", pipefusion=2, tensor=2)
    what = "pipefusion2 x tensor2, M=3 frames, warmup 1, vs the serial reference"
    tol.check(out, _reference(STEPS, 1, 3, "frames"), tol.PIPEFUSION, what)


def test_i2v_warmup_only_equals_the_serial_pipeline():
    """I2V (condition tokens beside the noise, CLIP features in both branches) on cfg2 x pipefusion2 x
    ulysses2 (tolerance.SAME_SEED, like T2V's warm-up only)."""
    rng = np.random.default_rng(6)
    text = (1, 512, wan_tiny.TEXT_DIM)
    kwargs = dict(
        _kwargs(),
        prompt_embeds=rng.standard_normal(text).astype(np.float32),
        negative_prompt_embeds=rng.standard_normal(text).astype(np.float32),
        image_embeds=rng.standard_normal((1, wan_tiny.IMAGE_TOKENS, wan_tiny.IMAGE_DIM)).astype(np.float32),
        condition=rng.standard_normal((1, 4, *GRID[:1], HEIGHT // 8, WIDTH // 8)).astype(np.float32),
    )
    folder = wan_tiny.diffusers_folder(True)
    serial = WanPipeline.from_checkpoint(folder, ParallelConfig(), compiler_options=FAST)(**kwargs).latents
    mesh = make_mesh(cfg=2, pipefusion=2, ulysses=2)
    pipe = pw.PipeFusionWanPipeline(pw.PipeFusionWan.load(folder, mesh, jnp.float32), compiler_options=FAST)
    out = pipe(**kwargs, num_pipeline_patch=2, warmup_steps=STEPS).latents
    tol.check(out, serial, tol.SAME_SEED, "i2v, cfg2 x pipefusion2 x ulysses2, warm-up only, vs serial")


# --------------------------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------------------------


def test_programs_move_only_activations_latents_and_cfg_prediction():
    """cfg2 x pipefusion2 x ulysses2, M = P = 2 (the plan's choice): the compiled warm-up step and
    pipelined phase send what ``collective_bytes`` and the plan's ``cost.pipefusion_programs`` say."""
    from jaxdit.plan.cost import pipefusion_programs
    from jaxdit.plan.workload import Workload

    mesh, patches = dict(pipefusion=2, cfg=2, ulysses=2), 2
    _run(1, patches, **mesh)
    pipe = _pipe(**mesh)
    (g, cfg), programs = next(iter(pipe._programs.items()))
    cost = pw.collective_bytes(g, pipe.parallel, pipe.config, cfg)
    ticks = programs.schedule(STEPS - 1).ticks
    seen = collectives(pipe.last_programs["pipelined"])
    assert set(seen) == {"collective-permute", "all-to-all"}
    # Per tick: the patch's activations up, the latent patch back to stage 0, cfg's patch prediction.
    assert seen["collective-permute"] == (3 * ticks, ticks * cost["tick"])
    slots = len(pipe.model.order) // pipe.model.stages
    assert seen["all-to-all"][0] == 4 * slots * ticks  # Ulysses: q, k, v, out of each slot, every tick
    warm = collectives(pipe.last_programs["warmup"])
    assert warm["collective-permute"] == ((pipe.model.stages - 1) + 2, cost["warmup_step"])
    print(
        f"\npipelined phase: {ticks} ticks x {cost['tick']} B = {ticks * cost['tick']} B modelled, "
        f"{seen['collective-permute'][1]} B measured; warm-up step {cost['warmup_step']} B modelled, "
        f"{warm['collective-permute'][1]} B measured"
    )
    # The plan's model of the same workload, every collective (Ulysses' all-to-alls included).
    w = Workload.for_config(
        pipe.config,
        height=HEIGHT,
        width=WIDTH,
        frames=FRAMES,
        text_tokens=g.text,
        steps=STEPS,
        requests=BATCH,
        dtype="float32",
    )
    modelled = pipefusion_programs(w, pipe.parallel, 1)
    total = lambda kinds: sum(b for _, b in kinds.values())
    print(
        f"plan model: warm-up step {modelled['warmup']:.0f} B, measured {total(warm):.0f} B; pipelined "
        f"phase ({modelled['ticks']} ticks) {modelled['pipelined']:.0f} B, measured {total(seen):.0f} B"
    )
    assert modelled["ticks"] == ticks
    assert total(warm) == pytest.approx(modelled["warmup"], rel=1e-9)
    assert total(seen) == pytest.approx(modelled["pipelined"], rel=1e-9)


# --------------------------------------------------------------------------------------------------------
# Quality of the approximation
# --------------------------------------------------------------------------------------------------------


def _psnr(a: np.ndarray, reference: np.ndarray) -> float:
    """Latents: the peak is the reference's peak-to-peak range."""
    mse = float(np.mean((a - reference) ** 2))
    peak = float(reference.max() - reference.min())
    return 10 * math.log10(peak**2 / mse) if mse else math.inf


def test_quality_with_one_and_two_warmup_steps():
    serial = _serial(QUALITY_STEPS)
    psnr = {}
    for warmup in (1, 2):
        out = _run(warmup, 2, QUALITY_STEPS, pipefusion=2)
        psnr[warmup] = _psnr(out, serial)
        print(
            f"\npipefusion2, M=2, {QUALITY_STEPS} steps, warmup {warmup}: PSNR {psnr[warmup]:.1f} dB vs serial"
        )
    # The tiny model is random, not trained: its activations change more from step to step than a
    # trained model's, so this is not a statement about real videos; a broken buffer drops PSNR to
    # ~10 dB. More warm-up steps need not help here (measured 32.4 / 32.0 dB); the floor is 3 dB (twice
    # the squared error) below the lower.
    assert min(psnr.values()) > 29


# --------------------------------------------------------------------------------------------------------
# jaxdit generate
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def request_files(tmp_path_factory):
    """An embeddings file for the full-size presets (the checks read only its header) and a weights
    folder (the checks only ask that it exists)."""
    folder = tmp_path_factory.mktemp("wan-pipefusion")
    text = np.zeros((1, 512, 4096), np.float16)
    np.savez(folder / "both.npz", prompt_embeds=text, negative_prompt_embeds=text)
    (folder / "weights").mkdir()
    return folder


def _request(files, **kwargs) -> GenerateRequest:
    base = dict(
        model="wan2.1-t2v-1.3b", weights=str(files / "weights"), prompt_embeds=str(files / "both.npz")
    )
    return GenerateRequest(**{**base, **kwargs})


# 480x832, 81 frames: a 21 x 30 x 52 token grid (30 latent rows after patchify).
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(pipefusion_parallel_degree=4, num_pipeline_patch=2), "num_pipeline_patch=2 is smaller than"),
        (dict(pipefusion_parallel_degree=2, num_pipeline_patch=4), "does not divide the 30 latent rows"),
        # 32 pixels high: 2 latent rows, fewer than the P = 4 patches any default could make
        (dict(pipefusion_parallel_degree=4, height=32), "does not divide the 2 latent rows"),
        (
            dict(pipefusion_parallel_degree=2, num_pipeline_patch=6, ring_degree=8),
            "each of the 6 patches has 5460 video tokens, which ring x ulysses = 8 does not divide",
        ),
        (dict(pipefusion_parallel_degree=32), "exceeds the model's 30 blocks"),
        (dict(pipefusion_parallel_degree=2, warmup_steps=0), "at least one synchronous step"),
        (dict(pipefusion_parallel_degree=2, warmup_steps=60), "warmup_steps=60 exceeds the 50"),
        (dict(num_pipeline_patch=2), "apply to PipeFusion"),
        (dict(pipefusion_parallel_degree=2, ulysses_degree=8), "12 heads cannot be split over ulysses=8"),
        (dict(pipefusion_parallel_degree=2, emulate_devices=8), "multiply to 2 devices, but 8"),
    ],
)
def test_generate_rejects_invalid_wan_pipefusion_requests(request_files, kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_request(_request(request_files, **kwargs))


def test_generate_accepts_valid_wan_pipefusion_requests(request_files):
    for kwargs in (
        dict(pipefusion_parallel_degree=2),  # M = 2 patches of 15 rows
        dict(pipefusion_parallel_degree=2, use_cfg_parallel=True, ulysses_degree=2, emulate_devices=8),
        dict(pipefusion_parallel_degree=3, num_pipeline_patch=5, warmup_steps=50),
    ):
        check_request(_request(request_files, **kwargs))
    assert pw.default_num_patches(4, (21, 30, 52)) == 5
    assert pw.default_num_patches(2, (3, 4, 4), 4, "frames") == 3


def test_cli_generates_wan_latents_with_pipefusion(tmp_path, monkeypatch, capsys):
    """``jaxdit generate --model wan... --pipefusion_parallel_degree 2`` on the tiny model (registered as
    the preset it claims to be): warm-up only gives the serial pipeline's latents."""
    from jaxdit import cli

    monkeypatch.setitem(wan.WanConfig.PRESETS, "wan2.1-t2v-1.3b", wan_tiny.config(False).to_json())
    np.savez(tmp_path / "embeds.npz", **_conditioning())
    out = tmp_path / "latents.npy"
    argv = ["generate", "--model", "wan2.1-t2v-1.3b", "--weights", str(wan_tiny.diffusers_folder(False))]
    argv += ["--prompt_embeds", str(tmp_path / "embeds.npz"), "--output", str(out), "--seed", str(SEED)]
    argv += [
        "--num_frames",
        str(FRAMES),
        "--height",
        str(HEIGHT),
        "--width",
        str(WIDTH),
        "--steps",
        str(STEPS),
    ]
    argv += ["--flow_shift", str(SHIFT), "--pipefusion_parallel_degree", "2", "--warmup_steps", str(STEPS)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    tol.check(np.load(out), _serial(), tol.SAME_SEED, "jaxdit generate, pipefusion2, warm-up only, vs serial")


# --------------------------------------------------------------------------------------------------------
# Full size, from abstract shapes
# --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("degrees", [dict(pipefusion=8), dict(cfg=2, pipefusion=2, ulysses=2)])
def test_wan14b_480p_programs_move_what_the_cost_model_says(degrees):
    """wan2.1-t2v-14b, 832x480, 81 frames (a 21 x 30 x 52 grid, 32,760 tokens), bf16, 50 steps, M = the
    default (P = 8: 10 patches of 3 rows; P = 2: 2 of 15): the compiled warm-up step and pipelined
    phase send exactly the modelled permute (and all-to-all) bytes."""
    from jaxdit.plan.cost import pipefusion_programs
    from jaxdit.plan.workload import Workload

    parallel = ParallelConfig(**degrees)
    config = wan.WanConfig.preset("wan2.1-t2v-14b")
    model = pw.PipeFusionWan.abstract(config, make_mesh(**degrees), jnp.bfloat16)
    grid = (21, 30, 52)
    patches = pw.default_num_patches(parallel.pipefusion, grid, parallel.sequence_degree)
    g = pw.Geometry(grid, patches, parallel.ring, parallel.ulysses, 2, 1, 512)
    warm, run = pw.lower(model, g, steps=50, cfg=True, compiler_options=FAST)
    cost = pw.collective_bytes(g, parallel, config, True)
    ticks = PipeSchedule(parallel.pipefusion, patches, pw.PASSES, 49).ticks
    warm_seen, run_seen = collectives((warm, ())), collectives((run, ()))
    permutes = 1 + (parallel.pipefusion > 1) + (parallel.cfg == 2)
    assert run_seen["collective-permute"] == (permutes * ticks, ticks * cost["tick"])
    assert warm_seen["collective-permute"] == (parallel.pipefusion - 1 + permutes - 1, cost["warmup_step"])
    assert set(run_seen) == {"collective-permute"} | ({"all-to-all"} if parallel.ulysses > 1 else set())
    if patches == parallel.pipefusion:  # the plan's M = P: its model holds for every collective
        w = Workload.create("wan2.1-t2v-14b", height=480, width=832)
        modelled = pipefusion_programs(w, parallel, 1, cpu=True)
        assert sum(b for _, b in run_seen.values()) == pytest.approx(modelled["pipelined"], rel=1e-9)
        assert sum(b for _, b in warm_seen.values()) == pytest.approx(modelled["warmup"], rel=1e-9)
    kv = 2 * math.prod(pw.make_programs(model, g, True).kv_shape()) * 2  # bf16 K and V
    kv_per_device = kv // (parallel.num_devices // parallel.ring)
    print(
        f"\n{parallel.describe()}, M={patches}: {model.param_bytes_per_device() / 2**30:.2f} GiB parameters and "
        f"{kv_per_device / 2**30:.2f} GiB stale K/V per device; warm-up step {cost['warmup_step'] / 2**20:.0f} "
        f"MiB, pipelined step {cost['step'] / 2**20:.1f} MiB sent per device ({ticks} ticks for 49 steps)"
    )
