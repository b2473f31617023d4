"""The cache seam: what a model family's transformer tells the feature caches, as ONE Protocol.

Every cache (:mod:`jaxdit.cache.policies`) runs on any staged transformer (``jaxdit.models.staged``) that
also provides these hooks; the cache code names no family and asks nothing else of the model.
:func:`cache_hooks` checks a model against the Protocol once, before anything is traced, and says which
hook is missing.

- ``TEACACHE_METRIC``: ``"step_input"`` when TeaCache's input is computed in the step from the latents
  (FLUX: block 0's modulated image input, :meth:`teacache_input`) or ``"schedule"`` when it depends on
  the timestep only (Wan: the time embedding, :meth:`teacache_timestep_input`, so the host plans every
  step). The hook of the other kind raises ``NotImplementedError``.
- ``cache_metric_stream(streams, ctx)``: the stream First-Block-Cache / DBCache compare (and its real
  tokens), from the streams at any position of the block sequence (FLUX: the image tokens, whether the
  text and image streams are still apart or already joined).
- ``cache_output_stream(streams, ctx)``: the tokens whose residual MagCache's calibration measures, from
  the final streams (FLUX: the image tokens of the joined stream, as MagCache4FLUX measures).
- ``teacache_defaults(grid)`` / ``magcache_defaults(grid)``: the model's published or shipped numbers for
  this latent grid, or None (:mod:`jaxdit.cache.ratios` holds MagCache's).
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import jax

from jaxdit.parallel.context import ShardContext

__all__ = ["CacheHooks", "cache_hooks"]


@runtime_checkable
class CacheHooks(Protocol):
    """What the feature caches need from a staged transformer (module docstring)."""

    STACKS: ClassVar[tuple[str, ...]]
    TEACACHE_METRIC: ClassVar[str]

    def cache_metric_stream(self, streams: Any, ctx: ShardContext) -> tuple[jax.Array, jax.Array]: ...

    def cache_output_stream(self, streams: Any, ctx: ShardContext) -> tuple[jax.Array, jax.Array]: ...

    def teacache_input(
        self, block: Any, streams: Any, cond: Any, ctx: ShardContext
    ) -> tuple[jax.Array, jax.Array]: ...

    def teacache_timestep_input(self, timestep: jax.Array) -> jax.Array: ...

    def teacache_defaults(self, grid: tuple[int, ...]) -> tuple[tuple[float, ...], float] | None: ...

    def magcache_defaults(self, grid: tuple[int, ...]) -> dict[str, Any] | None: ...


#: The hooks :func:`cache_hooks` names when one is missing (the Protocol's members).
_HOOKS = (
    "STACKS",
    "TEACACHE_METRIC",
    "cache_metric_stream",
    "cache_output_stream",
    "teacache_input",
    "teacache_timestep_input",
    "teacache_defaults",
    "magcache_defaults",
)


def cache_hooks(model: Any) -> CacheHooks:
    """``model`` as the cache seam, or a one-line error naming the hooks it lacks."""
    if isinstance(model, CacheHooks):
        if model.TEACACHE_METRIC not in ("step_input", "schedule"):
            raise TypeError(
                f"{type(model).__name__}.TEACACHE_METRIC must be 'step_input' or 'schedule', "
                f"got {model.TEACACHE_METRIC!r}"
            )
        return model
    missing = [name for name in _HOOKS if not hasattr(model, name)]
    raise TypeError(
        f"{type(model).__name__} does not provide the feature-cache hooks "
        f"(jaxdit.cache.hooks.CacheHooks); missing: {', '.join(missing)}"
    )
