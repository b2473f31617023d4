"""Cache policies against numpy references written from the published algorithms, and their checks.

The references below are written from the algorithms' descriptions (ParaAttention's / diffusers'
First-Block-Cache, TeaCache4FLUX and TeaCache4Wan2.1), not from jaxdit's code: plain Python loops with
``numpy.polyval`` for the rescaling polynomial and one accumulator per guidance branch, fed the same
sequences of relative L1 changes. jaxdit's decisions run as they run in the step: the pure policy
functions under ``jit`` and ``lax.scan``, with the host plan as data.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdit.cache import FirstBlockCache, TeaCache, parse_cache
from jaxdit.cache.cached_forward import resolve
from jaxdit.cache.policies import (
    RUN,
    SKIP,
    first_block_decision,
    host_plan,
    teacache_decision,
    teacache_pattern,
)
from jaxdit.generate import GenerateRequest, check_request
from jaxdit.models import flux, wan
from jaxdit.pipelines.request import GenerationRequest

FLUX_POLY = (498.651651, -283.781631, 55.8554382, -3.82021401, 0.264230861)


# --------------------------------------------------------------------------------------------------------
# numpy references (from the algorithms)


def fbcache_reference(ratios, threshold):
    """First-Block-Cache: the first step runs (nothing to compare with); later steps run unless block 0's
    residual changed less than ``threshold`` relative to the last full step's."""
    return [i == 0 or not ratios[i] < threshold for i in range(len(ratios))]


def teacache_reference(ratios, threshold, coefficients):
    """TeaCache4FLUX: first and last steps run and reset; in between the rescaled change accumulates and
    the blocks are skipped while the sum stays below the threshold; running resets it."""
    steps, accumulated, ran = len(ratios), 0.0, []
    for i, ratio in enumerate(ratios):
        if i == 0 or i == steps - 1:
            ran.append(True)
            accumulated = 0.0
            continue
        accumulated += float(np.polyval(coefficients, ratio))
        if accumulated < threshold:
            ran.append(False)
        else:
            ran.append(True)
            accumulated = 0.0
    return ran


def teacache_wan_reference(embeddings, threshold, coefficients):
    """TeaCache4Wan2.1 (``teacache_forward``): 2 x steps forward calls, even = conditional, odd =
    unconditional, each with its own accumulator and previous embedding; the first step (calls 0, 1)
    and the last (calls 2 steps - 2, 2 steps - 1) always compute. ``embeddings`` [steps, branches, ...].
    A step runs the blocks when its calls compute."""
    steps, branches = embeddings.shape[:2]
    accumulated, previous, computes = [0.0] * branches, [None] * branches, []
    for call in range(steps * branches):
        i, b = divmod(call, branches)
        e = embeddings[i, b].astype(np.float64)
        if call < branches or call >= steps * branches - branches:
            compute, accumulated[b] = True, 0.0
        else:
            change = np.abs(e - previous[b]).mean() / np.abs(previous[b]).mean()
            accumulated[b] += float(np.polyval(coefficients, change))
            compute = not accumulated[b] < threshold
            if compute:
                accumulated[b] = 0.0
        previous[b] = e
        computes.append(compute)
    per_step = np.asarray(computes).reshape(steps, branches)
    assert (per_step == per_step[:, :1]).all(), "the branches' decisions differ"
    return per_step[:, 0].tolist()


# --------------------------------------------------------------------------------------------------------
# jaxdit's decisions as the step takes them


def _scan_first_block(ratios, threshold):
    plan = jnp.asarray(host_plan(len(ratios), [0]))

    @jax.jit
    def run(ratios):
        def body(_, xs):
            code, ratio = xs
            return None, first_block_decision(code, ratio, jnp.float32(1.0), threshold)

        return jax.lax.scan(body, None, (plan, ratios))[1]

    return np.asarray(run(jnp.asarray(ratios, jnp.float32))).tolist()


