"""Feature caches for the denoising loop: First-Block-Cache and TeaCache, one decision for the whole mesh.

``pipe(..., cache=FirstBlockCache(threshold=0.08))`` or ``cache=TeaCache()``; ``jaxdit generate
--use_fbcache / --use_teacache [--cache_threshold X]``. The policies are pure functions
(:mod:`jaxdit.cache.policies`); :mod:`jaxdit.cache.cached_forward` runs them inside the sharded forward.
"""

from jaxdit.cache.policies import CacheConfig, FirstBlockCache, TeaCache, parse_cache
from jaxdit.cache.report import CacheReport

__all__ = ["CacheConfig", "CacheReport", "FirstBlockCache", "TeaCache", "parse_cache"]
