"""Wan's causal 3-D VAE (2.1 and 2.2) as one Flax NNX model, encoded and decoded chunk by chunk.

Follows diffusers' ``AutoencoderKLWan`` (``WanEncoder3d``, ``WanDecoder3d``, ``WanUpBlock``,
``WanResidualUpBlock``, ``_encode``/``_decode``) and Wan's ``wan/modules/vae.py`` (2.1) and
``vae2_2.py`` (2.2). Shape letters: B batch, T frames, H rows, W columns, C channels; arrays here are
channels last, ``[B, T, H, W, C]`` (the user-facing :class:`jaxdit.vae.wan_vae.WanVAE` converts).

Causality. Every 3-D convolution pads time on the past side only, so frame t depends on frames <= t. The
reference decodes one latent frame at a time and keeps, per convolution, the last two input frames it saw
(``CACHE_T = 2``); encoding runs on frame 1, then on 4-frame chunks. Here the same chunking is one
``lax.scan`` over chunks with the per-convolution buffers in the carry: the first chunk is traced once on
its own (it differs: the temporal upsamplers pass it through, the temporal downsamplers only remember
it, the dup-up shortcuts keep one frame), every later chunk runs the scan body. The compiled program does
not grow with the number of frames and live activations are one chunk's.

Wan 2.2 (``is_residual``, ``patch_size=2``): the frames are patchified before the encoder and the
decoder's output unpatchified after it (:mod:`jaxdit.vae.wan_vae_residual`); each encoder level adds an
avg-down shortcut of its input, each decoder level but the last a dup-up shortcut; the decoder's
upsamplers keep their width (Wan 2.1's halve it) and the decoder has its own base width.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdit.vae.spatial import Rows
from jaxdit.vae.wan_vae_config import ENCODE_CHUNK, WanVAEConfig
from jaxdit.vae.wan_vae_layers import (
    Attention,
    CausalCache,
    Conv,
    MidBlock,
    Resample,
    ResBlock,
    RMSNorm,
    rows_at,
    silu,
)
from jaxdit.vae.wan_vae_residual import ResidualDownBlock, dup_up, patchify, unpatchify

__all__ = ["Decoder", "Encoder", "UpBlock", "WanVAEModel", "abstract_model", "parameter_shapes"]


class UpBlock(nnx.Module):
    """One decoder level: ``n`` residual blocks, then the level's upsampler (none on the last level).

    ``residual`` (Wan 2.2, diffusers' ``WanResidualUpBlock``): the upsampler keeps the width, and the
    level's input is added back through the dup-up shortcut.
    """

    def __init__(
        self,
        c_in: int,
        c_out: int,
        n: int,
        mode: str | None,
        *,
        residual: bool = False,
        dtype: Any,
        rngs: nnx.Rngs,
    ) -> None:
        self.resnets = nnx.List(
            [ResBlock(c_in if j == 0 else c_out, c_out, dtype=dtype, rngs=rngs) for j in range(n)]
        )
        up_dim = c_out if residual else None
        upsample = Resample(c_out, mode, up_dim=up_dim, dtype=dtype, rngs=rngs) if mode else None
        self.upsample = nnx.data(upsample)
        # The dup-up shortcut's time factor (None: no shortcut).
        self.shortcut_t = (2 if mode == "upsample3d" else 1) if residual and mode else None
        self.c_out = c_out

    def __call__(self, x: jax.Array, cache: CausalCache, rows: Rows, first: bool) -> jax.Array:
        skip = x
        for block in self.resnets:
            x = block(x, cache, rows)
        if self.upsample is not None:
            x = self.upsample(x, cache, rows, first)
        if self.shortcut_t is not None:
            x = x + dup_up(skip, self.c_out, self.shortcut_t, 2, first)
        return x


class Encoder(nnx.Module):
    def __init__(self, cfg: WanVAEConfig, *, dtype: Any, rngs: nnx.Rngs) -> None:
        dims = cfg.encoder_dims()
        kw = dict(dtype=dtype, rngs=rngs)
        self.conv_in = Conv(cfg.in_channels, dims[0], (3, 3, 3), **kw)
        down: list[nnx.Module] = []
        scale = 1.0  # resolution relative to the input, for attn_scales
        for i, (c_in, c_out) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            if cfg.is_residual:
                down.append(ResidualDownBlock(c_in, c_out, cfg.num_res_blocks, cfg.down_factors(i), **kw))
                continue
            for _ in range(cfg.num_res_blocks):
                down.append(ResBlock(c_in, c_out, **kw))
                if scale in cfg.attn_scales:
                    down.append(Attention(c_out, **kw))
                c_in = c_out
            if i != cfg.levels - 1:
                mode = "downsample3d" if cfg.encoder_temporal[i] else "downsample2d"
                down.append(Resample(c_out, mode, **kw))
                scale /= 2.0
        self.down = nnx.List(down)
        self.mid = MidBlock(dims[-1], **kw)
        self.norm_out = RMSNorm(dims[-1], **kw)
        self.conv_out = Conv(dims[-1], 2 * cfg.z_dim, (3, 3, 3), **kw)

    def chunk(self, x: jax.Array, cache: CausalCache, rows: Rows, first: bool) -> jax.Array:
        """One chunk of (patchified) frames [B, T, H, W, C] -> its latent frames [B, t, h, w, 2z]."""
        x = cache.causal(self.conv_in, x, rows)
        for layer in self.down:
            if isinstance(layer, (Resample, ResidualDownBlock)):
                x = layer(x, cache, rows, first)
            elif isinstance(layer, Attention):
                x = layer(x, rows)
            else:
                x = layer(x, cache, rows)
        x = self.mid(x, cache, rows)
        return cache.causal(self.conv_out, silu(self.norm_out(x)), rows)


class Decoder(nnx.Module):
    def __init__(self, cfg: WanVAEConfig, *, dtype: Any, rngs: nnx.Rngs) -> None:
        dims = cfg.decoder_dims()
        kw = dict(dtype=dtype, rngs=rngs)
        self.conv_in = Conv(cfg.z_dim, dims[0], (3, 3, 3), **kw)
        self.mid = MidBlock(dims[0], **kw)
        up = []
        for i, (c_in, c_out) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            if i > 0 and not cfg.is_residual:
                c_in //= 2  # the previous level's upsampler halved the width (floor, as diffusers)
            mode = None
            if i != cfg.levels - 1:
                mode = "upsample3d" if cfg.decoder_temporal[i] else "upsample2d"
            up.append(UpBlock(c_in, c_out, cfg.num_res_blocks + 1, mode, residual=cfg.is_residual, **kw))
        self.up = nnx.List(up)
        self.norm_out = RMSNorm(dims[-1], **kw)
        self.conv_out = Conv(dims[-1], cfg.out_channels, (3, 3, 3), **kw)

    def chunk(self, x: jax.Array, cache: CausalCache, rows: Rows, first: bool) -> jax.Array:
        """One latent frame [B, 1, h, w, z] -> its (patchified) frames [B, 1 or tf, H, W, C]."""
        x = cache.causal(self.conv_in, x, rows)
        x = self.mid(x, cache, rows)
        for block in self.up:
            x = block(x, cache, rows, first)
        return cache.causal(self.conv_out, silu(self.norm_out(x)), rows)


class WanVAEModel(nnx.Module):
    """The parameters and the chunked encode/decode on channels-last arrays (see :class:`WanVAE`)."""

    def __init__(self, cfg: WanVAEConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        self.config = cfg
        self.encoder = Encoder(cfg, dtype=dtype, rngs=rngs)
        self.quant_conv = Conv(2 * cfg.z_dim, 2 * cfg.z_dim, (1, 1, 1), dtype=dtype, rngs=rngs)
        self.post_quant_conv = Conv(cfg.z_dim, cfg.z_dim, (1, 1, 1), dtype=dtype, rngs=rngs)
        self.decoder = Decoder(cfg, dtype=dtype, rngs=rngs)

    def decode(self, z: jax.Array, rows: Rows | None = None) -> jax.Array:
        """Latents [B, F, h, w, z] (unnormalized) -> frames [B, tf(F-1)+1, H, W, C] in [-1, 1].

        ``rows``: the layout of the latent rows (a band of them inside ``shard_map``); None: one tile.
        """
        rows = rows or Rows.split(z.shape[-3], 1)
        x = self.post_quant_conv(z, rows)
        cache = CausalCache()
        video = self.decoder.chunk(x[:, :1], cache, rows, first=True)
        if x.shape[1] > 1:

            def step(past, frame):
                c = CausalCache(past)
                out = self.decoder.chunk(frame, c, rows, first=False)
                return c.new, out

            frames = jnp.moveaxis(x[:, 1:], 1, 0)[:, :, None]  # [F-1, B, 1, h, w, z]
            _, rest = jax.lax.scan(step, cache.new, frames)  # [F-1, B, tf, H, W, C]
            rest = jnp.moveaxis(rest, 0, 1).reshape(x.shape[0], -1, *rest.shape[3:])
            video = jnp.concatenate([video, rest], axis=1)
        # Clipped as diffusers 0.42 and both originals do (after unpatchifying; per pixel either way).
        return jnp.clip(unpatchify(video, self.config.patch), -1.0, 1.0)

    def encode(self, video: jax.Array, rows: Rows | None = None) -> tuple[jax.Array, jax.Array]:
        """Frames [B, T, H, W, C] -> (mean, logvar), each [B, (T-1)//4 * 4/tf + 1, h, w, z].

        ``rows``: the layout of ``video``'s rows (a band of them inside ``shard_map``; its ``local`` a
        multiple of the spatial factor so the patchify and every stride-2 level halve it); None: all
        rows, one tile. As the references, frames beyond the last whole 4-frame chunk are ignored; logvar
        is clamped to [-30, 20] as diffusers' ``DiagonalGaussianDistribution`` does.
        """
        rows = rows or Rows.split(video.shape[-3], 1)
        video = patchify(video, self.config.patch)
        rows = rows_at(rows, video)
        b, t = video.shape[:2]
        n = (t - 1) // ENCODE_CHUNK
        cache = CausalCache()
        out = self.encoder.chunk(video[:, :1], cache, rows, first=True)
        if n:

            def step(past, chunk):
                c = CausalCache(past)
                return c.new, self.encoder.chunk(chunk, c, rows, first=False)

            chunks = video[:, 1 : 1 + ENCODE_CHUNK * n].reshape(b, n, ENCODE_CHUNK, *video.shape[2:])
            _, rest = jax.lax.scan(step, cache.new, jnp.moveaxis(chunks, 1, 0))
            rest = jnp.moveaxis(rest, 0, 1).reshape(b, -1, *rest.shape[3:])
            out = jnp.concatenate([out, rest], axis=1)
        moments = self.quant_conv(out, rows).astype(jnp.float32)
        mean, logvar = jnp.split(moments, 2, axis=-1)
        return mean, jnp.clip(logvar, -30.0, 20.0)


def abstract_model(config: WanVAEConfig, dtype: Any = jnp.float32) -> WanVAEModel:
    """The model with ``jax.ShapeDtypeStruct`` parameters (nothing allocated)."""
    return nnx.eval_shape(lambda: WanVAEModel(config, dtype=dtype, rngs=nnx.Rngs(0)))


def parameter_shapes(config: WanVAEConfig) -> dict[str, tuple[int, ...]]:
    """Dotted parameter path -> shape."""
    state = nnx.state(abstract_model(config), nnx.Param)
    return {".".join(map(str, p)): tuple(v.shape) for p, v in nnx.to_flat_state(state)}