def _scan_teacache(ratios, threshold, coefficients):
    plan = jnp.asarray(host_plan(len(ratios), [0, len(ratios) - 1]))

    @jax.jit
    def run(ratios):
        def body(acc, xs):
            code, ratio = xs
            ran, acc = teacache_decision(code, ratio, jnp.float32(1.0), acc, threshold, coefficients)
            return acc, ran

        return jax.lax.scan(body, jnp.float32(0.0), (plan, ratios))[1]

    return np.asarray(run(jnp.asarray(ratios, jnp.float32))).tolist()


@pytest.mark.parametrize("seed", range(4))
def test_first_block_cache_decisions_match_the_reference(seed):
    ratios = np.random.default_rng(seed).uniform(0.0, 0.3, 40).astype(np.float32)
    ratios[0] = np.nan  # the first step has no reference residual (0 / 0)
    ours = _scan_first_block(ratios, 0.12)
    assert ours == fbcache_reference(ratios, 0.12)
    assert 0 < sum(ours) < len(ours)  # both decisions occur


@pytest.mark.parametrize("seed", range(4))
def test_teacache_decisions_match_the_reference(seed):
    ratios = np.random.default_rng(seed).uniform(0.0, 0.25, 40).astype(np.float32)
    ours = _scan_teacache(ratios, 0.4, FLUX_POLY)
    assert ours == teacache_reference(ratios, 0.4, FLUX_POLY)
    assert 2 < sum(ours) < len(ours)


def test_a_nan_ratio_runs():
    """A zero reference gives 0 / 0: both policies run every block rather than reuse garbage."""
    nan = jnp.float32(jnp.nan)
    assert bool(first_block_decision(jnp.int32(0), nan, jnp.float32(1.0), 0.1))
    ran, acc = teacache_decision(jnp.int32(0), nan, jnp.float32(1.0), jnp.float32(0.0), 0.4, FLUX_POLY)
    assert bool(ran) and float(acc) == 0.0


def test_host_pattern_keeps_one_accumulator_per_branch():
    """Separate accumulators: a step runs when either branch asks, and running resets both."""
    rng = np.random.default_rng(3)
    coefficients = (1.0, 0.0)  # poly(x) = x: the accumulator sums the raw changes
    same = rng.uniform(0.0, 0.05, 30).astype(np.float32)
    pattern = teacache_pattern(np.stack([same, same]), 0.1, coefficients, forced=[0, 29])
    alone = teacache_pattern(same[None], 0.1, coefficients, forced=[0, 29])
    assert (pattern == alone).all() and set(pattern) == {RUN, SKIP}
    assert (pattern == np.where(teacache_reference(same, 0.1, (1.0, 0.0)), RUN, SKIP)).all()
    # A branch that changes more makes the step run earlier; the other branch's sum restarts with it.
    other = same * 3
    both = teacache_pattern(np.stack([same, other]), 0.1, coefficients, forced=[0, 29])
    assert (both == teacache_pattern(other[None], 0.1, coefficients, forced=[0, 29])).all()


# --------------------------------------------------------------------------------------------------------
# Configs, defaults and checks


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: FirstBlockCache(threshold=0), "positive finite"),
        (lambda: FirstBlockCache(threshold=float("nan")), "positive finite"),
        (lambda: TeaCache(threshold=-0.1), "positive finite"),
        (lambda: TeaCache(coefficients=(1.0, float("inf"))), "finite numbers"),
        (lambda: parse_cache("deepcache:0.3"), "fbcache, teacache"),
        (lambda: parse_cache("fbcache=0.3"), "NAME:NUMBER"),
        (
            lambda: GenerationRequest(height=16, width=16, num_inference_steps=4, cache="fbcache").check(),
            "FirstBlockCache",
        ),
    ],
)
def test_bad_cache_arguments_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_parse_cache():
    assert parse_cache("FBCache:0.35") == ("fbcache", 0.35)
    assert parse_cache("teacache:0.5") == ("teacache", 0.5)


