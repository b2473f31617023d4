"""HunyuanVideo 1.5's VAE decoded (and encoded) row-parallel over all the devices of a mesh.

The layers (:mod:`jaxdit.vae.hunyuan_video15_vae`) take a :class:`~jaxdit.vae.spatial.Rows` layout; this
file runs them inside ``shard_map`` over the 1-D tile mesh of every device (``spatial.tile_mesh``), as
Wan's VAE does: the latent rows split into bands (heights the device count does not divide padded at
the end), halo rows by permutes with the image's edge replicated, the causal mid-block attention with
the K/V band passed round the tiles. Without a mesh the same program runs on one tile. Compiled
programs are cached per (devices, shape, dtype); :meth:`HunyuanVideo15MeshVAE.compiled_decode` exposes
them (``memory_analysis()``: ``scripts/video_vae_memory.py --vae hunyuanvideo1.5``). The model may be
abstract (:func:`~jaxdit.vae.hunyuan_video15_vae.abstract_vae`) for compiling without weights.
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
from jaxdit.vae.hunyuan_video15_vae import HunyuanVideo15VAE
from jaxdit.vae.spatial import Rows
from jaxdit.vae.tiled import TiledPrograms

__all__ = ["HunyuanVideo15MeshVAE"]

#: Channels-first [B, C, T, H, W] with rows (axis 3) on the tiles.
BANDS = PartitionSpec(None, None, None, spatial.TILE_AXIS, None)


class HunyuanVideo15MeshVAE(TiledPrograms):
    """``decode(z, mesh=None)``: unscaled latents [B, 32, F', h, w] -> frames [B, 3, F, 16h, 16w] in
    [-1, 1], rows split over every device of ``mesh``; ``encode(x, mesh=None)``: pixels -> the
    posterior's mean latents, likewise (pixel bands a multiple of 16 rows)."""

    def __init__(self, vae: HunyuanVideo15VAE, *, compiler_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(vae, compiler_options=compiler_options)
        self.vae = vae

    def _program(self, tiles: Mesh, rows: Rows, method: str, state: Any, x: jax.Array):
        """Replicated input -> the tiles' output bands, padding rows included (dropping them inside the
        program would make XLA re-balance the bands with permutes of the whole output)."""
        graphdef = self.graphdef
        local = jax.shard_map(
            lambda s, xl: getattr(nnx.merge(graphdef, s), method)(xl, rows),
            mesh=tiles,
            in_specs=(PartitionSpec(), BANDS),
            out_specs=BANDS,
            check_vma=False,
        )
        x = jnp.moveaxis(spatial.pad_rows(jnp.moveaxis(x.astype(self.dtype), 1, -1), rows), -1, 1)
        return local(state, x)

    def _out_rows(self, method: str, height: int, mesh: Mesh | None) -> Rows:
        """Real output rows of ``height`` input rows (what :meth:`decode` / :meth:`encode` keep)."""
        s, n = self.config.spatial_compression_ratio, self.tiles(mesh).size
        if method == "decode":
            return Rows.split(height, n).upsampled(s)
        rows = Rows.split(height, n, multiple=s)
        return Rows(rows.rows // s, rows.local // s, rows.tiles)

    def _compiled_program(self, method: str, shape: Sequence[int], mesh: Mesh | None, dtype: Any):
        tiles = self.tiles(mesh)
        multiple = 1 if method == "decode" else self.config.spatial_compression_ratio
        rows = Rows.split(shape[3], tiles.size, multiple=multiple)
        x = jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(tiles, PartitionSpec()))
        program = functools.partial(self._program, tiles, rows, method)
        return self._compile((method, tuple(shape), jnp.dtype(dtype)), tiles, program, x)

    def compiled_decode(self, shape: Sequence[int], mesh: Mesh | None = None, dtype: Any = jnp.float32):
        """The compiled decode of latents of ``shape`` (called with ``(state, z)``; cached): returns the
        tiles' bands of frames, padding rows included (:meth:`decode` drops them)."""
        self.vae._check(jax.ShapeDtypeStruct(tuple(shape), dtype), self.config.latent_channels, "latents")
        return self._compiled_program("decode", shape, mesh, dtype)

    def compiled_encode(self, shape: Sequence[int], mesh: Mesh | None = None, dtype: Any = jnp.float32):
        """The compiled encode of pixels of ``shape`` (called with ``(state, x)``; cached): returns the
        tiles' bands of latents, padding rows included (:meth:`encode` drops them)."""
        cfg = self.config
        self.vae._check(jax.ShapeDtypeStruct(tuple(shape), dtype), cfg.in_channels, "pixels")
        cfg.latent_frames(shape[2])
        s = cfg.spatial_compression_ratio
        if shape[3] % s or shape[4] % s:
            raise ValueError(f"pixels of {shape[3]}x{shape[4]}: height and width must be multiples of {s}")
        return self._compiled_program("encode", shape, mesh, dtype)

    def _run(self, method: str, compiled: Any, x: jax.Array, mesh: Mesh | None) -> jax.Array:
        tiles = self.tiles(mesh)
        y = compiled(self._state_on(tiles), jax.device_put(x, NamedSharding(tiles, PartitionSpec())))
        return y[:, :, :, : self._out_rows(method, x.shape[3], mesh).rows]

    def decode(self, z: Any, mesh: Mesh | None = None) -> jax.Array:
        """Unscaled latents [B, 32, F', h, w] -> frames [B, 3, 4(F'-1)+1, 16h, 16w] (the VAE's dtype)."""
        z = jnp.asarray(z)
        return self._run("decode", self.compiled_decode(z.shape, mesh, z.dtype), z, mesh)

    def encode(self, x: Any, mesh: Mesh | None = None) -> jax.Array:
        """Pixels [B, 3, F, H, W] in [-1, 1] -> mean latents [B, 32, F', H/16, W/16] (unscaled)."""
        x = jnp.asarray(x)
        return self._run("encode", self.compiled_encode(x.shape, mesh, x.dtype), x, mesh)
