"""MagCache, TaylorSeer and DBCache criteria against small numpy re-implementations of the published rules.

The references are written from the papers and the authors' code, not from jaxdit's:

- MagCache (arXiv 2506.09045, Zehong-Ma/MagCache): after the retained first steps, each step multiplies
  the calibrated magnitude ratios since the last full step, adds ``|1 - product|`` to the error, and
  skips while the error is below the threshold and at most K steps were skipped in a row;
- TaylorSeer (arXiv 2503.06923, Shenyi-Z/TaylorSeer ``taylor_utils``): full steps on a fixed schedule
  (the first steps, then every N-th) refresh finite-difference derivatives ``D_{i+1} = (D_i - D_i') / d``
  (an order exists once the previous full step had the order below it), and a skipped step ``k`` steps
  later forecasts ``sum_i D_i k^i / i!``;
- DBCache (vipshop/cache-dit ``DBCacheConfig``): the first Fn blocks' residual compared with the last full
  step's by relative L1 against ``residual_diff_threshold``, ``max_warmup_steps`` steps always computed,
  at most ``max_continuous_cached_steps`` skipped in a row.

The end-to-end half runs the bundled tiny-digits (one device, 8 steps) and feeds the ratios each run
recorded to the references.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdit.cache import DBCache, FirstBlockCache, MagCache, TaylorSeer
from jaxdit.cache import taylor as taylor_impl
from jaxdit.cache.cached_forward import _norm_ratio, resolve
from jaxdit.cache.magcache import magcache_pattern, nearest_interp, shipped
from jaxdit.cache.taylor import taylorseer_pattern
from jaxdit.mesh import ParallelConfig
from jaxdit.models import flux, qwen_image, wan
from jaxdit.pipelines import tiny_digits as tiny

# --------------------------------------------------------------------------------------------------------
# numpy references


def magcache_reference(ratios, threshold, max_skips, retention, forced=(0,)):
    """MagCache4Wan2.1's loop, one accumulator set per guidance branch; a step runs when any branch asks
    (then every branch restarts: both residuals are refreshed)."""
    branches, steps = len(ratios), len(ratios[0])
    acc = [[1.0, 0.0, 0] for _ in range(branches)]  # accumulated ratio, error, skipped steps
    ran = []
    for t in range(steps):
        if t < int(steps * retention + 0.5) or t in forced:  # MagCache4FLUX rounds the retained steps
            ran.append(True)
            acc = [[1.0, 0.0, 0] for _ in range(branches)]
            continue
        wants = []
        for a in acc:
            a[0] *= ratios[len(wants)][t]
            a[1] += abs(1.0 - a[0])
            a[2] += 1
            wants.append(not (a[1] < threshold and a[2] <= max_skips))
        ran.append(any(wants))
        if ran[-1]:
            acc = [[1.0, 0.0, 0] for _ in range(branches)]
    return ran


def taylorseer_schedule_reference(steps, interval, warmup):
    """TaylorSeer's ``cal_type``: the first steps full, then a counter that fires every N-th step."""
    ran, counter = [], 0
    for t in range(steps):
        if t < warmup or counter == interval - 1:
            ran.append(True)
            counter = 0
        else:
            ran.append(False)
            counter += 1
    return ran


def taylorseer_reference(features, ran, order):
    """TaylorSeer's ``derivative_approximation`` / ``taylor_formula`` on a sequence: -> what each step uses
    (the computed feature at a full step, the forecast at a skipped one)."""
    factors, last, used = {}, None, []
    for t, feature in enumerate(features):
        if ran[t]:
            new = {0: feature}
            for i in range(order):
                if i in factors and last is not None:
                    new[i + 1] = (new[i] - factors[i]) / (t - last)
                else:
                    break
            factors, last = new, t
            used.append(feature)
        else:
            k = t - last
            used.append(sum(factors[i] * k**i / math.factorial(i) for i in factors))
    return np.array(used)


def dbcache_reference(ratios, threshold, warmup, max_continuous):
    """cache-dit's DBCache decision: warm-up steps compute; later steps reuse when the Fn residual's
    relative L1 change is below the threshold and the run of cached steps is not at its limit."""
    ran, continuous = [], 0
    for t, ratio in enumerate(ratios):
        cache = t >= warmup and t > 0 and ratio < threshold
        if cache and max_continuous >= 0 and continuous >= max_continuous:
            cache = False
        ran.append(not cache)
        continuous = continuous + 1 if cache else 0
    return ran


# --------------------------------------------------------------------------------------------------------
# MagCache


