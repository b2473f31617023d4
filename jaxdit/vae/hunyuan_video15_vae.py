"""HunyuanVideo 1.5's causal 3-D VAE (16x spatial, 4x temporal, 32 latent channels) in Flax NNX, channels
last, on one device.

Follows diffusers' ``AutoencoderKLHunyuanVideo15`` (``models/autoencoders/
autoencoder_kl_hunyuanvideo15.py``). It is not Wan's VAE: its causal convolutions pad with the edge
values (``replicate``) in time and space instead of zeros, and run over the whole clip at once (no chunked
feature cache); resolution changes are DC-AE style pixel (un)shuffles whose shortcuts average or repeat
channels, the first frame kept apart from the others; the mid-block attention is causal over frames (a
pixel sees every pixel of its own and earlier frames); the decoder's input convolution and the encoder's
output convolution have channel repeat / mean shortcuts. What it shares with Wan (the RMS norm over
channels) is a few lines, so nothing is imported from Wan's VAE.

Shape letters: B batch, T frames, H rows, W columns, C channels; activations ``[B, T, H, W, C]``.
Precision: convolutions in the parameters' dtype with fp32 accumulation; norms and attention in fp32.
Parameters keep diffusers' module names (``converters/vae_hunyuan_video15.py`` maps the keys).

Row parallel: every layer takes ``rows``, the :class:`~jaxdit.vae.spatial.Rows` layout of its input's
rows over a ``tiles`` mesh axis (None: one tile holding every row, the one-device model), and runs
inside ``shard_map`` as :mod:`jaxdit.vae.hunyuan_video15_vae_mesh` sets it up. What a layer needs from
the other tiles: a 3x3x3 convolution one halo row above and below, the global image edge replicated
(``spatial.halo(..., mode="edge")``: the first tile copies its first row above, the tile with the last
real row copies it below and over the padding rows); the causal mid-block attention the K/V band of
every tile (``spatial.frame_causal_attention``). The RMS norms are per voxel over channels, the pixel
(un)shuffles and their shortcuts stay inside aligned row pairs of a band, and every frame lives on every
tile (the causal time padding is local): nothing. There is no GroupNorm, so no statistic crosses a tile.

Not here: diffusers' optional tiled decoding.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdit.models import partitioning
from jaxdit.models.layers import param
from jaxdit.vae import spatial
from jaxdit.vae.spatial import Rows

__all__ = ["HunyuanVideo15VAE", "HunyuanVideo15VAEConfig", "abstract_vae", "parameter_shapes"]


@dataclasses.dataclass(frozen=True)
class HunyuanVideo15VAEConfig:
    """diffusers' ``AutoencoderKLHunyuanVideo15`` config (names and defaults)."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 32
    block_out_channels: tuple[int, ...] = (128, 256, 512, 1024, 1024)
    layers_per_block: int = 2
    spatial_compression_ratio: int = 16
    temporal_compression_ratio: int = 4
    downsample_match_channel: bool = True
    upsample_match_channel: bool = True
    scaling_factor: float = 1.03682

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_out_channels", tuple(int(c) for c in self.block_out_channels))
        s, t = self.spatial_compression_ratio, self.temporal_compression_ratio
        if s < 1 or t < 1 or s & (s - 1) or t & (t - 1) or t > s:
            raise ValueError(
                f"compression ratios spatial {s}, temporal {t} must be powers of 2, temporal <= spatial"
            )
        if len(self.block_out_channels) < int(math.log2(s)) + (1 if self.downsample_match_channel else 0):
            raise ValueError(f"block_out_channels {self.block_out_channels}: too few levels for {s}x")

    @property
    def spatial_levels(self) -> int:
        return int(math.log2(self.spatial_compression_ratio))

    @property
    def temporal_levels(self) -> int:
        return int(math.log2(self.temporal_compression_ratio))

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a clip of ``frames`` (1 + k * temporal ratio) frames."""
        t = self.temporal_compression_ratio
        if frames < 1 or (frames - 1) % t:
            raise ValueError(f"{frames} frames: the VAE takes 1 + k * {t} frames")
        return (frames - 1) // t + 1

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> HunyuanVideo15VAEConfig:
        if not isinstance(config, Mapping):
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
        c = dict(config)
        if c.get("_class_name") not in ("AutoencoderKLHunyuanVideo15", None):
            raise ValueError(f"config is for {c.get('_class_name')!r}, not AutoencoderKLHunyuanVideo15")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in c.items() if k in names})

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# --------------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------------


class Conv(nnx.Module):
    """A 3-D convolution, kernel channels last [kt, kh, kw, I, O]. ``causal``: diffusers'
    ``HunyuanVideo15CausalConv3d`` (edge padding: kt - 1 frames before, k // 2 rows and columns each
    side); otherwise a 1 x 1 x 1 convolution (a matmul per voxel)."""

    def __init__(self, c_in: int, c_out: int, k: int, *, dtype: Any, rngs: nnx.Rngs) -> None:
        axes = ("kernel_t", "kernel_h", "kernel_w", "conv_in", "conv_out")
        self.kernel = param(rngs, (k, k, k, c_in, c_out), axes, dtype)
        self.bias = param(rngs, (c_out,), ("conv_out",), dtype, init="zeros")

    def __call__(self, x: jax.Array, rows: Rows) -> jax.Array:
        kernel = self.kernel[...]
        k = kernel.shape[0]
        x = x.astype(kernel.dtype)
        if k == 1:
            y = jnp.einsum("bthwi,io->bthwo", x, kernel[0, 0, 0], preferred_element_type=jnp.float32)
        else:
            # Rows: the halo of the neighbouring tiles, the image's edge rows replicated; frames and
            # columns are whole on every tile and are edge-padded here.
            x = spatial.halo(x, rows, k // 2, k // 2, mode="edge")
            pad = ((0, 0), (k - 1, 0), (0, 0), (k // 2, k // 2), (0, 0))
            y = jax.lax.conv_general_dilated(
                jnp.pad(x, pad, mode="edge"),
                kernel,
                window_strides=(1, 1, 1),
                padding="VALID",
                dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
                preferred_element_type=jnp.float32,
            )
        return y + self.bias[...].astype(jnp.float32)


class RMSNorm(nnx.Module):
    """diffusers' ``HunyuanVideo15RMS_norm``: x / max(|x|_2 over channels, 1e-12) * sqrt(C) * gamma."""

    def __init__(self, c: int, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.gamma = param(rngs, (c,), ("conv_out",), dtype, init="ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True))
        return x / jnp.maximum(norm, 1e-12) * math.sqrt(x.shape[-1]) * self.gamma[...].astype(jnp.float32)


class ResnetBlock(nnx.Module):
    def __init__(self, c_in: int, c_out: int, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.norm1 = RMSNorm(c_in, dtype=dtype, rngs=rngs)
        self.conv1 = Conv(c_in, c_out, 3, dtype=dtype, rngs=rngs)
        self.norm2 = RMSNorm(c_out, dtype=dtype, rngs=rngs)
        self.conv2 = Conv(c_out, c_out, 3, dtype=dtype, rngs=rngs)
        self.conv_shortcut = Conv(c_in, c_out, 1, dtype=dtype, rngs=rngs) if c_in != c_out else None

    def __call__(self, x: jax.Array, rows: Rows) -> jax.Array:
        h = self.conv1(jax.nn.silu(self.norm1(x)), rows)
        h = self.conv2(jax.nn.silu(self.norm2(h)), rows)
        return h + (x.astype(jnp.float32) if self.conv_shortcut is None else self.conv_shortcut(x, rows))


class AttnBlock(nnx.Module):
    """One-head self-attention over every voxel, causal over frames (diffusers' causal mask: a query of
    frame i sees the keys of frames 0..i), with a residual; over the tiles by
    ``spatial.frame_causal_attention`` (the K/V band passed round the tiles, padded keys masked)."""

    def __init__(self, c: int, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.norm = RMSNorm(c, dtype=dtype, rngs=rngs)
        self.to_q, self.to_k, self.to_v, self.proj_out = (
            Conv(c, c, 1, dtype=dtype, rngs=rngs) for _ in range(4)
        )

    def __call__(self, x: jax.Array, rows: Rows) -> jax.Array:
        n = self.norm(x)
        q, k, v = (f(n, rows) for f in (self.to_q, self.to_k, self.to_v))
        out = spatial.frame_causal_attention(q, k, v, rows)
        return self.proj_out(out, rows) + x.astype(jnp.float32)


class MidBlock(nnx.Module):
    def __init__(self, c: int, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.resnets = nnx.List([ResnetBlock(c, c, dtype=dtype, rngs=rngs) for _ in range(2)])
        self.attentions = nnx.List([AttnBlock(c, dtype=dtype, rngs=rngs)])

    def __call__(self, x: jax.Array, rows: Rows) -> jax.Array:
        return self.resnets[1](self.attentions[0](self.resnets[0](x, rows), rows), rows)


def _unshuffle(x: jax.Array, r: tuple[int, int, int]) -> jax.Array:
    """[B, T*r1, H*r2, W*r3, C] -> [B, T, H, W, r1*r2*r3*C]: diffusers' ``_dcae_downsample_rearrange``
    (channel index (i1, i2, i3, c))."""
    b, t, h, w, c = x.shape
    r1, r2, r3 = r
    x = x.reshape(b, t // r1, r1, h // r2, r2, w // r3, r3, c)
    return x.transpose(0, 1, 3, 5, 2, 4, 6, 7).reshape(b, t // r1, h // r2, w // r3, r1 * r2 * r3 * c)


def _shuffle(x: jax.Array, r: tuple[int, int, int]) -> jax.Array:
    """The inverse: diffusers' ``_dcae_upsample_rearrange``."""
    b, t, h, w, packed = x.shape
    r1, r2, r3 = r
    c = packed // (r1 * r2 * r3)
    x = x.reshape(b, t, h, w, r1, r2, r3, c).transpose(0, 1, 4, 2, 5, 3, 6, 7)
    return x.reshape(b, t * r1, h * r2, w * r3, c)


def _group_mean(x: jax.Array, group: int) -> jax.Array:
    """Mean of each run of ``group`` consecutive channels (diffusers' ``view(B, C/g, g, ...).mean(2)``)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group).mean(-1)


class Downsample(nnx.Module):
    """2x down in rows and columns (and in time, the first frame kept apart, with ``temporal``)."""

    def __init__(self, c_in: int, c_out: int, temporal: bool, *, dtype: Any, rngs: nnx.Rngs) -> None:
        factor = 8 if temporal else 4
        if c_out % factor or (factor * c_in) % c_out:
            raise ValueError(f"a {factor}x downsample cannot map {c_in} to {c_out} channels")
        self.conv = Conv(c_in, c_out // factor, 3, dtype=dtype, rngs=rngs)
        self.temporal = temporal
        self.group = factor * c_in // c_out

    def __call__(self, x: jax.Array, rows: Rows) -> tuple[jax.Array, Rows]:
        """Returns the output and its rows (half the band: bands hold whole row pairs)."""
        down = rows.downsampled()
        h = self.conv(x, rows)
        x = x.astype(jnp.float32)
        if not self.temporal:
            return _unshuffle(h, (1, 2, 2)) + _group_mean(_unshuffle(x, (1, 2, 2)), self.group), down
        first = _unshuffle(h[:, :1], (1, 2, 2))
        first = jnp.concatenate([first, first], axis=-1)  # diffusers duplicates the first frame's channels
        h = jnp.concatenate([first, _unshuffle(h[:, 1:], (2, 2, 2))], axis=1)
        shortcut = jnp.concatenate(
            [
                _group_mean(_unshuffle(x[:, :1], (1, 2, 2)), self.group // 2),
                _group_mean(_unshuffle(x[:, 1:], (2, 2, 2)), self.group),
            ],
            axis=1,
        )
        return h + shortcut, down


class Upsample(nnx.Module):
    """2x up in rows and columns (and in time, the first frame kept apart, with ``temporal``)."""

    def __init__(self, c_in: int, c_out: int, temporal: bool, *, dtype: Any, rngs: nnx.Rngs) -> None:
        factor = 8 if temporal else 4
        if (factor * c_out) % c_in:
            raise ValueError(f"a {factor}x upsample cannot map {c_in} to {c_out} channels")
        self.conv = Conv(c_in, c_out * factor, 3, dtype=dtype, rngs=rngs)
        self.temporal = temporal
        self.repeats = factor * c_out // c_in

    def __call__(self, x: jax.Array, rows: Rows) -> tuple[jax.Array, Rows]:
        """Returns the output and its rows (every band doubles in place)."""
        up = rows.upsampled(2)
        h = self.conv(x, rows)
        x = x.astype(jnp.float32)
        if not self.temporal:
            return _shuffle(h, (1, 2, 2)) + _shuffle(jnp.repeat(x, self.repeats, axis=-1), (1, 2, 2)), up
        first = _shuffle(h[:, :1], (1, 2, 2))
        h = jnp.concatenate([first[..., : first.shape[-1] // 2], _shuffle(h[:, 1:], (2, 2, 2))], axis=1)
        shortcut = jnp.concatenate(
            [
                jnp.repeat(_shuffle(x[:, :1], (1, 2, 2)), self.repeats // 2, axis=-1),
                jnp.repeat(_shuffle(x[:, 1:], (2, 2, 2)), self.repeats, axis=-1),
            ],
            axis=1,
        )
        return h + shortcut, up


class Level(nnx.Module):
    """One down or up block: ``resnets``, then an optional ``Downsample`` / ``Upsample``."""

    def __init__(self, c_in, c_out, layers, resample, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.resnets = nnx.List(
            [ResnetBlock(c_in if i == 0 else c_out, c_out, dtype=dtype, rngs=rngs) for i in range(layers)]
        )
        self.resample = nnx.data(resample)

    def __call__(self, x: jax.Array, rows: Rows) -> tuple[jax.Array, Rows]:
        for resnet in self.resnets:
            x = resnet(x, rows)
        return (x, rows) if self.resample is None else self.resample(x, rows)


class Encoder(nnx.Module):
    def __init__(self, cfg: HunyuanVideo15VAEConfig, *, dtype: Any, rngs: nnx.Rngs) -> None:
        boc = cfg.block_out_channels
        out = 2 * cfg.latent_channels
        self.conv_in = Conv(cfg.in_channels, boc[0], 3, dtype=dtype, rngs=rngs)
        blocks, c = [], boc[0]
        for i, width in enumerate(boc):
            down = None
            if i < cfg.spatial_levels:
                temporal = i >= cfg.spatial_levels - cfg.temporal_levels
                down_out = boc[i + 1] if cfg.downsample_match_channel else width
                down = Downsample(width, down_out, temporal, dtype=dtype, rngs=rngs)
            blocks.append(Level(c, width, cfg.layers_per_block, down, dtype=dtype, rngs=rngs))
            c = width if down is None else down_out
        self.down_blocks = nnx.List(blocks)
        self.mid_block = MidBlock(boc[-1], dtype=dtype, rngs=rngs)
        self.norm_out = RMSNorm(boc[-1], dtype=dtype, rngs=rngs)
        self.conv_out = Conv(boc[-1], out, 3, dtype=dtype, rngs=rngs)
        self.group = boc[-1] // out

    def __call__(self, x: jax.Array, rows: Rows) -> jax.Array:
        x = self.conv_in(x, rows)
        for block in self.down_blocks:
            x, rows = block(x, rows)
        x = self.mid_block(x, rows)
        return self.conv_out(jax.nn.silu(self.norm_out(x)), rows) + _group_mean(x, self.group)


class Decoder(nnx.Module):
    def __init__(self, cfg: HunyuanVideo15VAEConfig, *, dtype: Any, rngs: nnx.Rngs) -> None:
        boc = tuple(reversed(cfg.block_out_channels))
        self.conv_in = Conv(cfg.latent_channels, boc[0], 3, dtype=dtype, rngs=rngs)
        self.repeat = boc[0] // cfg.latent_channels
        self.mid_block = MidBlock(boc[0], dtype=dtype, rngs=rngs)
        blocks, c = [], boc[0]
        for i, width in enumerate(boc):
            up = None
            if i < cfg.spatial_levels or i < cfg.temporal_levels:
                up_out = boc[i + 1] if cfg.upsample_match_channel else width
                up = Upsample(width, up_out, i < cfg.temporal_levels, dtype=dtype, rngs=rngs)
            blocks.append(Level(c, width, cfg.layers_per_block + 1, up, dtype=dtype, rngs=rngs))
            c = width if up is None else up_out
        self.up_blocks = nnx.List(blocks)
        self.norm_out = RMSNorm(boc[-1], dtype=dtype, rngs=rngs)
        self.conv_out = Conv(boc[-1], cfg.out_channels, 3, dtype=dtype, rngs=rngs)

    def __call__(self, z: jax.Array, rows: Rows) -> jax.Array:
        x = self.conv_in(z, rows) + jnp.repeat(z.astype(jnp.float32), self.repeat, axis=-1)
        x = self.mid_block(x, rows)
        for block in self.up_blocks:
            x, rows = block(x, rows)
        return self.conv_out(jax.nn.silu(self.norm_out(x)), rows)


class HunyuanVideo15VAE(nnx.Module):
    """``encode`` pixels [B, C, F, H, W] in [-1, 1] -> the posterior's mean latents [B, 32, F', H/16, W/16]
    (unscaled, diffusers' ``latent_dist.mode()``); ``decode`` latents (unscaled) -> pixels. Channels
    first at the interface, as diffusers; channels last inside."""

    def __init__(
        self, config: HunyuanVideo15VAEConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs | None = None
    ):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.encoder = Encoder(config, dtype=dtype, rngs=rngs)
        self.decoder = Decoder(config, dtype=dtype, rngs=rngs)

    def _check(self, x: Any, channels: int, what: str) -> None:
        if x.ndim != 5 or x.shape[1] != channels:
            raise ValueError(f"{what} has shape {tuple(x.shape)}; expected [B, {channels}, F, H, W]")

    def encode(self, pixels: jax.Array, rows: Rows | None = None) -> jax.Array:
        """Pixels [B, C, F, H, W] -> mean latents [B, 32, F', H/16, W/16]. ``rows``: inside ``shard_map``,
        the layout of the pixel rows this tile holds (bands a multiple of 16 rows); None: one device."""
        cfg = self.config
        self._check(pixels, cfg.in_channels, "pixels")
        cfg.latent_frames(pixels.shape[2])
        s = cfg.spatial_compression_ratio
        if pixels.shape[3] % s or pixels.shape[4] % s:
            raise ValueError(
                f"pixels of {pixels.shape[3]}x{pixels.shape[4]}: height and width must be multiples of {s}"
            )
        rows = rows or Rows(pixels.shape[3], pixels.shape[3], 1)
        moments = self.encoder(jnp.moveaxis(jnp.asarray(pixels), 1, -1), rows)
        return jnp.moveaxis(moments[..., : cfg.latent_channels], -1, 1)

    def decode(self, latents: jax.Array, rows: Rows | None = None) -> jax.Array:
        """Latents [B, 32, F', h, w] -> pixels [B, 3, F, 16h, 16w]. ``rows``: inside ``shard_map``, the
        layout of the latent rows this tile holds; None: one device."""
        self._check(latents, self.config.latent_channels, "latents")
        rows = rows or Rows(latents.shape[3], latents.shape[3], 1)
        return jnp.moveaxis(self.decoder(jnp.moveaxis(jnp.asarray(latents), 1, -1), rows), -1, 1)


def abstract_vae(config: HunyuanVideo15VAEConfig, dtype: Any = jnp.float32) -> HunyuanVideo15VAE:
    return nnx.eval_shape(lambda: HunyuanVideo15VAE(config, dtype=dtype, rngs=nnx.Rngs(0)))


def parameter_shapes(config: HunyuanVideo15VAEConfig) -> dict[str, tuple[int, ...]]:
    """Dotted parameter path -> shape."""
    return partitioning.parameter_shapes(abstract_vae(config))
