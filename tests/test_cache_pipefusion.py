"""MagCache and TaylorSeer under PipeFusion (jaxdit/pipelines/pipefusion/cache.py) on the bundled tiny-digits.

- the pipelined run with a host-planned cache equals a serial reference written on the unsharded model
  with the same skip pattern and the same stale-K/V semantics (a skipped step writes no K/V, so the next
  full step attends to K/V one more step old), on pipefusion2 x cfg2 and pipefusion2 x ulysses2, and
  the cache really changes the result against uncached PipeFusion (tests/tolerance.py PIPEFUSION);
- the steps that ran every block are the host's plan (MagCache's rule on the stored ratios, TaylorSeer's
  fixed schedule), and the pipelined program holds exactly the collectives of its full steps: the
  skipped steps add none and take no tick;
- ``jaxdit generate --pipefusion_parallel_degree 2 --cache magcache`` (and taylorseer) end to end, and
  the refusals of the data-dependent caches (First-Block-Cache, TeaCache, DBCache, the calibrations)
  with their reason, in one line before any device starts.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_pipefusion as tpf
import tolerance as tol
from flax import nnx
from jax import lax
from pipefusion_helpers import ReferenceContext, TaylorResiduals, collectives, make_mesh

from jaxdit.cache import FirstBlockCache, MagCache, TaylorSeer
from jaxdit.cache.magcache import magcache_pattern, nearest_interp, shipped
from jaxdit.cache.taylor import taylorseer_pattern
from jaxdit.families import load_params
from jaxdit.models.layers import rope_angles
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines import tiny_digits as tiny
from jaxdit.pipelines.tiny_digits import tiny_digits
from jaxdit.samplers import flow_match_euler as euler

PROMPT, STEPS = "07", 8
#: A MagCache threshold that skips on these 8 steps; TaylorSeer's defaults (interval 3, order 1).
CACHES = {
    "magcache": MagCache(threshold=0.5),
    "magcache+taylor": MagCache(threshold=0.5, taylor_order=1),  # MagCache's plan, TaylorSeer's forecast
    "taylorseer": TaylorSeer(interval=3, order=1),
}


@functools.cache
def _pipe(**degrees):
    # The CLI's compile options (the suite runs XLA's CPU backend at -O0 already), so that the `jaxdit
    # generate` runs below find these programs in the suite's compilation cache.
    return tiny_digits(make_mesh(**degrees))


@functools.cache
def _run(name: str | None, warmup: int = 1, **degrees):
    cache = None if name is None else CACHES[name]
    call = dict(tpf.CALL, num_inference_steps=STEPS, num_pipeline_patch=tpf.PATCHES, warmup_steps=warmup)
    return _pipe(**degrees)(PROMPT, **call, cache=cache)


def _host_plan(name: str, warmup: int) -> np.ndarray:
    """The pattern written from the policies' rules directly: the PipeFusion warm-up steps are forced."""
    forced = [0, *range(warmup)]
    if name == "taylorseer":
        cache = CACHES[name]
        return taylorseer_pattern(STEPS, cache.interval, cache.warmup, forced)
    from jaxdit.cache.magcache import config_key

    entry = shipped(config_key("flux", tiny.CONFIG))
    ratios = np.stack([nearest_interp(r, STEPS) for r in entry["ratios"]])
    return magcache_pattern(
        ratios, 0.5, entry.get("max_skips", 2), entry.get("retention", 0.2), sorted(set(forced))
    )