def test_magcache_by_hand():
    """Constant ratio 0.9, threshold 0.3: errors 0.1, 0.29 (skip, skip), then 0.561 (run), and so on;
    K = 1 allows one skip at a time; retention 0.5 keeps the first half."""
    ratios = np.full((1, 10), 0.9)
    assert magcache_pattern(ratios, 0.3, 5, 0.0, [0]).astype(int).tolist() == [1, 0, 0, 1, 0, 0, 1, 0, 0, 1]
    assert magcache_pattern(ratios, 0.3, 1, 0.0, [0]).astype(int).tolist() == [1, 0, 1, 0, 1, 0, 1, 0, 1, 0]
    assert magcache_pattern(ratios, 0.3, 5, 0.5, [0]).astype(int).tolist() == [1, 1, 1, 1, 1, 0, 0, 1, 0, 0]


@pytest.mark.parametrize("seed", range(6))
def test_magcache_matches_the_reference(seed):
    rng = np.random.default_rng(seed)
    branches, steps = 1 + seed % 2, int(rng.integers(8, 50))
    ratios = rng.uniform(0.85, 1.08, (branches, steps))
    for threshold in (0.03, 0.12, 0.3):
        for max_skips in (1, 2, 4):
            for retention in (0.0, 0.2):
                forced = [0, int(rng.integers(1, steps))]
                got = magcache_pattern(ratios, threshold, max_skips, retention, forced)
                want = magcache_reference(ratios, threshold, max_skips, retention, forced)
                assert got.tolist() == want, (threshold, max_skips, retention)


def test_magcache_resamples_the_ratios_by_nearest_neighbour():
    src = np.arange(10.0)
    assert nearest_interp(src, 4).tolist() == [0.0, 3.0, 6.0, 9.0]  # round(i * 9 / 3)
    # numpy's round (the authors' np.round): halves go to the even neighbour, 0.5 -> 0, 1.5 -> 2, 2.5 -> 2
    assert nearest_interp(src, 19).tolist() == [0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6, 6, 6, 7, 8, 8, 8, 9]
    assert nearest_interp(src, 1).tolist() == [9.0]


def test_magcache_ratio_is_the_mean_token_norm_ratio():
    """gamma_t = mean over real tokens of ||r_t|| / ||r_{t-1}|| (L2 over features)."""
    rng = np.random.default_rng(0)
    x, previous = rng.standard_normal((2, 2, 7, 5)).astype(np.float32)
    valid = np.array([True] * 5 + [False] * 2)
    total, count = _norm_ratio(jnp.asarray(x), jnp.asarray(previous), jnp.asarray(valid))
    per_token = np.linalg.norm(x, axis=-1) / np.linalg.norm(previous, axis=-1)
    np.testing.assert_allclose(float(total / count), per_token[:, valid].mean(), rtol=1e-6)
    assert float(count) == 2 * 5


def test_magcache_ships_ratios_for_every_family():
    """Published ratios (the authors' repository) for FLUX.1-dev and the Wan models they calibrated;
    jaxdit's own calibration for tiny-digits, found through the model as ``MagCache()`` finds them."""
    assert shipped("flux-dev")["steps"] == 28 and len(shipped("flux-dev")["ratios"]) == 1
    model = flux.abstract_model(flux.FluxConfig.preset("flux-dev"))
    policy = resolve(MagCache(), model)
    assert (policy.threshold, policy.max_skips, policy.retention) == (0.24, 5, 0.1)
    for preset in ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.2-ti2v-5b"):
        policy = resolve(MagCache(), wan.abstract_model(wan.WanConfig.preset(preset)), (21, 30, 52))
        assert len(policy.mag_ratios) == 2, preset  # conditional and unconditional
    digits = resolve(MagCache(), flux.abstract_model(tiny.CONFIG))
    assert len(digits.mag_ratios[0]) == 20 and digits.threshold == 0.25
    assert resolve(MagCache(threshold=0.1, max_skips=3), flux.abstract_model(tiny.CONFIG)).max_skips == 3


def test_magcache_published_flux_sets():
    """FLUX.1-schnell's 4 ratios with the shipped settings skip step 2 alone, the step the authors skip by
    hand; FLUX.1 Kontext [dev]'s set is chosen by name (its architecture is FLUX.1-dev's)."""
    schnell = resolve(MagCache(), flux.abstract_model(flux.FluxConfig.preset("flux-schnell")))
    assert schnell.host_pattern(4, [0]).astype(int).tolist() == [1, 1, 0, 1]
    kontext = resolve(
        MagCache(ratios="flux-kontext-dev"), flux.abstract_model(flux.FluxConfig.preset("flux-dev"))
    )
    assert (kontext.threshold, kontext.max_skips, len(kontext.mag_ratios[0])) == (0.05, 4, 28)
    assert kontext.mag_ratios[0][1] == 1.19531