@pytest.mark.parametrize(
    "preset, grid, expected",
    [
        ("wan2.1-t2v-1.3b", (21, 30, 52), 0.08),
        ("wan2.1-t2v-14b", (21, 45, 80), 0.2),
        ("wan2.1-i2v-14b", (21, 30, 52), 0.26),  # 480 x 832: the 480P model's numbers
        ("wan2.1-i2v-14b", (21, 45, 80), 0.3),  # 720 x 1280: the 720P model's
    ],
)
def test_wan_teacache_defaults_follow_the_model(preset, grid, expected):
    model = wan.abstract_model(wan.WanConfig.preset(preset))
    policy = resolve(TeaCache(), model, grid)
    assert policy.metric == "schedule" and policy.threshold == expected
    assert (
        policy.coefficients
        == wan.TEACACHE[preset + ("" if "i2v" not in preset else "@720p" if expected == 0.3 else "@480p")][0]
    )
    assert resolve(TeaCache(threshold=0.5), model, grid).threshold == 0.5


def test_teacache_without_published_numbers_is_refused():
    tiny = wan.abstract_model(wan.WanConfig(dim=48, ffn_dim=32, num_heads=4, num_layers=2))
    with pytest.raises(ValueError, match="no published coefficients"):
        resolve(TeaCache(), tiny, (1, 2, 2))
    explicit = resolve(TeaCache(threshold=0.1, coefficients=(1.0, 0.0)), tiny, (1, 2, 2))
    assert explicit.coefficients == (1.0, 0.0)


def test_flux_policies():
    model = flux.abstract_model(flux.FluxConfig(hidden_size=64, num_heads=4, axes_dim=(4, 6, 6), depth=1))
    tea = resolve(TeaCache(), model)
    assert (tea.metric, tea.threshold, tea.coefficients) == ("step_input", 0.4, FLUX_POLY)
    fb = resolve(FirstBlockCache(), model)
    assert (fb.metric, fb.threshold) == ("first_block", 0.08)
    assert fb.forced(10) == [0] and tea.forced(10) == [0, 9] and fb.forced(10, [4]) == [0, 4]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(use_fbcache=True, use_teacache=True), "pick one"),
        (dict(cache_threshold=0.1), "needs a cache"),
        (dict(use_fbcache=True, cache_threshold=-1.0), "positive number"),
        (
            dict(use_teacache=True, pipefusion_parallel_degree=2, ulysses_degree=2, use_cfg_parallel=True),
            "TeaCache decides each step from the change of block 0's input over the WHOLE latent",
        ),
    ],
)
def test_cli_cache_flags_are_checked_before_anything_runs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_request(GenerateRequest(**kwargs))


def test_cli_cache_defaults():
    assert GenerateRequest(use_fbcache=True).call().cache == FirstBlockCache(threshold=0.2)  # tiny-digits
    assert GenerateRequest(use_teacache=True).call().cache == TeaCache()
    assert GenerateRequest(use_fbcache=True, cache_threshold=0.1).call().cache == FirstBlockCache(0.1)
    assert GenerateRequest().call().cache is None


def test_plan_prices_a_cache_approximately():
    from jaxdit.plan.cache import cached_generation, check_skip, format_cache
    from jaxdit.plan.search import plan
    from jaxdit.plan.workload import Workload

    report = plan(Workload.create("flux-dev", height=1024, width=1024), 8)
    name, skip = check_skip("fbcache:0.35", report)
    for p in report.plans:
        seconds = cached_generation(p, skip, report.hardware)
        if p.config.pipefusion > 1:
            assert seconds is None
            continue
        # Blocks are ~all of FLUX's compute: the time falls by a bit less than the skipped fraction.
        assert p.timing.generation * (1 - skip) < seconds < p.timing.generation * (1 - 0.9 * skip)
        assert cached_generation(p, 0.0, report.hardware) >= p.timing.generation
    text = format_cache(report, name, skip)
    assert "approximate" in text
    with pytest.raises(ValueError, match="always runs 1 of the 57 blocks"):
        check_skip("fbcache:0.99", report)
    assert "PipeFusion configurations take no fbcache: it decides from the data" in text, text
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        check_skip("teacache:1.0", report)