@functools.cache
def _reference_steps():
    """The serial reference's jitted steps (built once): the warm-up step, a full step of one patch, a
    skipped step of one patch; the initial latents and the sigmas."""
    _, model = load_params(tiny.asset_dir(), make_mesh(), jnp.float32)
    cfg, patches = model.config, tpf.PATCHES
    ids = tiny.parse_prompt(PROMPT)
    tokens, pooled = tiny.LabelEncoder.load()([tiny.NULL_LABEL] * len(ids) + ids)  # [uncond; cond]
    size = tiny.LATENT_SIZE
    x = jnp.asarray(latent_ops.pack(latent_ops.initial_noise(tpf.CALL["seed"], (len(ids), 1, size, size))))
    sigmas = euler.set_timesteps(
        euler.FlowMatchEulerConfig(shift=1.0), sigmas=euler.linear_sigmas(STEPS)
    ).sigmas
    t_len, n_img = tokens.shape[1], x.shape[1]
    tp, per = t_len // patches, n_img // patches
    img_ids = latent_ops.image_positions(size, size)
    positions = np.concatenate([np.zeros((t_len, 3), np.float32), img_ids])
    patch_positions = np.stack(
        [
            np.concatenate([positions[m * tp : (m + 1) * tp], img_ids[m * per : (m + 1) * per]])
            for m in range(patches)
        ]
    )
    stacks = {name: nnx.split(getattr(model, name)) for name in ("double_blocks", "single_blocks")}
    layer = lambda name, i: nnx.merge(stacks[name][0], jax.tree.map(lambda a: a[i], stacks[name][1]))
    # [B, T+N, ...] of the whole sequence -> the patches' [text chunk; rows] [M, B, L, ...].
    split = lambda a: jnp.stack(
        [
            jnp.concatenate([a[:, m * tp : (m + 1) * tp], a[:, t_len + m * per : t_len + (m + 1) * per]], 1)
            for m in range(patches)
        ]
    )

    def embedded(xs, txt_tokens):
        return jnp.concatenate(
            [model.txt_in(txt_tokens).astype(jnp.float32), model.img_in(jnp.concatenate([xs, xs]))], 1
        )

    def head(h, sigma, text):
        vec = model.conditioning(jnp.full((2 * len(ids),), sigma), jnp.asarray(pooled), None)
        uncond, cond = jnp.split(model.final_layer(h[:, text:], vec), 2)
        return uncond + tpf.CFG_SCALE * (cond - uncond)

    def forward(xs, txt_tokens, sigma, pos, patch, buffers):
        buffers = dict(buffers)
        vec = model.conditioning(jnp.full((2 * len(ids),), sigma), jnp.asarray(pooled), None)
        layout = tpf._Layout(txt_tokens.shape[1])
        angles = rope_angles(pos, cfg.axes_dim, cfg.theta)[None]
        start = embedded(xs, txt_tokens)
        txt, img = layout.split_local(start)
        for i in range(cfg.depth):
            txt, img = layer("double_blocks", i)(
                txt, img, vec, angles, ReferenceContext(buffers, ("d", i), patch, layout)
            )
        h = layout.join_local([txt, img])
        for i in range(cfg.depth_single_blocks):
            h = layer("single_blocks", i)(h, vec, angles, ReferenceContext(buffers, ("s", i), patch, layout))
        return head(h, sigma, txt_tokens.shape[1]), buffers, h - start

    @jax.jit
    def full_step(x, sigma, sigma_next):
        v, buffers, residual = forward(x, jnp.asarray(tokens), sigma, jnp.asarray(positions), None, {})
        kv = {key: tuple(map(split, pair)) for key, pair in buffers.items()}
        return euler.step(x, v, sigma, sigma_next), kv, split(residual)

    def patch_inputs(x, m):
        xs = lax.dynamic_slice_in_dim(x, m * per, per, 1)
        return xs, lax.dynamic_slice_in_dim(jnp.asarray(tokens), m * tp, tp, 1)

    @jax.jit
    def patch_step(x, m, sigma, sigma_next, buffers):
        xs, txt = patch_inputs(x, m)
        v, buffers, residual = forward(xs, txt, sigma, jnp.asarray(patch_positions)[m], m, buffers)
        x = lax.dynamic_update_slice_in_dim(x, euler.step(xs, v, sigma, sigma_next), m * per, 1)
        return x, buffers, residual

    @jax.jit
    def skip_step(x, m, sigma, sigma_next, residual):
        xs, txt = patch_inputs(x, m)
        v = head(embedded(xs, txt) + residual, sigma, tp)
        return lax.dynamic_update_slice_in_dim(x, euler.step(xs, v, sigma, sigma_next), m * per, 1)

    return full_step, patch_step, skip_step, x, sigmas


