"""The layers of Wan's causal 3-D VAE (2.1 and 2.2), channels last, row-parallel through ``spatial``.

Follows diffusers' ``models/autoencoders/autoencoder_kl_wan.py`` (``WanCausalConv3d``, ``WanRMS_norm``,
``WanResidualBlock``, ``WanAttentionBlock``, ``WanMidBlock``, ``WanResample``) and Wan's
``wan/modules/vae.py`` / ``vae2_2.py``. Shape letters: B batch, T frames, H rows, W columns, C channels;
activations are ``[B, T, H, W, C]``.

Every layer takes ``rows``, the :class:`~jaxdit.vae.spatial.Rows` layout of the latent (decoder) or of
the input frames (encoder); :func:`rows_at` derives the layout at the layer's own resolution. Causal
convolutions read and renew their past frames through a :class:`CausalCache` (diffusers' ``feat_cache``):
see :mod:`jaxdit.vae.wan_vae_model` for how the chunks are scanned.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdit.models.layers import param
from jaxdit.vae import spatial
from jaxdit.vae.spatial import Rows

__all__ = [
    "Attention",
    "CausalCache",
    "Conv",
    "MidBlock",
    "RMSNorm",
    "ResBlock",
    "Resample",
    "rows_at",
    "silu",
]


# --------------------------------------------------------------------------------------------------------
# Row layouts
# --------------------------------------------------------------------------------------------------------


def rows_at(rows: Rows, x: jax.Array) -> Rows:
    """The layout of ``x`` (rows at axis -3), given the latent's: the band scales with the resolution."""
    local = x.shape[-3]
    if local == rows.local:
        return rows
    if local % rows.local == 0:
        s = local // rows.local
        return Rows(rows.rows * s, local, rows.tiles, rows.axis_name)
    s = rows.local // local  # the encoder's stride-2 levels: floor(rows / 2) each
    return Rows(rows.rows // s, local, rows.tiles, rows.axis_name)


# --------------------------------------------------------------------------------------------------------
# The causal cache of one chunk
# --------------------------------------------------------------------------------------------------------


class CausalCache:
    """Past frames per causal convolution, read and renewed in call order (diffusers' ``feat_cache``).

    ``past`` is the previous chunk's ``new`` (None before the first chunk: zeros, the causal padding).
    """

    def __init__(self, past: Sequence[jax.Array] | None = None) -> None:
        self.past = None if past is None else list(past)
        self.new: list[jax.Array] = []

    def take(self, like: jax.Array, n: int) -> jax.Array:
        """The n frames before ``like`` (same B, H, W, C)."""
        if self.past is None:
            return jnp.zeros((like.shape[0], n, *like.shape[2:]), like.dtype)
        past = self.past[len(self.new)]
        if past.shape != (like.shape[0], n, *like.shape[2:]):
            raise AssertionError(
                f"cache slot {len(self.new)} holds {past.shape}, needed {n} frames of {like.shape}"
            )
        return past

    def causal(self, conv: Conv, x: jax.Array, rows: Rows) -> jax.Array:
        """``conv`` over ``x`` with its past frames prepended; remembers the last frames for the next chunk."""
        n = conv.kernel.shape[0] - 1
        full = jnp.concatenate([self.take(x, n), x], axis=1)
        self.new.append(full[:, full.shape[1] - n :])
        return conv(full, rows)


# --------------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------------


class Conv(nnx.Module):
    """A convolution with a channels-last kernel [kt, kh, kw, I, O] (3-D) or [kh, kw, I, O] (2-D, per frame).

    Called on inputs that already hold their past frames (3-D): no temporal padding; spatially "same"
    zero padding, the rows through ``rows`` (halo rows from the neighbouring tiles when sharded).
    """

    def __init__(self, c_in: int, c_out: int, size: Sequence[int], *, dtype: Any, rngs: nnx.Rngs) -> None:
        axes = ("kernel_t", "kernel_h", "kernel_w")[3 - len(size) :] + ("conv_in", "conv_out")
        self.kernel = param(rngs, (*size, c_in, c_out), axes, dtype)
        self.bias = param(rngs, (c_out,), ("conv_out",), dtype, init="zeros")

    def __call__(self, x: jax.Array, rows: Rows, *, stride_t: int = 1) -> jax.Array:
        kernel = self.kernel[...]
        b, t = x.shape[:2]
        kh, kw = kernel.shape[-4:-2]
        if kernel.size == kernel.shape[-1] * kernel.shape[-2]:  # 1x1(x1): a matmul per pixel
            y = jnp.einsum(
                "bthwi,io->bthwo",
                x.astype(kernel.dtype),
                kernel.reshape(kernel.shape[-2:]),
                preferred_element_type=jnp.float32,
            )
        else:
            if kh > 1:
                r = rows_at(rows, x)
                x = spatial.halo(spatial.mask_rows(x, r), r, kh // 2, kh // 2)
            if kw > 1:
                x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (kw // 2, kw // 2), (0, 0)))
            x = x.astype(kernel.dtype)
            if kernel.ndim == 5:
                y = jax.lax.conv_general_dilated(
                    x,
                    kernel,
                    window_strides=(stride_t, 1, 1),
                    padding="VALID",
                    dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
                    preferred_element_type=jnp.float32,
                )
            else:
                y = jax.lax.conv_general_dilated(
                    x.reshape(b * t, *x.shape[2:]),
                    kernel,
                    window_strides=(1, 1),
                    padding="VALID",
                    dimension_numbers=("NHWC", "HWIO", "NHWC"),
                    preferred_element_type=jnp.float32,
                )
                y = y.reshape(b, t, *y.shape[1:])
        return (y + self.bias[...].astype(jnp.float32)).astype(kernel.dtype)

    def downsample(self, x: jax.Array, rows: Rows) -> jax.Array:
        """The encoder's 2x downsampling: zero pad one row and column at the end, 3x3 stride 2 (2-D)."""
        y, _ = spatial.downsample_conv(x, self.kernel[...], self.bias[...], rows_at(rows, x))
        return y


class RMSNorm(nnx.Module):
    """``F.normalize(x, dim=C) * sqrt(C) * scale``: per pixel, over channels, in fp32 (needs no communication)."""

    def __init__(self, dim: int, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.scale = param(rngs, (dim,), ("channels",), dtype, init="ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(jnp.square(xf), axis=-1, keepdims=True))
        y = xf / jnp.maximum(norm, 1e-12) * math.sqrt(x.shape[-1]) * self.scale[...].astype(jnp.float32)
        return y.astype(x.dtype)


def silu(x: jax.Array) -> jax.Array:
    return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


class ResBlock(nnx.Module):
    """RMS_norm, SiLU, causal 3x3x3 conv, twice; plus the input (through a 1x1x1 conv if widths differ)."""

    def __init__(self, c_in: int, c_out: int, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.norm1 = RMSNorm(c_in, dtype=dtype, rngs=rngs)
        self.conv1 = Conv(c_in, c_out, (3, 3, 3), dtype=dtype, rngs=rngs)
        self.norm2 = RMSNorm(c_out, dtype=dtype, rngs=rngs)
        self.conv2 = Conv(c_out, c_out, (3, 3, 3), dtype=dtype, rngs=rngs)
        shortcut = Conv(c_in, c_out, (1, 1, 1), dtype=dtype, rngs=rngs) if c_in != c_out else None
        self.shortcut = nnx.data(shortcut)

    def __call__(self, x: jax.Array, cache: CausalCache, rows: Rows) -> jax.Array:
        skip = x if self.shortcut is None else self.shortcut(x, rows)
        y = cache.causal(self.conv1, silu(self.norm1(x)), rows)
        y = cache.causal(self.conv2, silu(self.norm2(y)), rows)
        return y + skip


class Attention(nnx.Module):
    """Single-head self-attention over the positions of each frame (not across frames), with a residual."""

    def __init__(self, dim: int, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.norm = RMSNorm(dim, dtype=dtype, rngs=rngs)
        self.qkv = Conv(dim, 3 * dim, (1, 1), dtype=dtype, rngs=rngs)
        self.proj = Conv(dim, dim, (1, 1), dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, rows: Rows) -> jax.Array:
        b, t, h, w, c = x.shape
        q, k, v = jnp.split(self.qkv(self.norm(x), rows), 3, axis=-1)
        # Per frame (T folds into the batch); over the tiles by ring attention, padded keys masked.
        out = spatial.attention(q, k, v, rows_at(rows, x))
        return self.proj(out, rows) + x


class MidBlock(nnx.Module):
    def __init__(self, dim: int, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.res0 = ResBlock(dim, dim, dtype=dtype, rngs=rngs)
        self.attn = Attention(dim, dtype=dtype, rngs=rngs)
        self.res1 = ResBlock(dim, dim, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, cache: CausalCache, rows: Rows) -> jax.Array:
        return self.res1(self.attn(self.res0(x, cache, rows), rows), cache, rows)


class Resample(nnx.Module):
    """2x spatial up/downsampling, with a temporal 2x in the ``*3d`` modes.

    ``upsample3d``: a causal (3,1,1) conv to 2C channels whose halves become frames 2t and 2t+1; the first
    chunk (the first latent frame) skips it and stays one frame. ``downsample3d``: a (3,1,1) stride-2 conv
    over [last frame of the previous chunk, this chunk]; the first chunk is only remembered.
    The upsamplers' 3x3 conv maps ``dim`` to ``up_dim`` channels: ``dim // 2`` in Wan 2.1's decoder (the
    default), ``dim`` in Wan 2.2's residual one.
    """

    def __init__(self, dim: int, mode: str, *, up_dim: int | None = None, dtype: Any, rngs: nnx.Rngs) -> None:
        if mode not in ("upsample2d", "upsample3d", "downsample2d", "downsample3d"):
            raise ValueError(f"unknown resample mode {mode!r}")
        self.mode = mode
        out = (dim // 2 if up_dim is None else up_dim) if mode.startswith("up") else dim
        self.conv = Conv(dim, out, (3, 3), dtype=dtype, rngs=rngs)
        time_conv = None
        if mode == "upsample3d":
            time_conv = Conv(dim, 2 * dim, (3, 1, 1), dtype=dtype, rngs=rngs)
        elif mode == "downsample3d":
            time_conv = Conv(dim, dim, (3, 1, 1), dtype=dtype, rngs=rngs)
        self.time_conv = nnx.data(time_conv)

    def __call__(self, x: jax.Array, cache: CausalCache, rows: Rows, first: bool) -> jax.Array:
        if self.mode == "upsample3d":
            if first:
                cache.new.append(jnp.zeros((x.shape[0], 2, *x.shape[2:]), x.dtype))
            else:
                b, t, h, w, c = x.shape
                y = cache.causal(self.time_conv, x, rows).reshape(b, t, h, w, 2, c)
                x = jnp.moveaxis(y, 4, 2).reshape(b, 2 * t, h, w, c)
        if self.mode.startswith("up"):
            x = jnp.repeat(jnp.repeat(x, 2, axis=2), 2, axis=3)  # nearest-exact at an integer factor
            return self.conv(x, rows)
        x = self.conv.downsample(x, rows)
        if self.mode == "downsample3d":
            past = cache.take(x, 1)
            cache.new.append(x[:, -1:])
            if not first:
                x = self.time_conv(jnp.concatenate([past, x], axis=1), rows, stride_t=2)
        return x