def test_magcache_published_qwen_image_sets():
    """Qwen-Image's published architecture takes the authors' MagCache4QwenImage set without a file: 50
    steps, the interleaved list split into conditional / unconditional (pad 1.0 first), 0.06 / K 2 /
    retention 0.2; Qwen-Image-Edit's set (same architecture) is chosen by name. Values as published in
    Zehong-Ma/MagCache MagCache4QwenImage/ and MagCache4QwenImageEdit/magcache_generate.py."""
    model = qwen_image.abstract_model(qwen_image.QwenImageConfig.preset("qwen-image"))
    policy = resolve(MagCache(), model)
    assert (policy.threshold, policy.max_skips, policy.retention) == (0.06, 2, 0.2)
    cond, uncond = (np.asarray(r) for r in policy.mag_ratios)
    assert len(cond) == len(uncond) == 50
    assert cond[:3].tolist() == [1.0, 1.64062, 1.45312] and cond[-1] == 0.55078
    np.testing.assert_array_equal(cond, uncond)  # the authors' Qwen-Image pairs are equal
    edit = resolve(MagCache(ratios="qwen-image-edit"), model)
    e_cond, e_uncond = (np.asarray(r) for r in edit.mag_ratios)
    assert e_cond[:3].tolist() == [1.0, 1.41406, 1.09375] and e_cond[-1] == 0.50781
    # The one unequal pair (published list entries 38 / 39 -> step 20): the split keeps them apart.
    assert (e_cond[20], e_uncond[20]) == (1.07031, 1.0625)
    assert np.flatnonzero(e_cond != e_uncond).tolist() == [20]
    # The authors' ComfyUI 40-step set (Zehong-Ma/ComfyUI-MagCache nodes.py ``qwen_image``), by name.
    forty = resolve(MagCache(ratios="qwen-image@40steps"), model)
    f_cond, f_uncond = (np.asarray(r) for r in forty.mag_ratios)
    assert len(f_cond) == 40 and (forty.threshold, f_cond[1], f_cond[-1]) == (0.1, 1.6875, 0.54688)
    assert (f_cond[3], f_uncond[3]) == (1.34375, 1.33594)
    # Another step count interpolates the published 50 (nearest), as for FLUX / Wan.
    assert nearest_interp(cond, 8).shape == (8,)
    small = qwen_image.abstract_model(qwen_image.QwenImageConfig.preset("qwen-image", num_layers=1))
    with pytest.raises(ValueError, match="--calibrate_magcache FILE"):
        resolve(MagCache(), small)  # another architecture still needs its calibration


def test_magcache_published_hunyuan_video15_sets():
    """HunyuanVideo 1.5 720p T2V takes the authors' published set (Zehong-Ma/ComfyUI-MagCache nodes.py
    ``hunyuan_video1.5``: 20 steps, cond / uncond interleaved, README's 0.03 / K 2 / retention 0.25)
    without a file; the 40-step set by name; another preset still needs a calibration, and the family's
    pre-load check refuses MagCache only there."""
    from types import SimpleNamespace

    from jaxdit.families.base import check_calibrated_caches
    from jaxdit.models import hunyuan_video15 as hv

    model = hv.abstract_model(hv.HunyuanVideo15Config.preset("hunyuanvideo1.5-720p"))
    policy = resolve(MagCache(), model, (5, 45, 80))
    assert (policy.threshold, policy.max_skips, policy.retention) == (0.03, 2, 0.25)
    cond, uncond = (np.asarray(r) for r in policy.mag_ratios)
    assert len(cond) == len(uncond) == 20
    assert cond[:3].tolist() == [1.0, 1.01172, 0.9873] and uncond[:3].tolist() == [1.0, 1.00293, 1.0127]
    assert (cond[-1], uncond[-1]) == (0.94824, 0.94873)
    forty = resolve(MagCache(ratios="hunyuanvideo1.5-720p@40steps"), model, (5, 45, 80))
    f_cond, f_uncond = (np.asarray(r) for r in forty.mag_ratios)
    assert len(f_cond) == 40 and f_cond[1] == 1.04199 and f_uncond[1] == 1.01953
    assert (f_cond[-1], f_uncond[-1]) == (0.81787, 0.81836)
    with pytest.raises(ValueError, match="--calibrate_magcache FILE"):
        resolve(
            MagCache(), hv.abstract_model(hv.HunyuanVideo15Config.preset("hunyuanvideo1.5-480p")), (5, 30, 52)
        )
    request = SimpleNamespace(cache=MagCache())
    check_calibrated_caches(request, "HunyuanVideo 1.5", magcache_published=True)
    with pytest.raises(ValueError, match="MagCache has no published numbers"):
        check_calibrated_caches(request, "HunyuanVideo 1.5")