@functools.cache
def _reference(ran: tuple[bool, ...], order: int, warmup: int = 1) -> np.ndarray:
    """PipeFusion with a host-planned cache written on the unsharded model (test_pipefusion._reference's
    stale-K/V semantics): warm-up steps on the whole sequence; then per full step, per patch, every layer
    attending to its fresh K/V and the other patches' latest buffered K/V, the residual of all blocks
    (joined [text; image] stream minus the embedded streams) kept per patch; per skipped step, per patch,
    the embedded streams plus the kept residual (order 0) or its Taylor forecast, the buffers untouched."""
    full_step, patch_step, skip_step, x, sigmas = _reference_steps()
    patches, size = tpf.PATCHES, tiny.LATENT_SIZE
    cache, last, full = TaylorResiduals(patches, order), 0, 0
    buffers = None
    for step in range(STEPS):
        s0, s1 = sigmas[step], sigmas[step + 1]
        if step < warmup:
            x, buffers, residual = full_step(x, s0, s1)
            for m in range(patches):
                cache.refresh(m, residual[m], step - last, full)
        elif ran[step]:
            for m in range(patches):
                x, buffers, residual = patch_step(x, m, s0, s1, buffers)
                cache.refresh(m, residual, step - last, full)
        else:
            for m in range(patches):
                x = skip_step(x, m, s0, s1, cache.forecast(m, step - last))
        if ran[step]:
            last, full = step, full + 1
    return np.asarray(latent_ops.unpack(np.asarray(x), size, size))


# --------------------------------------------------------------------------------------------------------
# Exactness against the serial reference
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, warmup, mesh",
    [
        ("magcache", 1, dict(pipefusion=2, cfg=2)),
        ("magcache+taylor", 1, dict(data=2, pipefusion=2, tensor=2)),  # an image per data shard, heads split
        ("taylorseer", 1, dict(pipefusion=2, ulysses=2)),
        # Two warm-up steps: the skipped steps 2 and 3 follow the last warm-up step (its program runs them).
        ("taylorseer", 2, dict(pipefusion=2, ulysses=2)),
    ],
)
def test_cached_pipefusion_follows_the_host_plan_and_equals_the_serial_reference(name, warmup, mesh):
    out = _run(name, warmup, **mesh)
    report = out.cache
    plan = _host_plan(name, warmup)
    np.testing.assert_array_equal(report.ran, plan)
    assert 0 < report.full_steps < STEPS and report.devices_agree
    print(f"\n{name} on {mesh}, warm-up {warmup}: {report.describe()}")
    order = CACHES[name].order if name == "taylorseer" else CACHES[name].taylor_order
    if warmup == 2:
        assert not plan[warmup] and _pipe(**mesh).runner.last_plan.follow[warmup - 1] == 2
    reference = _reference(tuple(bool(r) for r in plan), order, warmup)
    what = f"{name}, {mesh}, M=4, warm-up {warmup} vs the serial reference"
    tol.check(out.latents, reference, tol.PIPEFUSION, what)
    # The cache changes the result: against uncached PipeFusion (the same reference, every step full).
    uncached = _reference((True,) * STEPS, 0, warmup)
    drift = tol.max_error(out.latents, uncached)
    print(f"vs uncached PipeFusion: {drift:.1e}")
    assert drift > 100 * tol.PIPEFUSION.allowed(np.abs(uncached).max())


