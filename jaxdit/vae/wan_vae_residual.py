"""What Wan 2.2's VAE adds to Wan 2.1's: pixel patchify, and parameter-free shortcuts around each level.

Follows diffusers' ``autoencoder_kl_wan.py`` (``patchify``/``unpatchify``, ``AvgDown3D``, ``DupUp3D``,
``WanResidualDownBlock``; the ``WanResidualUpBlock`` counterpart is
:class:`jaxdit.vae.wan_vae_model.UpBlock` with ``residual=True``) and Wan's ``wan/modules/vae2_2.py``.
Channels-last ``[B, T, H, W, C]`` throughout.

- Patchify (p = 2): each 2x2 pixel block becomes channels, index ``c * p*p + pw * p + ph`` (column
  offset before row offset, the references' ``"b c f (h q) (w r) -> b (c r q) f h w"``).
- Avg-down shortcut of an encoder level (time factor ft, space factor fs): each output pixel gathers its
  ft x fs x fs input block into channels (``c * factor + (it * fs + ih) * fs + iw``) and averages
  consecutive groups of them down to the level's output width. Time is padded with zero frames at the
  *front* of the chunk to a multiple of ft (the first 1-frame chunk: one zero frame).
- Dup-up shortcut of a decoder level: each channel repeated, the copies spread over the ft x fs x fs
  output block (the inverse layout); the first chunk keeps only the last of its ft frames.

Row parallelism: all four only move data inside aligned 2-row pairs (bands are even at every level), so
they are local to a tile. Rows of padding mix only with rows of padding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import nnx

from jaxdit.vae.spatial import Rows
from jaxdit.vae.wan_vae_layers import CausalCache, Resample, ResBlock

__all__ = ["ResidualDownBlock", "avg_down", "dup_up", "patchify", "unpatchify"]


def patchify(x: jax.Array, p: int) -> jax.Array:
    """[B, T, H, W, C] -> [B, T, H/p, W/p, C*p*p] (channel ``c*p*p + pw*p + ph``)."""
    if p == 1:
        return x
    return rearrange(x, "b t (h ph) (w pw) c -> b t h w (c pw ph)", ph=p, pw=p)


def unpatchify(x: jax.Array, p: int) -> jax.Array:
    """The inverse of :func:`patchify`: [B, T, h, w, C*p*p] -> [B, T, h*p, w*p, C]."""
    if p == 1:
        return x
    return rearrange(x, "b t h w (c pw ph) -> b t (h ph) (w pw) c", ph=p, pw=p)


def avg_down(x: jax.Array, c_out: int, ft: int, fs: int) -> jax.Array:
    """diffusers' ``AvgDown3D``: [B, T, H, W, C] -> [B, ceil(T/ft), H/fs, W/fs, c_out], mean in fp32."""
    b, t, h, w, c = x.shape
    pad = (-t) % ft
    if pad:
        x = jnp.pad(x, ((0, 0), (pad, 0), (0, 0), (0, 0), (0, 0)))
        t += pad
    x = x.reshape(b, t // ft, ft, h // fs, fs, w // fs, fs, c)
    x = jnp.transpose(x, (0, 1, 3, 5, 7, 2, 4, 6))  # [B, T', H', W', C, ft, fs, fs]
    x = x.reshape(b, t // ft, h // fs, w // fs, c_out, c * ft * fs * fs // c_out)
    return jnp.mean(x.astype(jnp.float32), axis=-1).astype(x.dtype)


def dup_up(x: jax.Array, c_out: int, ft: int, fs: int, first: bool) -> jax.Array:
    """diffusers' ``DupUp3D``: [B, T, H, W, C] -> [B, T*ft (first chunk: T*ft - ft + 1), H*fs, W*fs, c_out]."""
    b, t, h, w, c = x.shape
    x = jnp.repeat(x, c_out * ft * fs * fs // c, axis=-1)
    x = x.reshape(b, t, h, w, c_out, ft, fs, fs)
    x = jnp.transpose(x, (0, 1, 5, 2, 6, 3, 7, 4)).reshape(b, t * ft, h * fs, w * fs, c_out)
    return x[:, ft - 1 :] if first else x


class ResidualDownBlock(nnx.Module):
    """One encoder level of Wan 2.2: residual blocks, then the level's downsampler, plus the avg-down
    shortcut of the level's input (diffusers' ``WanResidualDownBlock``)."""

    def __init__(
        self,
        c_in: int,
        c_out: int,
        n: int,
        factors: tuple[int, int],
        *,
        dtype: Any,
        rngs: nnx.Rngs,
    ) -> None:
        self.resnets = nnx.List(
            [ResBlock(c_in if j == 0 else c_out, c_out, dtype=dtype, rngs=rngs) for j in range(n)]
        )
        ft, fs = factors
        mode = None if fs == 1 else ("downsample3d" if ft == 2 else "downsample2d")
        self.downsample = nnx.data(Resample(c_out, mode, dtype=dtype, rngs=rngs) if mode else None)
        self.c_out, self.factors = c_out, factors

    def __call__(self, x: jax.Array, cache: CausalCache, rows: Rows, first: bool) -> jax.Array:
        skip = avg_down(x, self.c_out, *self.factors)
        for block in self.resnets:
            x = block(x, cache, rows)
        if self.downsample is not None:
            x = self.downsample(x, cache, rows, first)
        return x + skip