def test_plan_prices_a_host_planned_cache_under_pipefusion():
    """MagCache under PipeFusion: a skipped step takes no tick, so the run loses exactly the ticks the
    program's own schedule (``PipeSchedule``) drops with those full steps, and each skipped step costs its
    non-block compute and CFG's exchange; the warm-up step is never skipped."""
    from jaxdit.parallel.pipefusion import PipeSchedule
    from jaxdit.plan.cache import cached_generation, format_cache, pipefusion_skipped_steps
    from jaxdit.plan.cost import shapes
    from jaxdit.plan.search import plan
    from jaxdit.plan.workload import Workload

    report = plan(Workload.create("wan2.1-t2v-14b"), 8)
    hw, steps = report.hardware, report.workload.steps
    staged = [p for p in report.plans if p.config.pipefusion > 1]
    assert staged
    for p in staged:
        c, t = p.cost, p.timing
        assert cached_generation(p, 0.0, hw, "magcache") == pytest.approx(t.generation, rel=1e-12)
        skipped = pipefusion_skipped_steps(p, 0.4)
        assert skipped == 20  # 40% of 50 steps, none of them the warm-up step
        ticks = lambda full, c=c: PipeSchedule(c.config.pipefusion, c.patches, c.passes, full).ticks  # noqa: E731
        w = c.workload
        nonblock = w.family.step_terms(w, c.config, shapes(w, c.config)).nonblock_flops / hw.flops
        per_skip = nonblock + t.by_strategy.get("cfg", (0.0, 0.0, False))[1]
        saved = (ticks(steps - 1) - ticks(steps - 1 - skipped)) * t.compute / c.patches
        saved += skipped * (t.comm_exposed - per_skip)
        assert cached_generation(p, 0.4, hw, "magcache") == pytest.approx(t.generation - saved, rel=1e-9)
        # Past every step but the warm-up: the same as skipping all the others.
        most = cached_generation(p, (steps - 1) / steps, hw, "taylorseer")
        assert cached_generation(p, 0.99, hw, "taylorseer") == most < t.generation
        assert cached_generation(p, 0.4, hw, "fbcache") is None  # it decides from the data
    text = format_cache(report, "magcache", 0.4)
    assert "take no magcache" not in text and "no tick of the pipeline" in text, text
    # Wan 2.2 A14B: one PipeFusion run per expert, each with its own warm-up step (never skipped); the
    # skipped steps leave either segment's schedule, and the ticks they save do not depend on the split.
    experts = plan(Workload.create("wan2.2-t2v-a14b"), 8)
    steps = experts.workload.steps
    for p in (p for p in experts.plans if p.config.pipefusion > 1):
        c, t = p.cost, p.timing
        skipped = pipefusion_skipped_steps(p, 0.4)
        assert skipped == round(0.4 * steps)
        ticks = lambda full, c=c: PipeSchedule(c.config.pipefusion, c.patches, c.passes, full).ticks  # noqa: E731
        w = c.workload
        nonblock = w.family.step_terms(w, c.config, shapes(w, c.config)).nonblock_flops
        per_skip = nonblock / experts.hardware.flops + t.by_strategy.get("cfg", (0.0, 0.0, False))[1]
        for high in (10, 20):  # the high-noise expert's steps, its warm-up step included
            a, b = high - 1, steps - high - 1  # each expert's pipelined full steps uncached
            s1 = skipped // 4
            saved = (ticks(a) + ticks(b) - ticks(a - s1) - ticks(b - (skipped - s1))) * t.compute / c.patches
            saved += skipped * (t.comm_exposed - per_skip)
            seconds = cached_generation(p, 0.4, experts.hardware, "magcache")
            assert seconds == pytest.approx(t.generation - saved, rel=1e-9), (p.name, high)
    assert "take no magcache" not in format_cache(experts, "magcache", 0.4)
