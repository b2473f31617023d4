"""FLUX.2's autoencoder as its pipelines use it: jaxdit's AutoencoderKL (``vae/autoencoder_kl.py``) at 32
latent channels, with latents patchified 2 x 2 (to 128 channels), normalised by the VAE's latent
BatchNorm running statistics, and packed row-major into tokens for the transformer.

diffusers' ``Flux2Pipeline`` decodes the transformer's tokens by unpacking them on their (row, column)
ids, de-normalising with ``mean + token * sqrt(var + eps)``, un-patchifying and decoding; and turns a
reference picture into tokens by encoding (the posterior mean), patchifying and normalising.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxdit.vae.autoencoder_kl import FluxVAE

__all__ = ["Flux2VAE", "pack", "patchify", "unpack", "unpatchify"]


def patchify(z: jax.Array, p: tuple[int, int] = (2, 2)) -> jax.Array:
    """[B, C, H, W] -> [B, C * ph * pw, H / ph, W / pw], channel-major (c, i, j) as diffusers orders it."""
    b, c, h, w = z.shape
    if h % p[0] or w % p[1]:
        raise ValueError(f"latents {h} x {w} are not divisible into {p[0]} x {p[1]} patches")
    z = z.reshape(b, c, h // p[0], p[0], w // p[1], p[1]).transpose(0, 1, 3, 5, 2, 4)
    return z.reshape(b, c * p[0] * p[1], h // p[0], w // p[1])


def unpatchify(z: jax.Array, p: tuple[int, int] = (2, 2)) -> jax.Array:
    """The inverse of :func:`patchify`."""
    b, c, h, w = z.shape
    z = z.reshape(b, c // (p[0] * p[1]), p[0], p[1], h, w).transpose(0, 1, 4, 2, 5, 3)
    return z.reshape(b, c // (p[0] * p[1]), h * p[0], w * p[1])


def pack(z: jax.Array) -> jax.Array:
    """[B, C, h, w] -> tokens [B, h * w, C], row-major (the order of ``flux2_config.image_ids``)."""
    b, c, h, w = z.shape
    return z.reshape(b, c, h * w).transpose(0, 2, 1)


def unpack(tokens: jax.Array, rows: int, cols: int) -> jax.Array:
    """Row-major tokens [B, rows * cols, C] -> [B, C, rows, cols]."""
    b, n, c = tokens.shape
    if n != rows * cols:
        raise ValueError(f"{n} tokens do not fill a {rows} x {cols} grid")
    return tokens.transpose(0, 2, 1).reshape(b, c, rows, cols)


@dataclasses.dataclass
class Flux2VAE:
    """The autoencoder and the latent statistics (``mean``, ``std = sqrt(running_var + eps)``, fp32)."""

    vae: FluxVAE
    mean: np.ndarray
    std: np.ndarray
    patch_size: tuple[int, int] = (2, 2)

    def _stats(self) -> tuple[jax.Array, jax.Array]:
        return jnp.asarray(self.mean)[None, :, None, None], jnp.asarray(self.std)[None, :, None, None]

    def decode_tokens(self, tokens: jax.Array, rows: int, cols: int, mesh: Mesh | None = None) -> jax.Array:
        """The transformer's normalised tokens [B, rows * cols, 128] -> pixels [B, 3, k rows, k cols], k = 2 x the
        VAE's factor (16 for FLUX.2's) (NCHW, unclamped: diffusers' ``vae.decode`` output before post-processing)."""
        mean, std = self._stats()
        z = unpack(jnp.asarray(tokens, jnp.float32), rows, cols) * std + mean
        return self.vae.decode(unpatchify(z, self.patch_size).astype(self.vae.dtype), mesh)

    def encode_tokens(self, pixels: jax.Array, mesh: Mesh | None = None) -> tuple[jax.Array, int, int]:
        """Pixels [B, 3, H, W] in [-1, 1] -> (normalised tokens [B, N, 128], rows, cols): a reference
        image as the pipelines join it (the posterior mean, as ``sample_mode="argmax"``)."""
        mean, std = self._stats()
        z, _ = self.vae.encode(pixels, mesh)
        z = (patchify(z.astype(jnp.float32), self.patch_size) - mean) / std
        return pack(z), z.shape[2], z.shape[3]
