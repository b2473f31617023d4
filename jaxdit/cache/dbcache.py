"""cache-dit's DBCache ("Dual Block Cache", vipshop/cache-dit ``DBCacheConfig``): the first ``Fn`` blocks
are always computed and decide, the last ``Bn`` blocks are always computed and correct, the middle ones
are reused.

At each step the first Fn blocks run; their residual on the model's metric stream (output of block
Fn-1 minus the embedded input) is compared with the one of the last step that computed the middle::

    rel = mean|r - r_prev| / mean|r_prev|

Below ``threshold`` (cache-dit's ``residual_diff_threshold``) the middle blocks are skipped and the
residual they produced at that last full step (or its TaylorSeer forecast, ``taylor_order``) is added;
then the last Bn blocks run on the result either way, which corrects part of the error of the reuse.
The first ``warmup`` steps always compute (cache-dit's ``max_warmup_steps``), and at most
``max_continuous`` steps in a row skip (``max_continuous_cached_steps``; -1: no limit).

First-Block-Cache is the case Fn = 1, Bn = 0, no warm-up, no limit.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxdit.cache.policies import _check_threshold
from jaxdit.cache.taylor import check_order

__all__ = ["DBCache"]


def _check_count(name: str, value: int, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"DBCache {name} must be an integer >= {least}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class DBCache:
    """DBCache (module docstring): ``pipe(..., cache=DBCache(threshold=0.08, fn=8, bn=0))``.

    Defaults are cache-dit's (``F8B0``, threshold 0.08, 8 warm-up steps, no limit on consecutive skips);
    ``fn + bn`` must leave at least one middle block.
    """

    threshold: float = 0.08
    fn: int = 8
    bn: int = 0
    warmup: int = 8
    max_continuous: int = -1
    taylor_order: int = 0

    name: ClassVar[str] = "dbcache"
    title: ClassVar[str] = "DBCache"

    def __post_init__(self) -> None:
        _check_threshold(self.title, self.threshold)
        _check_count("fn", self.fn, 1)
        _check_count("bn", self.bn, 0)
        _check_count("warmup", self.warmup, 0)
        _check_count("max_continuous", self.max_continuous, -1)
        check_order(self.title, self.taylor_order)
