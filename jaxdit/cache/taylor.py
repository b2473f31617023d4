"""TaylorSeer (Liu et al., "From Reusing to Forecasting: Accelerating Diffusion Models with TaylorSeers",
arXiv 2503.06923): on a step that skips blocks, forecast what they would have produced by a Taylor
expansion around the last fully computed step, instead of reusing that step's output unchanged.

At each full step ``t`` the cached quantity ``r_t`` (here, as cache-dit's TaylorSeer calibrator does, the
residual of the skipped blocks rather than each layer's features as in the paper) refreshes finite-
difference estimates of its derivatives over the step index::

    D_0 = r_t,   D_{i+1} = (D_i(t) - D_i(t_prev)) / (t - t_prev)        for i < order

(a derivative is kept at 0 until enough full steps exist to estimate it). A skipped step ``t + k``
then uses ``sum_i D_i k^i / i!``. Order 0 is plain reuse.

:class:`TaylorSeer` alone computes every block on a fixed schedule (the first ``warmup`` steps, then
every ``interval``-th step counted from the last of them, as TaylorSeer's ``cal_type`` counts: N - 1
forecast steps between two full ones) and forecasts the others; the schedule depends on the step index only, so
the host plans it. On top of First-Block-Cache, DBCache or MagCache (their ``taylor_order``), those
caches decide as before and the skip branch forecasts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["TaylorSeer", "check_order", "forecast", "taylorseer_pattern", "update"]


def check_order(name: str, order: int) -> None:
    if isinstance(order, bool) or not isinstance(order, int) or not 0 <= order <= 4:
        raise ValueError(f"{name} taylor order must be an integer in [0, 4], got {order!r}")


@dataclasses.dataclass(frozen=True)
class TaylorSeer:
    """TaylorSeer alone (module docstring): ``pipe(..., cache=TaylorSeer(interval=3, order=1))``.

    ``interval``: every ``interval``-th step after the warm-up computes every block (the paper's N);
    ``order``: the Taylor expansion's order (the paper's m; 1 or 2 are its usual settings);
    ``warmup``: the first steps, always computed (they also give the derivatives their first points).
    """

    interval: int = 3
    order: int = 1
    warmup: int = 2

    name: ClassVar[str] = "taylorseer"
    title: ClassVar[str] = "TaylorSeer"

    def __post_init__(self) -> None:
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
            raise ValueError(f"TaylorSeer interval must be an integer >= 1, got {self.interval!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 1:
            raise ValueError(f"TaylorSeer warmup must be an integer >= 1, got {self.warmup!r}")
        check_order("TaylorSeer", self.order)
        if self.order < 1:
            raise ValueError("TaylorSeer order must be >= 1 (order 0 reuses, which is not a forecast)")

    @property
    def threshold(self) -> float:
        """The skip schedule's knob reported as the threshold: the interval."""
        return float(self.interval)


def taylorseer_pattern(steps: int, interval: int, warmup: int, forced: Any = ()) -> np.ndarray:
    """bool [steps]: the steps that compute every block (the warm-up, then every ``interval``-th counted
    from the warm-up's last step)."""
    i = np.arange(steps)
    run = (i < warmup) | ((i - (warmup - 1)) % interval == 0)
    run[[s for s in forced if 0 <= s < steps]] = True
    return run


def update(derivatives: tuple, fresh: Any, distance: jax.Array, full_steps: jax.Array) -> tuple:
    """The derivative estimates after a full step that measured ``fresh`` (module docstring).

    ``derivatives``: (D_0, ..., D_m), pytrees shaped like ``fresh``; ``distance``: steps since the last
    full step; ``full_steps``: full steps before this one (D_{i+1} needs more than i of them)."""
    new = [fresh]
    step = jnp.maximum(distance.astype(jnp.float32), 1.0)
    for i in range(len(derivatives) - 1):
        known = full_steps > i
        new.append(
            jax.tree.map(
                lambda n, o, known=known: jnp.where(known, (n - o) / step, jnp.zeros_like(n)),
                new[i],
                derivatives[i],
            )
        )
    return tuple(new)


def forecast(derivatives: tuple, distance: jax.Array) -> Any:
    """``sum_i D_i k^i / i!`` for ``k = distance`` steps past the last full step."""
    k = distance.astype(jnp.float32)
    terms = [
        jax.tree.map(lambda d, i=i: d * (k**i / math.factorial(i)), derivatives[i])
        for i in range(len(derivatives))
    ]
    return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *terms)
