"""Feature-cache policies as data and pure decision functions: First-Block-Cache and TeaCache.

Both skip the expensive part of a denoising step when its input barely changed since a step that ran
in full, and reuse the residual that part produced then (``output - input`` of the skipped blocks).

First-Block-Cache (ParaAttention's ``first_block_cache``; diffusers ``hooks/first_block_cache.py``):
block 0 of the first stack runs at every step; its residual ``r`` (output - input, on the model's metric
stream) is compared with ``r_prev``, block 0's residual at the last step that ran every block::

    rel = mean|r - r_prev| / mean|r_prev|

Below ``threshold`` the remaining blocks are skipped and the residual they produced at that last full
step is added to block 0's output; otherwise they run and both residuals are stored. The first step
always runs (there is no ``r_prev``); nothing else is forced, as in diffusers and ParaAttention.

TeaCache (Liu et al., "Timestep Embedding Tells: It's Time to Cache for Video Diffusion Model",
arXiv 2411.19108; ali-vilab/TeaCache ``TeaCache4FLUX/teacache_flux.py``,
``TeaCache4Wan2.1/teacache_generate.py``): a cheap input ``x`` of the step (FLUX: block 0's modulated
image input; Wan 2.1: the timestep embedding) is compared with the previous step's::

    acc += poly(mean|x - x_prev| / mean|x_prev|)

``poly`` is the model's published rescaling polynomial (highest power first). While ``acc`` stays below
``threshold`` every block is skipped and the residual of all blocks at the last full step is added to
their input; otherwise they run and ``acc`` restarts at 0. The first and last steps always run (and
restart ``acc``). ``x_prev`` is updated at every step, full or not.

A comparison with a NaN ratio (a zero reference) never skips: the decisions are written as "skip when
below", so NaN runs.

Where jaxdit differs from diffusers' hook, on purpose: one decision per step for both guidance branches
(diffusers keeps a cache state per branch, ``cache_context("cond" / "uncond")``; here both branches run
in one step, on one device or over ``cfg``, and the metric sums over both), and the comparison "skip
when below" where diffusers writes "compute when above" (they differ only when the ratio equals the
threshold exactly).

The host plan. Before the loop, each step gets a code: :data:`RUN` (forced: the first step, TeaCache's
last, an expert switch), :data:`SKIP` (decided on the host) or :data:`DECIDE` (decided inside the
compiled step from the data). When a metric depends on the schedule only (Wan's timestep embedding) the
whole pattern is computed on the host (:func:`teacache_pattern`) and the step reads it as data; when it
depends on the latents (FLUX, First-Block-Cache) the step decides with :func:`first_block_decision` /
:func:`teacache_decision`. Either way the compiled step is the same program at every step.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "DECIDE",
    "TEACACHE_THRESHOLD",
    "RUN",
    "SKIP",
    "FirstBlockCache",
    "TeaCache",
    "TeaCacheCalibration",
    "first_block_decision",
    "host_plan",
    "load_teacache_file",
    "parse_cache",
    "rescale",
    "teacache_accumulate",
    "teacache_decision",
    "teacache_pattern",
]

#: Host plan codes, one per step.
DECIDE, RUN, SKIP = 0, 1, 2


def _check_threshold(name: str, threshold: float | None) -> None:
    if threshold is None:
        return
    if isinstance(threshold, bool) or not isinstance(threshold, int | float):
        raise TypeError(f"{name} threshold must be a number, got {threshold!r}")
    if not math.isfinite(threshold) or threshold <= 0:
        raise ValueError(f"{name} threshold must be a positive finite number, got {threshold}")


@dataclasses.dataclass(frozen=True)
class FirstBlockCache:
    """First-Block-Cache (see the module docstring): ``pipe(..., cache=FirstBlockCache(threshold=0.08))``.

    ``threshold``: the relative L1 change of block 0's residual under which the other blocks are skipped.
    0.08 is the value ParaAttention measured on FLUX.1-dev (26.4 s -> 17.0 s, 1.55x); diffusers'
    ``FirstBlockCacheConfig`` defaults to 0.05 and xDiT to 0.12.
    """

    threshold: float = 0.08
    #: > 0: the skipped blocks' residual is forecast by TaylorSeer (``jaxdit.cache.taylor``) of this order.
    taylor_order: int = 0

    name: ClassVar[str] = "fbcache"
    title: ClassVar[str] = "First-Block-Cache"

    def __post_init__(self) -> None:
        _check_threshold(self.title, self.threshold)
        if isinstance(self.taylor_order, bool) or self.taylor_order not in range(5):
            raise ValueError(
                f"First-Block-Cache taylor order must be an integer in [0, 4], got {self.taylor_order!r}"
            )


@dataclasses.dataclass(frozen=True)
class TeaCache:
    """TeaCache (see the module docstring): ``pipe(..., cache=TeaCache(threshold=0.4))``.

    ``threshold`` and ``coefficients`` default to the model's published ones (its transformer says which:
    FLUX.1 0.4, about 1.8x on FLUX.1-dev; Wan 2.1 per model, see ``jaxdit/models/wan.py``).
    ``coefficients`` may also name a file a calibration wrote (``jaxdit generate --calibrate_teacache
    FILE``, :func:`jaxdit.cache.calibrate.calibrate_teacache`): its polynomial, and its threshold where
    ``threshold`` is None.
    """

    threshold: float | None = None
    coefficients: tuple[float, ...] | str | None = None

    name: ClassVar[str] = "teacache"
    title: ClassVar[str] = "TeaCache"

    def __post_init__(self) -> None:
        _check_threshold(self.title, self.threshold)
        if isinstance(self.coefficients, str):
            load_teacache_file(self.coefficients)  # a missing or malformed file: one line, now
        elif self.coefficients is not None:
            coefficients = tuple(float(c) for c in self.coefficients)
            if not coefficients or not all(math.isfinite(c) for c in coefficients):
                raise ValueError(f"TeaCache coefficients must be finite numbers, got {self.coefficients}")
            object.__setattr__(self, "coefficients", coefficients)


@dataclasses.dataclass(frozen=True)
class TeaCacheCalibration:
    """TeaCache's calibration pass as a cache: every step computes every block and records the relative
    L1 change of the model's TeaCache input and of its prediction since the previous step (what
    :func:`jaxdit.cache.calibrate.fit_teacache` fits the polynomial to)."""

    name: ClassVar[str] = "teacache-calibration"
    title: ClassVar[str] = "TeaCache calibration"
    threshold: ClassVar[float] = math.inf


#: The threshold a TeaCache calibration records (and a file without one means): TeaCache4FLUX's 0.4
#: (about 1.8x on FLUX.1-dev).
TEACACHE_THRESHOLD = 0.4


def load_teacache_file(path: str) -> dict[str, Any]:
    """A TeaCache coefficients file (``jaxdit.cache.calibrate.save_teacache_file``'s) -> {"coefficients":
    tuple, "threshold": float, ...}; one line if it is missing or unusable."""
    try:
        with open(path) as f:
            entry = json.load(f)
        coefficients = tuple(float(c) for c in entry["coefficients"])
        threshold = float(entry.get("threshold", TEACACHE_THRESHOLD))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"cannot read TeaCache coefficients {path!r}: {e}") from None
    if (
        not coefficients
        or not all(np.isfinite(coefficients))
        or not (np.isfinite(threshold) and threshold > 0)
    ):
        raise ValueError(f"{path}: 'coefficients' must be finite numbers and 'threshold' a positive one")
    return {**entry, "coefficients": coefficients, "threshold": threshold}


#: The caches by their names (``--cache NAME``): filled in by ``jaxdit.cache``, which knows every one.
CACHES: dict[str, type] = {}


def parse_cache(text: str) -> tuple[str, float]:
    """``"fbcache:0.35"`` -> ("fbcache", 0.35): a cache's name and a number (``jaxdit plan --cache``)."""
    name, sep, value = text.partition(":")
    name = name.strip().lower()
    if name not in CACHES or not sep:
        raise ValueError(
            f"cannot read cache {text!r}; write NAME:NUMBER with NAME one of {', '.join(CACHES)}"
        )
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"cannot read the number in cache {text!r}") from None
    return name, number