def test_magcache_without_ratios_is_refused():
    small = flux.abstract_model(flux.FluxConfig(hidden_size=64, num_heads=4, axes_dim=(4, 6, 6), depth=1))
    # It names the flags that exist: record once, then pass the file.
    with pytest.raises(ValueError, match="--calibrate_magcache FILE.*--magcache_ratios FILE"):
        resolve(MagCache(), small)


# --------------------------------------------------------------------------------------------------------
# TaylorSeer


@pytest.mark.parametrize("steps, interval, warmup", [(20, 3, 2), (28, 5, 3), (10, 1, 1), (7, 4, 1)])
def test_taylorseer_schedule_matches_the_reference(steps, interval, warmup):
    assert taylorseer_pattern(steps, interval, warmup).tolist() == taylorseer_schedule_reference(
        steps, interval, warmup
    )


def _jaxdit_taylor(features, ran, order):
    """jaxdit's update / forecast, stepped as the cached step steps them (jitted)."""
    update, forecast = jax.jit(taylor_impl.update), jax.jit(taylor_impl.forecast)
    derivatives = tuple(jnp.zeros_like(jnp.asarray(features[0])) for _ in range(order + 1))
    last, full, used = 0, 0, []
    for t, feature in enumerate(features):
        distance = jnp.int32(t - last)
        if ran[t]:
            derivatives = update(derivatives, jnp.asarray(feature), distance, jnp.int32(full))
            last, full = t, full + 1
            used.append(np.asarray(feature))
        else:
            used.append(np.asarray(forecast(derivatives, distance)))
    return np.array(used)


@pytest.mark.parametrize("order", [1, 2, 3])
def test_taylorseer_forecast_matches_the_reference(order):
    rng = np.random.default_rng(order)
    features = rng.standard_normal((20, 6)).astype(np.float32)
    ran = taylorseer_pattern(20, 3, 2)
    ran[9] = True  # an uneven gap: the differences divide by the real distance
    np.testing.assert_allclose(
        _jaxdit_taylor(features, ran, order), taylorseer_reference(features, ran, order), rtol=2e-5, atol=2e-5
    )


def test_taylorseer_forecasts_a_polynomial_of_its_order_exactly():
    """A residual linear in the step is forecast exactly at order 1 (reuse is off by the slope)."""
    t = np.arange(16, dtype=np.float32)[:, None]
    features = 0.5 + 0.25 * t * np.ones((1, 3), np.float32)
    ran = taylorseer_pattern(16, 4, 2)
    np.testing.assert_allclose(_jaxdit_taylor(features, ran, 1), features, atol=1e-5)
    reuse = _jaxdit_taylor(features, ran, 0)
    assert np.abs(reuse - features).max() >= 0.5  # order 0 is plain reuse: 3 steps x 0.25 behind


# --------------------------------------------------------------------------------------------------------
# Configs


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: MagCache(threshold=0), "positive finite"),
        (lambda: MagCache(max_skips=0), "max_skips"),
        (lambda: MagCache(retention=1.0), "retention"),
        (lambda: MagCache(ratios="/nonexistent.json"), "does not exist"),
        (lambda: TaylorSeer(interval=0), "interval"),
        (lambda: TaylorSeer(order=0), "order must be >= 1"),
        (lambda: TaylorSeer(order=7), r"\[0, 4\]"),
        (lambda: DBCache(fn=0), "fn must be"),
        (lambda: DBCache(bn=-1), "bn must be"),
        (lambda: DBCache(max_continuous=-2), "max_continuous"),
        (lambda: FirstBlockCache(taylor_order=5), "taylor order"),
        (lambda: resolve(DBCache(fn=3, bn=1), flux.abstract_model(tiny.CONFIG)), "no middle block"),
    ],
)
def test_bad_new_cache_arguments_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# --------------------------------------------------------------------------------------------------------
# End to end on tiny-digits (one device, 8 steps): the decisions the step took, against the references

