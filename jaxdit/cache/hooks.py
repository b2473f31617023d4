"""The cache seam: what a model family tells the feature caches, as Protocols, looked up through the family.

Every cache runs on any staged transformer (``jaxdit.models.staged``: ``STACKS``, ``embed``, ``enter``,
``run_block``, ``output``); what it needs beyond that is a hook, and each cache needs its own subset:

- :class:`FirstBlockHooks` (First-Block-Cache, DBCache): ``cache_metric_stream(streams, ctx)``, the stream
  they compare and its real tokens, from the streams at any position of the block sequence (FLUX: the
  image tokens, whether the text and image streams are still apart or already joined).
- :class:`TeaCacheHooks` (TeaCache): ``TEACACHE_METRIC``, ``"step_input"`` when its input is computed in
  the step from the latents (``teacache_input``: FLUX's block-0 modulated image input) or ``"schedule"``
  when it depends on the timestep only (``teacache_timestep_input``: Wan's time embedding, so the host
  plans every step; the hook of the other kind raises ``NotImplementedError``), and
  ``teacache_defaults(grid)``, the published numbers or None.
- :class:`MagCacheHooks` (MagCache and its calibration): ``cache_output_stream(streams, ctx)``, the tokens
  of the final streams whose residual magnitude is measured, and ``magcache_defaults(grid)``, the shipped
  ratios or None.
- TeaCache's calibration (:class:`TeaCacheCalibrationHooks`): TeaCache's input hook and
  ``cache_output_stream``, whose real tokens mask the prediction's change.
- TaylorSeer alone needs no hook: it forecasts the residual of every block on a schedule of the step index.

A family says which caches its transformer serves in ``ModelFamily.caches`` (``jaxdit.families.base``),
and hands the caches the object that answers them with ``ModelFamily.cache_hooks(model)``. Nothing here
inspects a model for attributes: :func:`check_family` refuses a cache the family does not declare (before
any weight loads: ``jaxdit generate``'s checks call it), and :func:`hooks_for` checks the object the family
hands over against the cache's Protocol once, before anything is traced (a family author's mistake is
named then, not deep inside a trace). The registry lives above this layer: ``jaxdit.families.register``
hands each (base) family down with :func:`register_family`, and :func:`family_of` finds a transformer's
family by its config's class. A transformer whose family is not registered (a pipeline built without
``jaxdit.families`` ever imported) answers for itself, checked against the cache's Protocol.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import jax

from jaxdit.parallel.context import ShardContext

__all__ = [
    "ALL_CACHES",
    "CacheHooks",
    "FirstBlockHooks",
    "MagCacheHooks",
    "OutputStreamHooks",
    "TeaCacheCalibrationHooks",
    "TeaCacheHooks",
    "check_family",
    "family_of",
    "hooks_for",
    "register_family",
]


@runtime_checkable
class FirstBlockHooks(Protocol):
    """First-Block-Cache and DBCache: the stream whose residual decides."""

    def cache_metric_stream(self, streams: Any, ctx: ShardContext) -> tuple[jax.Array, jax.Array]: ...


@runtime_checkable
class TeaCacheHooks(Protocol):
    """TeaCache: its metric input, in the step or from the schedule, and the published numbers."""

    TEACACHE_METRIC: ClassVar[str]

    def teacache_input(
        self, block: Any, streams: Any, cond: Any, ctx: ShardContext
    ) -> tuple[jax.Array, jax.Array]: ...

    def teacache_timestep_input(self, timestep: jax.Array) -> jax.Array: ...

    def teacache_defaults(self, grid: tuple[int, ...]) -> tuple[tuple[float, ...], float] | None: ...


@runtime_checkable
class MagCacheHooks(Protocol):
    """MagCache: the tokens whose residual magnitude is measured, and the shipped ratios."""

    def cache_output_stream(self, streams: Any, ctx: ShardContext) -> tuple[jax.Array, jax.Array]: ...

    def magcache_defaults(self, grid: tuple[int, ...]) -> dict[str, Any] | None: ...


@runtime_checkable
class OutputStreamHooks(Protocol):
    """The tokens of the final streams the prediction covers (MagCache's measure; TeaCache's
    calibration masks the prediction with their real tokens)."""

    def cache_output_stream(self, streams: Any, ctx: ShardContext) -> tuple[jax.Array, jax.Array]: ...


@runtime_checkable
class TeaCacheCalibrationHooks(TeaCacheHooks, OutputStreamHooks, Protocol):
    """TeaCache's calibration: its metric input, and the prediction's real tokens."""


@runtime_checkable
class CacheHooks(FirstBlockHooks, TeaCacheHooks, MagCacheHooks, Protocol):
    """Every hook: a family that serves every cache (FLUX.1, Wan)."""


class _NoHooks(Protocol):
    """TaylorSeer alone: nothing beyond the staged forward."""


#: cache name -> the Protocol its hooks must satisfy.
PROTOCOLS: dict[str, type] = {
    "fbcache": FirstBlockHooks,
    "dbcache": FirstBlockHooks,
    "teacache": TeaCacheHooks,
    "magcache": MagCacheHooks,
    "magcache-calibration": MagCacheHooks,
    "teacache-calibration": TeaCacheCalibrationHooks,
    "taylorseer": _NoHooks,
}
#: What a family with every hook declares in ``ModelFamily.caches``.
ALL_CACHES = frozenset({"fbcache", "dbcache", "teacache", "magcache", "taylorseer"})
_TITLES = {
    "fbcache": "First-Block-Cache",
    "dbcache": "DBCache",
    "teacache": "TeaCache",
    "magcache": "MagCache",
    "magcache-calibration": "MagCache",
    "teacache-calibration": "TeaCache",
    "taylorseer": "TaylorSeer",
}


#: config class -> the family of transformers with that config (``jaxdit.families.register`` fills it:
#: the registry lives above this layer, so it hands the families down rather than being imported).
_FAMILIES: dict[type, Any] = {}


def register_family(config_class: type, family: Any) -> None:
    """Record ``family`` as the one whose cache hooks serve transformers of ``config_class``."""
    _FAMILIES[config_class] = family


def family_of(model: Any) -> Any:
    """The registered family of a transformer (by its config's class), or None when the registry has not
    been loaded (a pipeline built directly, ``jaxdit.families`` never imported)."""
    for config_class, family in _FAMILIES.items():
        if isinstance(getattr(model, "config", None), config_class):
            return family
    return None


def check_family(family: Any, cache_name: str) -> None:
    """A one-line ValueError when ``family`` does not serve the cache ``cache_name``."""
    cache_name = {"magcache-calibration": "magcache", "teacache-calibration": "teacache"}.get(
        cache_name, cache_name
    )
    if cache_name not in family.caches:
        offered = ", ".join(sorted(family.caches)) or "none"
        raise ValueError(
            f"{_TITLES.get(cache_name, cache_name)} is not available for {family.display}: the family "
            f"provides the hooks of these caches only: {offered}"
        )


def hooks_for(model: Any, cache_name: str, family: Any = None) -> Any:
    """The object answering ``cache_name``'s questions about ``model``, from its family (checked)."""
    family = family_of(model) if family is None else family
    protocol = PROTOCOLS[cache_name]
    if family is None:
        # No registry loaded: the transformer answers for itself, checked against the cache's Protocol.
        if protocol is not _NoHooks and not isinstance(model, protocol):
            raise ValueError(
                f"{_TITLES.get(cache_name, cache_name)} is not available for {type(model).__name__}: it does "
                f"not implement jaxdit.cache.hooks.{protocol.__name__}"
            )
        return model
    check_family(family, cache_name)
    hooks = family.cache_hooks(model)
    if protocol is not _NoHooks and not isinstance(hooks, protocol):
        raise TypeError(
            f"{family.display} declares {cache_name} in its caches but its cache hooks "
            f"({type(hooks).__name__}) do not implement jaxdit.cache.hooks.{protocol.__name__}"
        )
    if protocol in (TeaCacheHooks, TeaCacheCalibrationHooks) and hooks.TEACACHE_METRIC not in (
        "step_input",
        "schedule",
    ):
        raise TypeError(
            f"{type(hooks).__name__}.TEACACHE_METRIC must be 'step_input' or 'schedule', "
            f"got {hooks.TEACACHE_METRIC!r}"
        )
    return hooks