# --------------------------------------------------------------------------------------------------------
# Decisions (pure, jit-able; every argument may be traced)
# --------------------------------------------------------------------------------------------------------


def rescale(coefficients: Sequence[float], x: jax.Array) -> jax.Array:
    """``numpy.poly1d(coefficients)(x)`` (highest power first), by Horner's rule."""
    y = jnp.zeros_like(x)
    for c in coefficients:
        y = y * x + c
    return y


def _planned(code: jax.Array, decided_run: jax.Array) -> jax.Array:
    """The step's decision: the host's where it decided, else the data's."""
    return jnp.where(code == DECIDE, decided_run, code == RUN)


def first_block_decision(code: jax.Array, numerator: jax.Array, denominator: jax.Array, threshold: float):
    """Whether every block runs: ``rel = numerator / denominator`` not below ``threshold`` (NaN runs)."""
    return _planned(code, jnp.logical_not(numerator / denominator < threshold))


def teacache_accumulate(
    accumulated: jax.Array, numerator: jax.Array, denominator: jax.Array, coefficients: Sequence[float]
) -> jax.Array:
    """TeaCache's accumulator after this step: ``acc + poly(numerator / denominator)``."""
    return accumulated + rescale(coefficients, numerator / denominator)


def teacache_decision(
    code: jax.Array,
    numerator: jax.Array,
    denominator: jax.Array,
    accumulated: jax.Array,
    threshold: float,
    coefficients: Sequence[float],
) -> tuple[jax.Array, jax.Array]:
    """(whether every block runs, the new accumulator): ``acc + poly(rel)`` not below ``threshold`` runs
    and restarts the accumulator at 0; a forced run restarts it too."""
    total = teacache_accumulate(accumulated, numerator, denominator, coefficients)
    run = _planned(code, jnp.logical_not(total < threshold))
    return run, jnp.where(run, jnp.zeros_like(total), total)


