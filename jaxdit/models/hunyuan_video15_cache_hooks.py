"""The feature caches' questions about a HunyuanVideo 1.5 transformer (``jaxdit.cache.hooks``' Protocols),
answered from its streams: a mixin of :class:`~jaxdit.models.hunyuan_video15.HunyuanVideo15Transformer`.

The caches start at the first dual-stream block (the model's ``CACHE_FROM``: the token refiner changes
the prompt tokens only), where the streams are (video, condition tokens). Every cache compares or measures
the video stream: First-Block-Cache and DBCache its residual after their first blocks (what a diffusers
block hook reads, the block's ``hidden_states``), MagCache the residual of all blocks on it, TeaCache the
first dual-stream block's modulated video input, LN(video) * (1 + scale1) + shift1 with that block's own
modulation of the timestep embedding (the input TeaCache4HunyuanVideo measures). No TeaCache polynomial
or MagCache ratios are published for HunyuanVideo 1.5: both are refused until a calibration gives them
(``--calibrate_teacache`` / ``--calibrate_magcache``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax

from jaxdit.models.hunyuan_video15_blocks import modulate_input
from jaxdit.models.hunyuan_video15_config import VIDEO
from jaxdit.parallel.context import ShardContext

__all__ = ["HunyuanVideo15CacheHooks"]


class HunyuanVideo15CacheHooks:
    """``jaxdit.cache.hooks.CacheHooks`` for HunyuanVideo 1.5 (the transformer's ``config`` is all it
    reads besides the block it is handed)."""

    #: TeaCache's input is computed in the step from the latents.
    TEACACHE_METRIC: ClassVar[str] = "step_input"

    def _video_valid(self, ctx: ShardContext) -> jax.Array:
        return ctx.layout.split_after(ctx.token_valid(), VIDEO, axis=0)[0]

    def cache_metric_stream(self, streams: Any, ctx: ShardContext) -> tuple[jax.Array, jax.Array]:
        """The video stream (first in the refiner's four streams and the dual-stream blocks' two) and its
        real tokens."""
        return streams[0], self._video_valid(ctx)

    def cache_output_stream(self, streams: Any, ctx: ShardContext) -> tuple[jax.Array, jax.Array]:
        """MagCache measures the video tokens of the final streams (the only ones the output reads)."""
        return streams[0], self._video_valid(ctx)

    def teacache_input(
        self, block: Any, streams: Any, cond: Any, ctx: ShardContext
    ) -> tuple[jax.Array, jax.Array]:
        """The first dual-stream block's modulated video input and the video's real tokens."""
        return modulate_input(block, streams[0], cond.temb), self._video_valid(ctx)

    def teacache_timestep_input(self, timestep: jax.Array) -> jax.Array:
        raise NotImplementedError("HunyuanVideo 1.5's TeaCache input depends on the latents (teacache_input)")

    def teacache_defaults(self, grid: tuple[int, ...]) -> None:
        """No TeaCache coefficients are published for HunyuanVideo 1.5: pass a calibration's file."""
        return None

    def magcache_defaults(self, grid: tuple[int, ...]) -> dict[str, Any] | None:
        """MagCache's ratios: the authors' published set for HunyuanVideo 1.5 720p T2V (ComfyUI-MagCache, 20
        steps, CFG's two branches, threshold 0.03, K 2, retention 0.25; their 40-step set is
        ``MagCache(ratios="hunyuanvideo1.5-720p@40steps")``), else jaxdit's own calibration of this
        architecture if it ships one, else None (calibrate with ``--calibrate_magcache``)."""
        from jaxdit.cache.magcache import config_key, shipped
        from jaxdit.models.hunyuan_video15_config import HunyuanVideo15Config

        if self.config == HunyuanVideo15Config.preset("hunyuanvideo1.5-720p"):
            return shipped("hunyuanvideo1.5-720p")
        return shipped(config_key("hunyuan-video15", self.config))
