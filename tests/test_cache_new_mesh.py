"""MagCache, TaylorSeer (alone, on First-Block-Cache, on MagCache) and DBCache on cfg2 x ring2 x ulysses2
(8 emulated devices), with the bundled tiny-digits (FLUX architecture, 2 + 2 blocks, 10 steps):

- every device takes the same decision at every step (each writes its own row of a record sharded over
  every mesh axis; the rows are compared), and the decisions are the single-device run's;
- the latents equal the same cache's run on one device to fp32 rounding (``tolerance.SAME_SEED``);
- the step is one compiled program for the whole loop, both decisions taken: ONE ``conditional``, whose
  skip branch holds no collective (DBCache's back block and the first blocks run outside it);
- ``pipe(..., cache=...)`` takes each config (tests/test_cache_new_cli.py: the command line).
"""

from __future__ import annotations

import functools

import jax
import pytest
import tolerance as tol
from test_cache_mesh import _conditionals

from jaxdit.cache import DBCache, FirstBlockCache, MagCache, TaylorSeer
from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines import tiny_digits as tiny

FAST = {"xla_backend_optimization_level": 0}
STEPS = 10
CALL = dict(negative_prompt="", true_cfg_scale=3.0, num_inference_steps=STEPS, seed=7, progress=False)
#: Settings that take both decisions at 10 steps on tiny-digits.
CACHES = {
    "magcache": MagCache(),  # tiny-digits' shipped ratios and threshold
    "taylorseer": TaylorSeer(interval=3, order=2),
    "fbcache+taylor": FirstBlockCache(threshold=0.3, taylor_order=1),
    "magcache+taylor": MagCache(taylor_order=1),
    "dbcache": DBCache(threshold=0.3, fn=1, bn=1, warmup=2),
}
#: Blocks each runs outside the conditional (at every step).
ALWAYS = {"magcache": 0, "taylorseer": 0, "fbcache+taylor": 1, "magcache+taylor": 0, "dbcache": 2}


@functools.cache
def _pipeline(mesh: bool):
    config = ParallelConfig(cfg=2, ring=2, ulysses=2) if mesh else ParallelConfig()
    return tiny.tiny_digits(config.make_mesh(jax.devices()[: config.num_devices]), compiler_options=FAST)


@functools.cache
def _generate(mesh: bool, cache: str):
    pipe = _pipeline(mesh)
    out = pipe("0123456789", height=16, width=16, cache=CACHES[cache], **CALL)
    return out, pipe.last_step


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_same_decisions_on_every_device_and_the_single_device_result(cache):
    out, (step, args) = _generate(True, cache)
    single, _ = _generate(False, cache)
    report = out.cache
    print(report.describe(), report.ran.astype(int))
    assert report.devices == 8 and report.per_device.shape == (8, STEPS)
    # Every device wrote its own decision at every step (the records start at -1), both decisions taken.
    assert set(report.per_device.ravel().tolist()) == {0, 1}, report.per_device
    for device in range(8):
        assert report.per_device[device].tolist() == report.per_device[0].tolist(), device
    assert report.devices_agree
    assert report.ran.tolist() == single.cache.ran.tolist()
    assert 0 < report.full_steps < STEPS  # both decisions taken
    assert report.always_run == ALWAYS[cache]
    tol.check(out.latents, single.latents, tol.SAME_SEED, f"{cache}: cfg2 x ring2 x ulysses2 vs one device")

    # One compiled program for the whole loop; one conditional, its skip branch without collectives.
    assert step._cache_size() == 1
    conditionals = [c for c in _conditionals(step.lower(*args).compile()) if any(c)]
    assert len(conditionals) == 1, conditionals
    run, skip = sorted(conditionals[0], key=len, reverse=True)
    assert skip == []
    skipped_layers = tiny.CONFIG.depth + tiny.CONFIG.depth_single_blocks - ALWAYS[cache]
    assert run.count("all-to-all") == 4 * skipped_layers  # Ulysses: q, k, v, out per attention layer


def test_pipe_call_takes_every_new_cache():
    """``pipe(..., cache=...)`` with each config; a wrong object is refused by name."""
    pipe = _pipeline(False)
    out = pipe("4", height=16, width=16, cache=DBCache(threshold=0.3, fn=1, bn=0, warmup=2), **CALL)
    assert out.cache.setting == "DBCache (threshold 0.3, F1B0)" and out.cache.steps == STEPS
    with pytest.raises(ValueError, match="MagCache, TaylorSeer or DBCache"):
        pipe("4", height=16, width=16, cache="magcache", **CALL)