# --------------------------------------------------------------------------------------------------------
# Host plans
# --------------------------------------------------------------------------------------------------------


def host_plan(steps: int, forced: Sequence[int]) -> np.ndarray:
    """int32 [steps]: RUN at the ``forced`` steps, DECIDE elsewhere."""
    plan = np.full((steps,), DECIDE, np.int32)
    plan[[i for i in forced if 0 <= i < steps]] = RUN
    return plan


def teacache_pattern(
    ratios: np.ndarray, threshold: float, coefficients: Sequence[float], forced: Sequence[int]
) -> np.ndarray:
    """TeaCache decided on the host, one accumulator per guidance branch.

    ``ratios`` [branches, steps]: each branch's relative L1 change of its metric input (any value at a
    forced step). A step runs every block when any branch's accumulator asks for it (TeaCache4Wan2.1
    keeps one accumulator per branch; with the same timestep in both branches they agree, and running
    both whenever one asks keeps the result exact if they ever differ). Returns int32 [steps] of RUN /
    SKIP codes.
    """
    ratios = np.asarray(ratios, np.float32)
    branches, steps = ratios.shape
    plan = host_plan(steps, forced)
    accumulated = [jnp.float32(0.0)] * branches
    pattern = np.empty((steps,), np.int32)
    for i in range(steps):
        totals = [
            teacache_accumulate(accumulated[b], ratios[b, i], jnp.float32(1.0), coefficients)
            for b in range(branches)
        ]
        run = any(bool(_planned(jnp.int32(plan[i]), jnp.logical_not(t < threshold))) for t in totals)
        # A step that runs refreshes the cached residual of every branch, so every accumulator restarts.
        accumulated = [jnp.float32(0.0) if run else t for t in totals]
        pattern[i] = RUN if run else SKIP
    return pattern
