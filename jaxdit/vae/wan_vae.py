"""Wan 2.1's causal 3D VAE in Flax NNX, run chunk by chunk and, on a mesh, row-parallel.

Follows Wan's ``wan/modules/vae.py`` (``WanVAE_``) and diffusers' ``AutoencoderKLWan``
(``models/autoencoders/autoencoder_kl_wan.py``); ``../reference/flux-wan-facts.md`` section 6 has the
architecture. Shape letters: B batch, T frames, H rows, W columns, C channels. Activations are channels
last, ``[B, T, H, W, C]``; the public ``encode``/``decode`` take and return diffusers' ``[B, C, T, H, W]``.

Causality. Every 3-D convolution pads time on the past side only, so frame t depends on frames <= t. The
reference decodes one latent frame at a time and keeps, per convolution, the last two input frames it saw
(``CACHE_T = 2``); encoding runs on frame 1, then on 4-frame chunks. Here the same chunking is one
``lax.scan`` over chunks with the per-convolution buffers in the carry: the first chunk is traced once on
its own (it differs: the temporal upsamplers pass it through, the temporal downsamplers only remember
it), every later chunk runs the scan body. The compiled program does not grow with the number of frames
and live activations are one chunk's.

Row parallelism (``decode(z, mesh=...)``, ``encode(x, mesh=...)``). Rows are split over all devices of
the mesh, viewed as one ``tiles`` axis (:func:`jaxdit.vae.spatial.tile_mesh`), inside ``shard_map``, with
the primitives of :mod:`jaxdit.vae.spatial` (shared with the FLUX VAE). What each layer needs from the
other tiles:

- convolutions with a 3x3 spatial kernel: one halo row above and below (``spatial.halo``: two
  ``ppermute``s); the cached past frames belong to the tile and never move;
- the encoder's 2x downsampling (zero pad one row and column at the end, 3x3 stride 2):
  ``spatial.downsample_conv``, one row from the tile below (one ``ppermute``);
- RMS_norm, SiLU, 1x1 convolutions, the temporal (3,1,1) convolutions, nearest upsampling: nothing
  (per pixel or per row);
- the mid-block attention (per frame, over all h*w positions of the frame, at the latent resolution):
  ring attention over the tiles (``spatial.attention``), not an all-gather of K/V. Both would do at this
  size (480p: 60x104 tokens x 384 channels, a frame's K and V are 19 MB in fp32), and the attention is a
  sliver of the decode's time next to the full-resolution convolutions, so the P-1 dependent hops cost
  little; in exchange each device holds 1/P of K/V and of the score matrix, the program has permutes
  only (no all-gather, the DESIGN rule), and FLUX's VAE and this one share one tested implementation.

Heights the device count does not divide are padded with rows at the end (``spatial.Rows``); every tile
computes its valid-row mask locally (the valid region doubles exactly with each 2x upsampling); padded
rows are zeroed before every spatial convolution (so a halo or in-tile neighbour read of one is the zero
padding the unsharded model sees) and padded keys are masked in attention, so the result is exact.
The encoder's pixel bands are a multiple of 8 rows (2**3 for its three stride-2 levels), so every level
halves every band and a tile's latent rows are exactly those of its pixel rows; a padded row below the
image is the zero row the stride-2 conv pads with, so the encode is exact for every height (a multiple
of 8, as the unsharded encode requires).
Without a mesh the same program runs on one tile (no collectives).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdit.models.layers import param
from jaxdit.vae import spatial
from jaxdit.vae.spatial import Rows

__all__ = [
    "WAN21_LATENTS_MEAN",
    "WAN21_LATENTS_STD",
    "WanVAE",
    "WanVAEConfig",
    "WanVAEModel",
    "abstract_model",
    "parameter_shapes",
]

#: Per-channel latent statistics of the Wan 2.1 VAE (``WanVAE.mean`` / ``.std`` in the original).
WAN21_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
WAN21_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip

#: Frames per encoder chunk after the first frame (both references hard-code 4).
ENCODE_CHUNK = 4


# --------------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WanVAEConfig:
    """Architecture of a Wan 2.1 VAE (diffusers ``AutoencoderKLWan`` argument names)."""

    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)  # sic, the references' spelling
    latents_mean: tuple[float, ...] = WAN21_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN21_LATENTS_STD
    in_channels: int = 3
    out_channels: int = 3

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {"wan2.1-vae": {}}

    def __post_init__(self) -> None:
        for name in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "temperal_downsample", tuple(bool(t) for t in self.temperal_downsample))
        for name in ("base_dim", "z_dim", "num_res_blocks", "in_channels", "out_channels"):
            if getattr(self, name) < 1:
                raise ValueError(f"WanVAEConfig.{name} must be >= 1, got {getattr(self, name)}")
        if len(self.dim_mult) < 2 or min(self.dim_mult) < 1:
            raise ValueError(f"dim_mult must be >= 2 positive ints, got {self.dim_mult}")
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(
                f"temperal_downsample needs {len(self.dim_mult) - 1} entries (one per downsampling), "
                f"got {self.temperal_downsample}"
            )
        if 2 ** sum(self.temperal_downsample) != ENCODE_CHUNK:
            raise ValueError(
                f"temperal_downsample={self.temperal_downsample} compresses time by "
                f"{2 ** sum(self.temperal_downsample)}; Wan's chunked encoder assumes exactly 4 "
                "(two temporal downsamplings)"
            )
        if self.attn_scales:
            raise ValueError(
                f"attn_scales={self.attn_scales}: attention outside the mid-blocks is not supported "
                "(Wan 2.1 has none, and diffusers' decoder ignores it)"
            )
        if self.base_dim * self.dim_mult[0] % 2 or any(self.base_dim * m % 2 for m in self.dim_mult):
            raise ValueError("every level's width must be even (the upsamplers halve it)")
        for name in ("latents_mean", "latents_std"):
            if len(getattr(self, name)) != self.z_dim:
                raise ValueError(f"{name} has {len(getattr(self, name))} values for z_dim={self.z_dim}")

    @property
    def temporal_factor(self) -> int:
        return 2 ** sum(self.temperal_downsample)

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)

    @classmethod
    def preset(cls, name: str = "wan2.1-vae") -> WanVAEConfig:
        """``wan2.1-vae``: the released Wan 2.1 VAE (126.9 M parameters)."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown Wan VAE preset {name!r}; known: {', '.join(sorted(cls.PRESETS))}")
        return cls(**cls.PRESETS[name])

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> WanVAEConfig:
        """From a diffusers ``AutoencoderKLWan`` ``config.json`` (a path or the parsed dict)."""
        if not isinstance(config, Mapping):
            config = json.loads(Path(config).read_text(encoding="utf-8"))
        if config.get("_class_name") not in (None, "AutoencoderKLWan"):
            raise ValueError(f"config is for {config.get('_class_name')!r}, not AutoencoderKLWan")
        if config.get("is_residual"):
            raise ValueError("is_residual=True is the Wan 2.2 VAE, not supported")
        if config.get("patch_size") is not None:
            raise ValueError(f"patch_size={config['patch_size']} is the Wan 2.2 VAE, not supported")
        base = config.get("base_dim", 96)
        if config.get("decoder_base_dim") not in (None, base):
            raise ValueError(
                f"decoder_base_dim={config['decoder_base_dim']} != base_dim={base} is unsupported"
            )
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{k: config[k] for k in names if config.get(k) is not None})

    def to_diffusers(self) -> dict[str, Any]:
        """The diffusers ``config.json`` entries for this config."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {
            "_class_name": "AutoencoderKLWan",
            **{k: list(v) if isinstance(v, tuple) else v for k, v in out.items()},
        }

    def decoder_dims(self) -> list[int]:
        return [self.base_dim * m for m in (self.dim_mult[-1], *self.dim_mult[::-1])]

    def encoder_dims(self) -> list[int]:
        return [self.base_dim * m for m in (1, *self.dim_mult)]


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


class _Cache:
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


def _silu(x: jax.Array) -> jax.Array:
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

    def __call__(self, x: jax.Array, cache: _Cache, rows: Rows) -> jax.Array:
        skip = x if self.shortcut is None else self.shortcut(x, rows)
        y = cache.causal(self.conv1, _silu(self.norm1(x)), rows)
        y = cache.causal(self.conv2, _silu(self.norm2(y)), rows)
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

    def __call__(self, x: jax.Array, cache: _Cache, rows: Rows) -> jax.Array:
        return self.res1(self.attn(self.res0(x, cache, rows), rows), cache, rows)


class Resample(nnx.Module):
    """2x spatial up/downsampling, with a temporal 2x in the ``*3d`` modes.

    ``upsample3d``: a causal (3,1,1) conv to 2C channels whose halves become frames 2t and 2t+1; the first
    chunk (the first latent frame) skips it and stays one frame. ``downsample3d``: a (3,1,1) stride-2 conv
    over [last frame of the previous chunk, this chunk]; the first chunk is only remembered.
    """

    def __init__(self, dim: int, mode: str, *, dtype: Any, rngs: nnx.Rngs) -> None:
        if mode not in ("upsample2d", "upsample3d", "downsample2d", "downsample3d"):
            raise ValueError(f"unknown resample mode {mode!r}")
        self.mode = mode
        out = dim // 2 if mode.startswith("up") else dim
        self.conv = Conv(dim, out, (3, 3), dtype=dtype, rngs=rngs)
        time_conv = None
        if mode == "upsample3d":
            time_conv = Conv(dim, 2 * dim, (3, 1, 1), dtype=dtype, rngs=rngs)
        elif mode == "downsample3d":
            time_conv = Conv(dim, dim, (3, 1, 1), dtype=dtype, rngs=rngs)
        self.time_conv = nnx.data(time_conv)

    def __call__(self, x: jax.Array, cache: _Cache, rows: Rows, first: bool) -> jax.Array:
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


class UpBlock(nnx.Module):
    def __init__(
        self, c_in: int, c_out: int, n: int, mode: str | None, *, dtype: Any, rngs: nnx.Rngs
    ) -> None:
        self.resnets = nnx.List(
            [ResBlock(c_in if j == 0 else c_out, c_out, dtype=dtype, rngs=rngs) for j in range(n)]
        )
        self.upsample = nnx.data(Resample(c_out, mode, dtype=dtype, rngs=rngs) if mode else None)

    def __call__(self, x: jax.Array, cache: _Cache, rows: Rows, first: bool) -> jax.Array:
        for block in self.resnets:
            x = block(x, cache, rows)
        return x if self.upsample is None else self.upsample(x, cache, rows, first)


class Encoder(nnx.Module):
    def __init__(self, cfg: WanVAEConfig, *, dtype: Any, rngs: nnx.Rngs) -> None:
        dims = cfg.encoder_dims()
        kw = dict(dtype=dtype, rngs=rngs)
        self.conv_in = Conv(cfg.in_channels, dims[0], (3, 3, 3), **kw)
        down: list[nnx.Module] = []
        levels = len(cfg.dim_mult)
        for i, (c_in, c_out) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            for _ in range(cfg.num_res_blocks):
                down.append(ResBlock(c_in, c_out, **kw))
                c_in = c_out
            if i != levels - 1:
                mode = "downsample3d" if cfg.temperal_downsample[i] else "downsample2d"
                down.append(Resample(c_out, mode, **kw))
        self.down = nnx.List(down)
        self.mid = MidBlock(dims[-1], **kw)
        self.norm_out = RMSNorm(dims[-1], **kw)
        self.conv_out = Conv(dims[-1], 2 * cfg.z_dim, (3, 3, 3), **kw)

    def chunk(self, x: jax.Array, cache: _Cache, rows: Rows, first: bool) -> jax.Array:
        """One chunk of frames [B, T, H, W, 3] -> its latent frames [B, t, h, w, 2z]."""
        x = cache.causal(self.conv_in, x, rows)
        for layer in self.down:
            x = layer(x, cache, rows, first) if isinstance(layer, Resample) else layer(x, cache, rows)
        x = self.mid(x, cache, rows)
        return cache.causal(self.conv_out, _silu(self.norm_out(x)), rows)


class Decoder(nnx.Module):
    def __init__(self, cfg: WanVAEConfig, *, dtype: Any, rngs: nnx.Rngs) -> None:
        dims = cfg.decoder_dims()
        kw = dict(dtype=dtype, rngs=rngs)
        temporal_up = cfg.temperal_downsample[::-1]
        levels = len(cfg.dim_mult)
        self.conv_in = Conv(cfg.z_dim, dims[0], (3, 3, 3), **kw)
        self.mid = MidBlock(dims[0], **kw)
        up = []
        for i, (c_in, c_out) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            if i > 0:
                c_in //= 2  # the previous level's upsampler halved the width
            mode = None
            if i != levels - 1:
                mode = "upsample3d" if temporal_up[i] else "upsample2d"
            up.append(UpBlock(c_in, c_out, cfg.num_res_blocks + 1, mode, **kw))
        self.up = nnx.List(up)
        self.norm_out = RMSNorm(dims[-1], **kw)
        self.conv_out = Conv(dims[-1], cfg.out_channels, (3, 3, 3), **kw)

    def chunk(self, x: jax.Array, cache: _Cache, rows: Rows, first: bool) -> jax.Array:
        """One latent frame [B, 1, h, w, z] -> its frames [B, 1 or 4, H, W, 3] (1 for the first)."""
        x = cache.causal(self.conv_in, x, rows)
        x = self.mid(x, cache, rows)
        for block in self.up:
            x = block(x, cache, rows, first)
        return cache.causal(self.conv_out, _silu(self.norm_out(x)), rows)


class WanVAEModel(nnx.Module):
    """The parameters and the chunked encode/decode on channels-last arrays (see :class:`WanVAE`)."""

    def __init__(self, cfg: WanVAEConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        self.config = cfg
        self.encoder = Encoder(cfg, dtype=dtype, rngs=rngs)
        self.quant_conv = Conv(2 * cfg.z_dim, 2 * cfg.z_dim, (1, 1, 1), dtype=dtype, rngs=rngs)
        self.post_quant_conv = Conv(cfg.z_dim, cfg.z_dim, (1, 1, 1), dtype=dtype, rngs=rngs)
        self.decoder = Decoder(cfg, dtype=dtype, rngs=rngs)

    def decode(self, z: jax.Array, rows: Rows | None = None) -> jax.Array:
        """Latents [B, F, h, w, z] (unnormalized) -> frames [B, 4(F-1)+1, H, W, 3] in [-1, 1]."""
        rows = rows or Rows.split(z.shape[-3], 1)
        x = self.post_quant_conv(z, rows)
        cache = _Cache()
        first = self.decoder.chunk(x[:, :1], cache, rows, first=True)
        if x.shape[1] == 1:
            return jnp.clip(first, -1.0, 1.0)

        def step(past, frame):
            c = _Cache(past)
            out = self.decoder.chunk(frame, c, rows, first=False)
            return c.new, out

        frames = jnp.moveaxis(x[:, 1:], 1, 0)[:, :, None]  # [F-1, B, 1, h, w, z]
        _, rest = jax.lax.scan(step, cache.new, frames)  # [F-1, B, 4, H, W, 3]
        rest = jnp.moveaxis(rest, 0, 1).reshape(x.shape[0], -1, *rest.shape[3:])
        return jnp.clip(jnp.concatenate([first, rest], axis=1), -1.0, 1.0)

    def encode(self, video: jax.Array, rows: Rows | None = None) -> tuple[jax.Array, jax.Array]:
        """Frames [B, T, H, W, 3] -> (mean, logvar), each [B, (T-1)//4 + 1, h, w, z].

        ``rows``: the layout of ``video``'s rows (a band of them inside ``shard_map``; its ``local`` a
        multiple of the spatial factor so every stride-2 level halves it); None: all rows, one tile.
        As both references, frames beyond the last whole 4-frame chunk are ignored; logvar is clamped to
        [-30, 20] as diffusers' ``DiagonalGaussianDistribution`` does.
        """
        rows = rows or Rows.split(video.shape[-3], 1)
        b, t = video.shape[:2]
        n = (t - 1) // ENCODE_CHUNK
        cache = _Cache()
        out = self.encoder.chunk(video[:, :1], cache, rows, first=True)
        if n:

            def step(past, chunk):
                c = _Cache(past)
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


# --------------------------------------------------------------------------------------------------------
# The user-facing VAE
# --------------------------------------------------------------------------------------------------------


class WanVAE:
    """Wan 2.1 VAE with diffusers' ``AutoencoderKLWan`` calling conventions ([B, C, T, H, W] arrays).

    ``decode(z, mesh=None)``: unnormalized latents -> video in [-1, 1]; with a mesh, rows are split over
    all its devices (without one, the same program runs on one tile). ``decode_latents`` first undoes the
    pipeline's normalization. ``encode(x, mesh=None)`` -> ``(mean, logvar)``, row-parallel likewise.
    Compiled programs are cached per (devices, shape, dtype); :meth:`compiled_decode` and
    :meth:`compiled_encode` expose them (e.g. for ``memory_analysis()``).
    The model may be abstract (:func:`abstract_model`) for compiling without weights.
    """

    def __init__(self, model: WanVAEModel, *, compiler_options: Mapping[str, Any] | None = None) -> None:
        self.model = model
        self.config: WanVAEConfig = model.config
        self.graphdef, self.state = nnx.split(model)
        self.dtype = jnp.dtype(jax.tree.leaves(self.state)[0].dtype)
        self.compiler_options = dict(compiler_options) if compiler_options else None
        self._compiled: dict[Any, Any] = {}
        self._states: dict[Any, Any] = {}

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_folder(
        cls,
        path: str | os.PathLike[str],
        dtype: Any = None,
        *,
        config: WanVAEConfig | Mapping[str, Any] | None = None,
        compiler_options: Mapping[str, Any] | None = None,
    ) -> WanVAE:
        """Load a diffusers ``vae/`` folder (or a pipeline folder holding one), Wan's ``Wan2.1_VAE.pth``
        (or a folder holding it), or a single ``.safetensors`` of either key layout.

        ``dtype`` defaults to the checkpoint's storage dtype; ``config`` overrides the one read or inferred
        (a ``.pth`` has none: the Wan 2.1 preset with widths read from the tensors).
        """
        from converters import vae_wan

        ckpt = vae_wan.detect(path, config)
        dtype = jnp.dtype(dtype or ckpt.dtype)
        graphdef, abstract = nnx.split(abstract_model(ckpt.config, dtype))
        flat = nnx.to_flat_state(abstract)
        lazies = ckpt.resolve({".".join(map(str, p)): tuple(v.shape) for p, v in flat})
        arrays = {k: jnp.asarray(np.asarray(t).astype(dtype)) for k, t in lazies.items()}
        state = nnx.from_flat_state([(p, v.replace(arrays[".".join(map(str, p))])) for p, v in flat])
        return cls(nnx.merge(graphdef, state), compiler_options=compiler_options)

    # ------------------------------------------------------------------ programs
    @staticmethod
    def tiles(mesh: Mesh | None) -> Mesh:
        """The 1-D tile mesh decoding runs on: all devices of ``mesh``, or the first device."""
        return spatial.tile_mesh(mesh if mesh is not None else jax.devices()[:1])

    def _decode_program(self, tiles: Mesh, state: Any, z: jax.Array) -> jax.Array:
        """[B, z, F, h, w] -> [B, 3, T, H, W]: rows padded to the tiles, decoded in ``shard_map``."""
        graphdef = self.graphdef
        z = jnp.transpose(z, (0, 2, 3, 4, 1)).astype(self.dtype)
        rows = Rows.split(z.shape[-3], tiles.size, axis_name=spatial.TILE_AXIS)
        spec = spatial.row_spec(z.ndim)
        local = jax.shard_map(
            lambda s, zl: nnx.merge(graphdef, s).decode(zl, rows),
            mesh=tiles,
            in_specs=(PartitionSpec(), spec),
            out_specs=spec,
            check_vma=False,
        )
        video = local(state, spatial.pad_rows(z, rows))
        video = spatial.unpad_rows(video, rows.upsampled(self.config.spatial_factor))
        return jnp.transpose(video, (0, 4, 1, 2, 3))

    def compiled_decode(self, shape: Sequence[int], mesh: Mesh | None = None, dtype: Any = jnp.float32):
        """The compiled decode of latents of ``shape`` (called with ``(state, z)``; cached)."""
        tiles = self.tiles(mesh)
        key = (tuple(d.id for d in tiles.devices.flat), tuple(shape), jnp.dtype(dtype))
        if key not in self._compiled:
            replicated = NamedSharding(tiles, PartitionSpec())
            state = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), self.state
            )
            z = jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=replicated)
            fn = jax.jit(
                functools.partial(self._decode_program, tiles), compiler_options=self.compiler_options
            )
            self._compiled[key] = fn.lower(state, z).compile()
        return self._compiled[key]

    def _state_on(self, tiles: Mesh) -> Any:
        key = tuple(d.id for d in tiles.devices.flat)
        if key not in self._states:
            self._states[key] = jax.device_put(self.state, NamedSharding(tiles, PartitionSpec()))
        return self._states[key]

    # ------------------------------------------------------------------ calls
    def decode(self, z: Any, mesh: Mesh | None = None) -> jax.Array:
        """Unnormalized latents [B, z_dim, F, h, w] -> video [B, 3, 4(F-1)+1, 8h, 8w] in [-1, 1] (in the
        model's dtype), as diffusers' ``AutoencoderKLWan.decode(z).sample``."""
        z = jnp.asarray(z)
        if z.ndim != 5 or z.shape[1] != self.config.z_dim:
            raise ValueError(f"expected latents [B, {self.config.z_dim}, F, h, w], got {tuple(z.shape)}")
        tiles = self.tiles(mesh)
        fn = self.compiled_decode(z.shape, mesh, z.dtype)
        return fn(self._state_on(tiles), jax.device_put(z, NamedSharding(tiles, PartitionSpec())))

    def decode_latents(self, z: Any, mesh: Mesh | None = None) -> jax.Array:
        """Normalized latents (what the denoiser sees) -> video: ``z * latents_std + latents_mean`` first."""
        z = jnp.asarray(z, jnp.float32)
        shape = (1, -1, 1, 1, 1)
        std = jnp.asarray(self.config.latents_std, jnp.float32).reshape(shape)
        mean = jnp.asarray(self.config.latents_mean, jnp.float32).reshape(shape)
        return self.decode(z * std + mean, mesh)

    def encode_rows(self, height: int, mesh: Mesh | None = None) -> Rows:
        """The layout of ``height`` pixel rows on the tiles of ``mesh``.

        Bands are a multiple of the spatial factor (8 rows for Wan 2.1's three stride-2 levels), so every
        level halves every band and tiles stay aligned: tile t's latent rows are exactly the latents of
        its pixel rows. Heights the device count does not divide are padded at the end (zero rows: the
        pad row the (0, 1, 0, 1)-padded stride-2 conv adds below the image), so any height is exact.
        """
        f = self.config.spatial_factor
        return Rows.split(height, self.tiles(mesh).size, multiple=f, axis_name=spatial.TILE_AXIS)

    def _encode_program(self, tiles: Mesh, rows: Rows, state: Any, x: jax.Array) -> tuple[Any, Any]:
        """Padded channels-last frames [B, T, rows.padded, W, 3], row-sharded -> padded (mean, logvar)."""
        graphdef = self.graphdef
        spec = spatial.row_spec(x.ndim)
        local = jax.shard_map(
            lambda s, xl: nnx.merge(graphdef, s).encode(xl, rows),
            mesh=tiles,
            in_specs=(PartitionSpec(), spec),
            out_specs=(spec, spec),
            check_vma=False,
        )
        return local(state, x)

    def compiled_encode(self, shape: Sequence[int], mesh: Mesh | None = None, dtype: Any = jnp.float32):
        """The compiled core of :meth:`encode` for videos [B, 3, T, H, W] of ``shape`` (cached): called
        with ``(state, x)``, x the channels-last frames with rows padded to :meth:`encode_rows` and split
        over the tiles; returns padded (mean, logvar), channels last. Parameters may be abstract."""
        tiles = self.tiles(mesh)
        b, c, t, h, w = shape
        rows = self.encode_rows(h, mesh)
        key = ("encode", tuple(d.id for d in tiles.devices.flat), tuple(shape), jnp.dtype(dtype))
        if key not in self._compiled:
            replicated = NamedSharding(tiles, PartitionSpec())
            state = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), self.state
            )
            banded = NamedSharding(tiles, spatial.row_spec(5))
            x = jax.ShapeDtypeStruct((b, t, rows.padded, w, c), self.dtype, sharding=banded)
            fn = jax.jit(
                functools.partial(self._encode_program, tiles, rows),
                compiler_options=self.compiler_options,
            )
            self._compiled[key] = fn.lower(state, x).compile()
        return self._compiled[key]

    def encode(self, x: Any, mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array]:
        """Video [B, 3, T, H, W] in [-1, 1] -> (mean, logvar) in fp32, each [B, z_dim, (T-1)//4 + 1, H/8,
        W/8], as diffusers' ``encode(x).latent_dist.mean`` / ``.logvar``.

        With a mesh, the pixel rows are split over all its devices (:meth:`encode_rows`): each device
        holds 1/P of the video and of every activation; halo rows move by permutes, the mid-block
        attention is ring attention. Without one, the same program runs on one device.
        """
        x = jnp.asarray(x)
        if x.ndim != 5 or x.shape[1] != self.config.in_channels:
            raise ValueError(f"expected a video [B, {self.config.in_channels}, T, H, W], got {x.shape}")
        f = self.config.spatial_factor
        if x.shape[3] % f or x.shape[4] % f:
            raise ValueError(f"height and width must be multiples of {f}, got {x.shape[3]}x{x.shape[4]}")
        tiles = self.tiles(mesh)
        rows = self.encode_rows(x.shape[3], mesh)
        core = self.compiled_encode(x.shape, mesh, x.dtype)
        key = ("encode-io", tuple(d.id for d in tiles.devices.flat), tuple(x.shape), x.dtype)
        if key not in self._compiled:
            # Transpose and pad outside the core, landing row-sharded: no device holds the whole video
            # inside the sharded program (what compiled_encode's memory_analysis reports).
            banded = NamedSharding(tiles, spatial.row_spec(5))
            dtype = self.dtype

            def pre(v):
                return spatial.pad_rows(jnp.transpose(v, (0, 2, 3, 4, 1)).astype(dtype), rows)

            def post(m):
                m = spatial.unpad_rows(m, Rows(rows.rows // f, rows.local // f, rows.tiles))
                return jnp.transpose(m, (0, 4, 1, 2, 3))

            self._compiled[key] = (jax.jit(pre, out_shardings=banded), jax.jit(post))
        pre_j, post_j = self._compiled[key]
        mean, logvar = core(self._state_on(tiles), pre_j(x))
        return post_j(mean), post_j(logvar)
