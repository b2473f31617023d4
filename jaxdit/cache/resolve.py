"""A cache config resolved for one model: :class:`Policy`, static data traced into the cached step."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxdit.cache.dbcache import DBCache
from jaxdit.cache.hooks import hooks_for
from jaxdit.cache.magcache import (
    MagCache,
    MagCacheCalibration,
    magcache_pattern,
    nearest_interp,
    resolve_ratios,
)
from jaxdit.cache.policies import FirstBlockCache, TeaCache, TeaCacheCalibration, load_teacache_file
from jaxdit.cache.segments import cache_start, depth
from jaxdit.cache.taylor import TaylorSeer, taylorseer_pattern

__all__ = ["Policy", "resolve"]


@dataclasses.dataclass(frozen=True)
class Policy:
    """A cache config resolved for one model (static: it is traced into the step).

    ``metric``: what decides a step: ``"first_block"`` (First-Block-Cache, DBCache: the residual of the
    first ``fn`` blocks, on the devices), ``"step_input"`` (TeaCache on an input computed in the step),
    ``"schedule"`` (TeaCache on an input of the timestep alone, planned on the host), ``"host"``
    (MagCache, TaylorSeer: a pattern of the step index alone, planned on the host), ``"calibrate"``
    (every step computes and records MagCache's ratio) or ``"teacache_calibrate"`` (every step computes
    and records the relative L1 changes of TeaCache's input and of the prediction). The blocks ``fn`` .. ``depth - bn`` are the ones
    a skipped step reuses; ``taylor_order`` > 0 forecasts them (TaylorSeer) instead.
    """

    name: str
    title: str
    threshold: float
    metric: str
    coefficients: tuple[float, ...] = ()
    fn: int = 0
    bn: int = 0
    taylor_order: int = 0
    warmup: int = 0
    max_continuous: int = -1
    mag_ratios: tuple[tuple[float, ...], ...] = ()
    max_skips: int = 0
    retention: float = 0.0
    interval: int = 0

    @property
    def runs_first_block(self) -> bool:
        return self.metric == "first_block"

    @property
    def always_run(self) -> int:
        """Blocks computed at every step, skipped or not (head and tail)."""
        return self.fn + self.bn

    @property
    def program_key(self) -> Policy:
        """What the compiled step depends on: a host-planned policy (MagCache, TaylorSeer) hands its plan to
        the step as data, so its threshold, ratios, skip limits and interval are left out and every value of
        them shares one program; the other metrics trace their numbers into the step."""
        if self.metric != "host":
            return self
        return dataclasses.replace(
            self, threshold=0.0, mag_ratios=(), max_skips=0, retention=0.0, interval=0, warmup=0
        )

    def forced(self, steps: int, switches: Sequence[int] = ()) -> list[int]:
        """Steps that always run every block: the first (and the warm-up); TeaCache's last; where the
        parameters change."""
        last = [steps - 1] if self.name == TeaCache.name else []
        return sorted({0, *range(min(self.warmup, steps)), *last, *switches})

    def host_pattern(self, steps: int, forced: Sequence[int]) -> np.ndarray:
        """bool [steps] of a host-planned policy: the steps that compute every block."""
        if self.name == MagCache.name:
            ratios = np.stack([nearest_interp(r, steps) for r in self.mag_ratios])
            return magcache_pattern(ratios, self.threshold, self.max_skips, self.retention, forced)
        if self.name == TaylorSeer.name:
            return taylorseer_pattern(steps, self.interval, self.warmup, forced)
        return np.ones((steps,), bool)  # the calibration computes everything

    def describe(self) -> str:
        extra = f", Taylor order {self.taylor_order}" if self.taylor_order else ""
        if self.name == DBCache.name:
            extra = f", F{self.fn}B{self.bn}" + extra
        if self.name == TaylorSeer.name:
            return f"{self.title} (interval {self.interval}, order {self.taylor_order})"
        return f"{self.title} (threshold {self.threshold:g}{extra})"


def _magcache(config: MagCache, hooks: Any, model: Any, grid: Sequence[int]) -> Policy:
    entry = resolve_ratios(config.ratios) if config.ratios else hooks.magcache_defaults(tuple(grid))
    if entry is None:
        raise ValueError(
            f"MagCache has no magnitude ratios for this {type(model).__name__}: record them once with "
            "`jaxdit generate ... --calibrate_magcache FILE`, then pass --magcache_ratios FILE "
            "(MagCache(ratios=FILE) in Python)"
        )
    pick = lambda field, default: default if field is None else field  # noqa: E731
    return Policy(
        config.name,
        config.title,
        float(pick(config.threshold, entry.get("threshold", 0.12))),
        "host",
        taylor_order=config.taylor_order,
        mag_ratios=tuple(tuple(map(float, r)) for r in entry["ratios"]),
        max_skips=int(pick(config.max_skips, entry.get("max_skips", 2))),
        retention=float(pick(config.retention, entry.get("retention", 0.2))),
    )


def resolve(config: Any, model: Any, grid: Sequence[int] = ()) -> Policy:
    """A cache config (``jaxdit.cache``) for ``model`` (a staged transformer with the cache hooks,
    possibly abstract); missing numbers are the model's published ones for ``grid`` (the latent token
    grid: Wan I2V picks its 480P or 720P model's numbers by it)."""
    known = (
        FirstBlockCache,
        DBCache,
        TeaCache,
        MagCache,
        TaylorSeer,
        MagCacheCalibration,
        TeaCacheCalibration,
    )
    if not isinstance(config, known):
        raise TypeError(
            "cache must be a jaxdit.cache FirstBlockCache, TeaCache, MagCache, TaylorSeer or DBCache (or None), "
            f"got {type(config).__name__}"
        )
    hooks = hooks_for(model, config.name)  # the family's, refused in one line if it lacks them
    kind = type(model).__name__
    blocks = depth(model) - cache_start(model)  # the blocks a cache may skip or keep
    if isinstance(config, FirstBlockCache):
        return Policy(
            config.name,
            config.title,
            float(config.threshold),
            "first_block",
            fn=1,
            taylor_order=config.taylor_order,
        )
    if isinstance(config, DBCache):
        if config.fn + config.bn >= blocks:
            raise ValueError(
                f"DBCache F{config.fn}B{config.bn} leaves no middle block to cache in {kind}'s {blocks} blocks"
            )
        return Policy(
            config.name,
            config.title,
            float(config.threshold),
            "first_block",
            fn=config.fn,
            bn=config.bn,
            taylor_order=config.taylor_order,
            warmup=config.warmup,
            max_continuous=config.max_continuous,
        )
    if isinstance(config, TeaCache):
        if isinstance(config.coefficients, str):  # a calibration's file: its polynomial and threshold
            entry = load_teacache_file(config.coefficients)
            defaults = (entry["coefficients"], entry["threshold"])
            config = TeaCache(config.threshold)
        else:
            defaults = hooks.teacache_defaults(tuple(grid))
        coefficients = config.coefficients or (defaults[0] if defaults else None)
        threshold = config.threshold or (defaults[1] if defaults else None)
        if coefficients is None or threshold is None:
            raise ValueError(
                f"TeaCache has no published coefficients for this {kind}: fit them once with `jaxdit "
                "generate ... --calibrate_teacache FILE`, then pass --teacache_coefficients FILE "
                "(TeaCache(coefficients=FILE) in Python, or threshold= and coefficients=(...) explicitly)"
            )
        metric = hooks.TEACACHE_METRIC
        return Policy(config.name, config.title, float(threshold), metric, tuple(map(float, coefficients)))
    if isinstance(config, TeaCacheCalibration):
        if hooks.TEACACHE_METRIC != "step_input":
            raise ValueError(
                f"TeaCache calibration measures an input computed in the step; {kind}'s TeaCache input is "
                "its time embedding, whose published coefficients jaxdit uses"
            )
        return Policy(config.name, config.title, float("inf"), "teacache_calibrate")
    if isinstance(config, MagCache):
        return _magcache(config, hooks, model, grid)
    if isinstance(config, TaylorSeer):
        return Policy(
            config.name,
            config.title,
            float(config.interval),
            "host",
            taylor_order=config.order,
            warmup=config.warmup,
            interval=config.interval,
        )
    return Policy(config.name, config.title, float("inf"), "calibrate")  # MagCacheCalibration
