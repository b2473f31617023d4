"""Feature caches for the denoising loop, one decision for the whole mesh: First-Block-Cache, TeaCache,
MagCache, TaylorSeer (alone or forecasting for the others) and DBCache.

``pipe(..., cache=MagCache())`` (or ``FirstBlockCache(threshold=0.08)``, ``TeaCache()``,
``TaylorSeer(interval=3)``, ``DBCache(fn=8, bn=0)``); ``jaxdit generate --cache NAME [--cache_threshold
X]``. The policies are pure functions (:mod:`jaxdit.cache.policies`, :mod:`~jaxdit.cache.magcache`,
:mod:`~jaxdit.cache.taylor`); :mod:`jaxdit.cache.cached_forward` runs them inside the sharded forward on
any family that provides the hooks of :class:`jaxdit.cache.hooks.CacheHooks`.
"""

from jaxdit.cache.dbcache import DBCache
from jaxdit.cache.hooks import CacheHooks
from jaxdit.cache.magcache import MagCache
from jaxdit.cache.policies import CACHES, FirstBlockCache, TeaCache, parse_cache
from jaxdit.cache.report import CacheReport
from jaxdit.cache.taylor import TaylorSeer

#: Every cache a user can ask for.
CacheConfig = FirstBlockCache | TeaCache | MagCache | TaylorSeer | DBCache
CACHES.update({c.name: c for c in (FirstBlockCache, TeaCache, MagCache, TaylorSeer, DBCache)})

__all__ = [
    "CACHES",
    "CacheConfig",
    "CacheHooks",
    "CacheReport",
    "DBCache",
    "FirstBlockCache",
    "MagCache",
    "TaylorSeer",
    "TeaCache",
    "parse_cache",
]