CALL = dict(negative_prompt="", true_cfg_scale=3.0, height=16, width=16, seed=3, progress=False)
STEPS = 8


@functools.cache
def _pipe():
    return tiny.tiny_digits(
        ParallelConfig().make_mesh(jax.devices()[:1]), compiler_options={"xla_backend_optimization_level": 0}
    )


@functools.cache
def _run(cache):
    return _pipe()("0123456789", cache=cache, num_inference_steps=STEPS, **CALL)


def test_dbcache_decisions_match_cache_dit_and_f1b0_is_first_block_cache():
    cache = DBCache(threshold=0.3, fn=1, bn=0, warmup=2, max_continuous=1)
    report = _run(cache).cache
    assert report.ran.tolist() == dbcache_reference(report.ratios, 0.3, warmup=2, max_continuous=1)
    assert 0 < report.full_steps < STEPS
    assert report.skipped_fraction == (STEPS - report.full_steps) * 3 / (STEPS * 4)
    # Fn = 1, Bn = 0, no warm-up, no limit is First-Block-Cache: the same ratios, decisions and latents.
    db, fb = _run(DBCache(threshold=0.2, fn=1, bn=0, warmup=0)), _run(FirstBlockCache(threshold=0.2))
    np.testing.assert_array_equal(db.cache.ratios, fb.cache.ratios)
    assert db.cache.ran.tolist() == fb.cache.ran.tolist()
    np.testing.assert_array_equal(db.latents, fb.latents)


def test_dbcache_back_blocks_run_at_every_step():
    """F1B1: the last block runs on skipped steps too (its output is not the stored one): with every
    middle block skipped after the warm-up, the pictures differ from F1B0's, and the skipped fraction
    counts 2 of 4 blocks per skipped step."""
    f1b1 = _run(DBCache(threshold=10.0, fn=1, bn=1, warmup=2))
    f1b0 = _run(DBCache(threshold=10.0, fn=1, bn=0, warmup=2))
    assert f1b1.cache.full_steps == f1b0.cache.full_steps == 2
    assert f1b1.cache.skipped_fraction == 6 * 2 / (STEPS * 4)
    assert np.abs(f1b1.latents - f1b0.latents).max() > 1e-3


def test_magcache_decisions_follow_the_shipped_ratios():
    report = _run(MagCache()).cache
    ratios = nearest_interp(shipped_digits()["ratios"][0], STEPS)[None]
    assert report.ran.tolist() == magcache_reference(ratios, 0.25, 2, 0.2)
    assert 0 < report.full_steps < STEPS


def shipped_digits():
    from jaxdit.cache.magcache import config_key

    return shipped(config_key("flux", tiny.CONFIG))


def test_taylorseer_alone_and_on_magcache_forecast_closer_than_reuse():
    """TaylorSeer(N=3, warm-up 1) and MagCache with an unreachable threshold and K = 2 run the same steps
    (0, 3, 6); MagCache reuses the residual, TaylorSeer forecasts it (order 1) and lands closer to the
    uncached latents; MagCache with ``taylor_order=1`` is then TaylorSeer exactly."""
    base = _run(None)
    forecast = _run(TaylorSeer(interval=3, order=1, warmup=1))
    reuse = _run(MagCache(threshold=1e9, max_skips=2, retention=0.0))
    both = _run(MagCache(threshold=1e9, max_skips=2, retention=0.0, taylor_order=1))
    schedule = taylorseer_schedule_reference(STEPS, 3, 1)
    assert schedule == [True, False, False, True, False, False, True, False]
    assert forecast.cache.ran.tolist() == reuse.cache.ran.tolist() == both.cache.ran.tolist() == schedule
    error = lambda out: float(np.abs(out.latents - base.latents).mean())
    assert error(forecast) < error(reuse), (error(forecast), error(reuse))
    np.testing.assert_allclose(both.latents, forecast.latents, rtol=0, atol=1e-6)


def test_taylorseer_on_first_block_cache_decides_as_first_block_cache_and_forecasts():
    threshold = 0.4  # at 8 steps 0.2 skips nothing
    plain = _run(FirstBlockCache(threshold=threshold))
    forecast = _run(FirstBlockCache(threshold=threshold, taylor_order=1))
    report = forecast.cache
    assert report.ran.tolist() == [i == 0 or not r < threshold for i, r in enumerate(report.ratios)]
    assert 0 < report.full_steps < STEPS
    assert np.abs(forecast.latents - plain.latents).max() > 1e-4  # the skipped steps forecast, not reuse
