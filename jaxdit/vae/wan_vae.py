"""Wan's VAE (2.1 and 2.2) with diffusers' calling conventions, decoded and encoded row-parallel.

The model (:mod:`jaxdit.vae.wan_vae_model`, layers in :mod:`jaxdit.vae.wan_vae_layers`, Wan 2.2's
additions in :mod:`jaxdit.vae.wan_vae_residual`, the config in :mod:`jaxdit.vae.wan_vae_config`) follows
diffusers' ``AutoencoderKLWan`` (``models/autoencoders/autoencoder_kl_wan.py``) and Wan's
``wan/modules/vae.py`` (2.1) / ``vae2_2.py`` (2.2). :class:`WanVAE` takes and returns diffusers'
``[B, C, T, H, W]`` arrays.

Constructing and loading::

    vae = jaxdit.loading.wan.load_wan_vae("Wan2.2-TI2V-5B-Diffusers/vae")   # or the pipeline folder
    vae = jaxdit.loading.wan.load_wan_vae("Wan2.2-TI2V-5B")                 # Wan-AI's release: Wan2.2_VAE.pth
    vae = jaxdit.loading.wan.load_wan_vae("Wan2.1_VAE.pth")                 # Wan 2.1, original layout
    vae = WanVAE(abstract_model(WanVAEConfig.preset("wan2.2-vae")))  # no weights: compile / memory

A ``.pth`` carries no config: the preset of its generation (residual blocks present: ``wan2.2-vae``,
else ``wan2.1-vae``) with the widths read from its tensors; ``config=`` overrides.

Latents. ``decode(z)``/``encode(x)`` take and give the VAE's raw latents (diffusers' ``decode(z).sample``
and ``encode(x).latent_dist.mean/.logvar``); the pipelines' normalised latents are
``(z - latents_mean) / latents_std`` per channel (16 values for Wan 2.1, 48 for Wan 2.2, from the
config): :meth:`WanVAE.normalize_latents` applies it, :meth:`WanVAE.decode_latents` undoes it before
decoding. Shapes: ``x`` [B, 3, T, H, W] with T = 4n+1 and H, W multiples of ``config.spatial_factor``
(8 for 2.1, 16 for 2.2) -> latents [B, z_dim, n+1, H/s, W/s]; a latent of F frames decodes to
``config.decoder_temporal_factor * (F - 1) + 1`` frames.

Row parallelism (``decode(z, mesh=...)``, ``encode(x, mesh=...)``). Rows are split over all devices of
the mesh, viewed as one ``tiles`` axis (:func:`jaxdit.vae.spatial.tile_mesh`), inside ``shard_map``, with
the primitives of :mod:`jaxdit.vae.spatial` (shared with the FLUX VAE). What each layer needs from the
other tiles:

- convolutions with a 3x3 spatial kernel: one halo row above and below (``spatial.halo``: two
  ``ppermute``s); the cached past frames belong to the tile and never move;
- the encoder's 2x downsampling (zero pad one row and column at the end, 3x3 stride 2):
  ``spatial.downsample_conv``, one row from the tile below (one ``ppermute``);
- RMS_norm (per pixel, over channels: no statistics cross a tile), SiLU, 1x1 convolutions, the temporal
  (3,1,1) convolutions, nearest upsampling, and Wan 2.2's patchify and avg-down / dup-up shortcuts
  (inside aligned row pairs): nothing;
- the mid-block attention (per frame, over all h*w positions of the frame, at the latent resolution),
  and the encoder attention of ``attn_scales``: ring attention over the tiles (``spatial.attention``),
  not an all-gather of K/V. Both would do at this size (480p: 60x104 tokens x 384 channels, a frame's
  K and V are 19 MB in fp32), and the attention is a sliver of the decode's time next to the
  full-resolution convolutions, so the P-1 dependent hops cost little; in exchange each device holds
  1/P of K/V and of the score matrix, the program has permutes only (no all-gather, the DESIGN rule),
  and FLUX's VAE and this one share one tested implementation.

Heights the device count does not divide are padded with rows at the end (``spatial.Rows``); every tile
computes its valid-row mask locally (the valid region doubles exactly with each 2x upsampling); padded
rows are zeroed before every spatial convolution (so a halo or in-tile neighbour read of one is the zero
padding the unsharded model sees) and padded keys are masked in attention, so the result is exact.
The encoder's pixel bands are a multiple of the spatial factor (the patch times 2 per stride-2 level),
so every level halves every band and a tile's latent rows are exactly those of its pixel rows; a padded
row below the image is the zero row the stride-2 conv pads with, so the encode is exact for every
height (a multiple of the spatial factor, as the unsharded encode requires).
Without a mesh the same program runs on one tile (no collectives).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdit.vae import spatial
from jaxdit.vae.spatial import Rows
from jaxdit.vae.tiled import TiledPrograms, device_key
from jaxdit.vae.wan_vae_config import (
    ENCODE_CHUNK,
    WAN21_LATENTS_MEAN,
    WAN21_LATENTS_STD,
    WAN22_LATENTS_MEAN,
    WAN22_LATENTS_STD,
    WanVAEConfig,
)
from jaxdit.vae.wan_vae_model import WanVAEModel, abstract_model, parameter_shapes

__all__ = [
    "ENCODE_CHUNK",
    "WAN21_LATENTS_MEAN",
    "WAN21_LATENTS_STD",
    "WAN22_LATENTS_MEAN",
    "WAN22_LATENTS_STD",
    "WanVAE",
    "WanVAEConfig",
    "WanVAEModel",
    "abstract_model",
    "parameter_shapes",
]


class WanVAE(TiledPrograms):
    """A Wan VAE (2.1 or 2.2) with diffusers' ``AutoencoderKLWan`` calling conventions ([B, C, T, H, W]).

    ``decode(z, mesh=None)``: unnormalized latents -> video in [-1, 1]; with a mesh, rows are split over
    all its devices (without one, the same program runs on one tile). ``decode_latents`` first undoes the
    pipeline's normalization. ``encode(x, mesh=None)`` -> ``(mean, logvar)``, row-parallel likewise;
    ``normalize_latents`` turns a mean into what the denoiser sees.
    Compiled programs are cached per (devices, shape, dtype); :meth:`compiled_decode` and
    :meth:`compiled_encode` expose them (e.g. for ``memory_analysis()``).
    The model may be abstract (:func:`abstract_model`) for compiling without weights.
    """

    def __init__(self, model: WanVAEModel, *, compiler_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(model, compiler_options=compiler_options)
        self.model = model
        self.config: WanVAEConfig = model.config

    # ------------------------------------------------------------------ programs
    def _decode_program(self, tiles: Mesh, state: Any, z: jax.Array) -> jax.Array:
        """[B, z, F, h, w] -> [B, C, T, H, W]: rows padded to the tiles, decoded in ``shard_map``."""
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
        z = jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(tiles, PartitionSpec()))
        program = functools.partial(self._decode_program, tiles)
        return self._compile(("decode", tuple(shape), jnp.dtype(dtype)), tiles, program, z)

    # ------------------------------------------------------------------ calls
    def decode(self, z: Any, mesh: Mesh | None = None) -> jax.Array:
        """Unnormalized latents [B, z_dim, F, h, w] -> video [B, 3, tf(F-1)+1, s*h, s*w] in [-1, 1] (in
        the model's dtype; tf = ``config.decoder_temporal_factor``, s = ``config.spatial_factor``), as
        diffusers' ``AutoencoderKLWan.decode(z).sample``."""
        z = jnp.asarray(z)
        if z.ndim != 5 or z.shape[1] != self.config.z_dim:
            raise ValueError(f"expected latents [B, {self.config.z_dim}, F, h, w], got {tuple(z.shape)}")
        p = self.config.patch
        if self.config.out_channels % (p * p):
            raise ValueError(
                f"out_channels={self.config.out_channels} do not unpatchify into {p}x{p} patches "
                "(diffusers' decode fails on this config too)"
            )
        tiles = self.tiles(mesh)
        fn = self.compiled_decode(z.shape, mesh, z.dtype)
        return fn(self._state_on(tiles), jax.device_put(z, NamedSharding(tiles, PartitionSpec())))

    def _latent_stats(self) -> tuple[jax.Array, jax.Array]:
        """(latents_mean, latents_std) as fp32 [1, z_dim, 1, 1, 1]."""
        self.config.check_latent_stats()
        shape = (1, -1, 1, 1, 1)
        mean = jnp.asarray(self.config.latents_mean, jnp.float32).reshape(shape)
        return mean, jnp.asarray(self.config.latents_std, jnp.float32).reshape(shape)

    def decode_latents(self, z: Any, mesh: Mesh | None = None) -> jax.Array:
        """Normalized latents (what the denoiser sees) -> video: ``z * latents_std + latents_mean`` first."""
        mean, std = self._latent_stats()
        return self.decode(jnp.asarray(z, jnp.float32) * std + mean, mesh)

    def normalize_latents(self, z: Any) -> jax.Array:
        """Raw latents (e.g. the mean from :meth:`encode`) -> ``(z - latents_mean) / latents_std`` (fp32),
        the pipelines' normalisation (diffusers' WanPipeline and Wan's originals)."""
        mean, std = self._latent_stats()
        return (jnp.asarray(z, jnp.float32) - mean) / std

    def encode_rows(self, height: int, mesh: Mesh | None = None) -> Rows:
        """The layout of ``height`` pixel rows on the tiles of ``mesh``.

        Bands are a multiple of the spatial factor (8 rows for Wan 2.1's three stride-2 levels, 16 for Wan
        2.2's patchify and three levels), so the patchify and every level halve every band and tiles stay aligned: tile t's latent rows are exactly the latents of
        its pixel rows. Heights the device count does not divide are padded at the end (zero rows: the
        pad row the (0, 1, 0, 1)-padded stride-2 conv adds below the image), so any height is exact.
        """
        f = self.config.spatial_factor
        return Rows.split(height, self.tiles(mesh).size, multiple=f, axis_name=spatial.TILE_AXIS)

    def _encode_program(self, tiles: Mesh, rows: Rows, state: Any, x: jax.Array) -> tuple[Any, Any]:
        """Padded channels-last frames [B, T, rows.padded, W, C], row-sharded -> padded (mean, logvar)."""
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
        """The compiled core of :meth:`encode` for videos [B, C, T, H, W] of ``shape`` (cached): called
        with ``(state, x)``, x the channels-last frames with rows padded to :meth:`encode_rows` and split
        over the tiles; returns padded (mean, logvar), channels last. Parameters may be abstract."""
        tiles = self.tiles(mesh)
        b, c, t, h, w = shape
        rows = self.encode_rows(h, mesh)
        banded = NamedSharding(tiles, spatial.row_spec(5))
        x = jax.ShapeDtypeStruct((b, t, rows.padded, w, c), self.dtype, sharding=banded)
        program = functools.partial(self._encode_program, tiles, rows)
        return self._compile(("encode", tuple(shape), jnp.dtype(dtype)), tiles, program, x)

    def encode(self, x: Any, mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array]:
        """Video [B, 3, T, H, W] in [-1, 1] -> (mean, logvar) in fp32, each [B, z_dim, (T-1)//tf + 1, H/s,
        W/s] (tf = ``config.temporal_factor``, s = ``config.spatial_factor``; frames past the last whole
        4-frame chunk are ignored), as diffusers' ``encode(x).latent_dist.mean`` / ``.logvar``.

        With a mesh, the pixel rows are split over all its devices (:meth:`encode_rows`): each device
        holds 1/P of the video and of every activation; halo rows move by permutes, the mid-block
        attention is ring attention. Without one, the same program runs on one device.
        """
        x = jnp.asarray(x)
        cfg = self.config
        if cfg.in_channels % cfg.patch**2:
            raise ValueError(
                f"in_channels={cfg.in_channels} is not a whole number of {cfg.patch}x{cfg.patch} patches "
                "(diffusers' encode fails on this config too)"
            )
        if x.ndim != 5 or x.shape[1] != cfg.video_channels:
            raise ValueError(f"expected a video [B, {cfg.video_channels}, T, H, W], got {tuple(x.shape)}")
        f = cfg.spatial_factor
        if x.shape[3] % f or x.shape[4] % f:
            raise ValueError(f"height and width must be multiples of {f}, got {x.shape[3]}x{x.shape[4]}")
        if cfg.num_res_blocks == 0 and len(set(cfg.encoder_dims())) > 1:
            raise ValueError(
                f"num_res_blocks=0 with encoder widths {cfg.encoder_dims()}: no residual block changes the "
                "width, so the encoder's layers do not fit together (diffusers' encode fails on it too)"
            )
        if x.shape[2] > 1 and cfg.temporal_factor > ENCODE_CHUNK:
            raise ValueError(
                f"this VAE compresses time {cfg.temporal_factor}x but encodes {ENCODE_CHUNK}-frame chunks "
                "(as diffusers' encode, which fails on it too): only single frames (T=1) can be encoded"
            )
        tiles = self.tiles(mesh)
        rows = self.encode_rows(x.shape[3], mesh)
        core = self.compiled_encode(x.shape, mesh, x.dtype)
        key = ("encode-io", device_key(tiles), tuple(x.shape), x.dtype)
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
