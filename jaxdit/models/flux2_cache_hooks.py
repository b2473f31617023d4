"""The feature caches' questions about a FLUX.2 transformer (``jaxdit.cache.hooks``' Protocols), answered
from its streams: a mixin of :class:`~jaxdit.models.flux2.Flux2Transformer`.

The streams are FLUX.1's: (text, image) in the double blocks, the image stream carrying the reference
tokens after the denoised ones, then the joined per-shard [text; image; reference] in the single blocks.
What the caches compare is what diffusers' hooks compare on ``Flux2Transformer2DModel``: the image stream
a block returns (its ``hidden_states``, reference tokens included), and the modulated input of the first
double block for TeaCache. Nothing is published for FLUX.2: no TeaCache polynomial, no MagCache ratios;
both are refused until given (``TeaCache(coefficients=...)``, ``--calibrate_magcache``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxdit.models.flux2_blocks import modulate
from jaxdit.models.flux2_config import IMAGE, TEXT
from jaxdit.parallel.context import ShardContext

__all__ = ["Flux2CacheHooks"]


class Flux2CacheHooks:
    """``jaxdit.cache.hooks.CacheHooks`` for FLUX.2 (the transformer's ``config`` is all it reads)."""

    #: TeaCache's input is computed in the step from the latents.
    TEACACHE_METRIC: ClassVar[str] = "step_input"

    def cache_metric_stream(self, streams: Any, ctx: ShardContext) -> tuple[jax.Array, jax.Array]:
        """First-Block-Cache / DBCache compare the image stream (reference tokens included), and its real
        tokens, from the double blocks' (text, image) or the single blocks' joined stream."""
        valid = ctx.layout.split_after(ctx.token_valid(), TEXT, axis=0)[1]
        if isinstance(streams, tuple | list):
            return streams[IMAGE], valid
        return ctx.layout.split_after(streams, TEXT)[1], valid

    def cache_output_stream(self, streams: Any, ctx: ShardContext) -> tuple[jax.Array, jax.Array]:
        """MagCache measures the denoised image tokens of the final joined stream."""
        valid = ctx.layout.split_local(ctx.token_valid(), axis=0)[IMAGE]
        return ctx.layout.split_local(streams)[IMAGE], valid

    def teacache_input(
        self, block: Any, streams: Any, cond: Any, ctx: ShardContext
    ) -> tuple[jax.Array, jax.Array]:
        """The first double block's modulated image input, LN(img) * (1 + scale) + shift with the stack's
        shared image modulation (a FLUX.2 block has none of its own), and the image's real tokens."""
        shift, scale = jnp.split(cond.mod_img, 6, axis=-1)[:2]
        eps = self.config.eps
        return modulate(streams[IMAGE], shift, scale, eps), self.cache_metric_stream(streams, ctx)[1]

    def teacache_timestep_input(self, timestep: jax.Array) -> jax.Array:
        raise NotImplementedError("FLUX.2's TeaCache input depends on the latents (teacache_input)")

    def teacache_defaults(self, grid: tuple[int, ...]) -> None:
        """No TeaCache coefficients are published for FLUX.2: pass TeaCache(threshold=, coefficients=)."""
        return None

    def magcache_defaults(self, grid: tuple[int, ...]) -> dict[str, Any] | None:
        """No MagCache ratios are published for FLUX.2; jaxdit's own calibration of this architecture if it
        ships one, else None (calibrate with ``--calibrate_magcache``)."""
        from jaxdit.cache.magcache import config_key, shipped

        return shipped(config_key("flux2", self.config))