def test_skipped_steps_take_no_tick_and_no_collective_of_the_blocks():
    """The pipelined program of pipefusion2 x ulysses2 with TaylorSeer holds exactly an uncached phase's
    collectives per tick (the double blocks' patch up, the single blocks' down; Ulysses' four
    all-to-alls per attention slot) and nothing for the skipped steps; its tick loop's trip count is the
    plan's (data), so two plans with different counts of full steps run one compiled program."""
    from jaxdit import hlo_stats

    mesh = dict(pipefusion=2, ulysses=2)
    _run("taylorseer", 1, **mesh)
    _run("taylorseer", 2, **mesh)  # the pipe keeps its last run's plan and programs, whichever ran last
    pipe = _pipe(**mesh)
    plan = pipe.runner.last_plan
    (_, programs), *_ = pipe.runner.cached_programs.items()
    ticks = programs.schedule(len(plan.full_index)).ticks
    fn, args = pipe.last_programs["pipelined"]
    found = hlo_stats.collectives(fn.lower(*args).compile())
    seen = collectives((fn, args))
    slots = sum(len(o) // pipe.model.stages for o in pipe.model.orders.values())
    assert set(seen) == {"collective-permute", "all-to-all"}
    # The tick loop's trip count is data: the walk counts its body once and says the count is inexact.
    assert found and not any(c.count_exact for c in found)
    assert seen["collective-permute"][0] == 2
    assert seen["all-to-all"][0] == 4 * slots
    print(f"\n{len(plan.full_index)} pipelined full steps in {ticks} ticks; {int((~plan.ran).sum())} skipped")
    # One program per kind of step: one warm-up program for every warm-up step (compiled once, the step
    # index is data), one pipelined program for both plans (warm-up 1: 3 full steps, warm-up 2: 2).
    built = programs._built
    assert sorted(k for k in built if k[0] == "async-cached") == [("async-cached", 8)]
    assert built[("async-cached", 8)]._cache_size() == 1
    assert built[("warmup",)]._cache_size() == 1


# --------------------------------------------------------------------------------------------------------
# jaxdit generate
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, flags",
    [
        ("magcache", ["--cache_threshold", "0.5", "--use_cfg_parallel"]),  # the meshes of the runs above
        ("taylorseer", ["--ulysses_degree", "2"]),
    ],
)
def test_generate_runs_a_host_planned_cache_with_pipefusion(name, flags, tmp_path, capsys):
    from jaxdit import cli

    out = tmp_path / "digits.png"
    argv = ["generate", "--pipefusion_parallel_degree", "2", "--cache", name, *flags]
    argv += ["--num_pipeline_patch", "4", "--steps", str(STEPS), "--prompt", PROMPT, "--output", str(out)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "under PipeFusion (host plan): 4 of 8 steps ran every block" in printed and out.is_file(), printed
    assert "held-out digit judge recognises 2 of 2" in printed, printed


@pytest.mark.parametrize(
    "flags, reason",
    [
        (["--cache", "fbcache"], "First-Block-Cache decides each step from block 0's residual"),
        (["--use_teacache"], "TeaCache decides each step from the change of block 0's input"),
        (["--cache", "dbcache"], "DBCache decides each step from the residual of its first Fn blocks"),
        (["--calibrate_magcache", "ratios.json"], "the MagCache calibration measures"),
    ],
)
def test_data_dependent_caches_are_refused_with_pipefusion_before_anything_loads(
    flags, reason, capsys, monkeypatch
):
    from jaxdit import cli, generate

    monkeypatch.setattr(generate, "start_devices", lambda r: pytest.fail("devices started"))
    monkeypatch.setattr(generate, "build", lambda r, mesh: pytest.fail("weights loaded"))
    argv = ["generate", "--pipefusion_parallel_degree", "2", "--steps", "4", *flags]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert reason in err and "\n" not in err, err
    assert "--cache magcache and --cache taylorseer" in err, err


def test_flux_dev_magcache_under_pipefusion_takes_the_published_ratios_of_the_unpadded_model():
    """The stage layout pads FLUX.1-dev's 19 double blocks to 20 at P = 2; MagCache's published ratios
    are keyed by the real config, which the runner resolves against (abstract shapes, no weights)."""
    from jaxdit.models import flux
    from jaxdit.pipelines.pipefusion import runner as pf_runner
    from jaxdit.pipelines.pipefusion.cache import Plan
    from jaxdit.pipelines.pipefusion.flux import FluxPatches, PipeFusionFlux

    config = flux.FluxConfig.preset("flux-dev")
    model = PipeFusionFlux.abstract(config, make_mesh(pipefusion=2), jnp.bfloat16)
    runner = pf_runner.PipeFusionRunner(FluxPatches(config), model)
    policy = runner.cache_policy(MagCache(), (64, 64))
    assert policy.threshold == shipped("flux-dev")["threshold"] and len(policy.mag_ratios[0]) == 28
    plan = Plan.build(policy, 28, 1)
    assert plan.ran[0] and plan.follow.sum() == (~plan.ran).sum() > 0
    assert list(plan.full_index) == [i for i in range(1, 28) if plan.ran[i]]
    print(f"\nflux-dev MagCache, 28 steps: {''.join('F' if r else '.' for r in plan.ran)}")
    with pytest.raises(ValueError, match="First-Block-Cache decides each step"):
        runner.cache_policy(FirstBlockCache(), (64, 64))
