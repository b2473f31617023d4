"""Loading FLUX.2's autoencoder: a diffusers ``AutoencoderKLFlux2`` folder -> :class:`Flux2VAE` (the
AutoencoderKL weights through ``converters/vae_flux2.py`` and the latent BatchNorm statistics)."""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from converters.vae_flux2 import detect
from jaxdit.loading.vae import filled
from jaxdit.vae import autoencoder_kl
from jaxdit.vae.autoencoder_kl import FluxVAE
from jaxdit.vae.flux2_vae import Flux2VAE

__all__ = ["load_flux2_vae"]


def load_flux2_vae(path: str | os.PathLike[str], dtype: Any = None) -> Flux2VAE:
    """A diffusers ``AutoencoderKLFlux2`` folder (or a pipeline folder holding one in ``vae/``)."""
    ckpt = detect(path)
    dtype = jnp.dtype(dtype or ckpt.dtype)
    model = filled(autoencoder_kl.abstract_model(ckpt.vae.config, dtype), ckpt.vae.resolve, dtype)
    std = np.sqrt(ckpt.running_var.astype(np.float64) + ckpt.eps).astype(np.float32)
    return Flux2VAE(FluxVAE(model), ckpt.running_mean, std, ckpt.patch_size)
