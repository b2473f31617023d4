"""HunyuanVideo 1.5's VAE from a checkpoint (``converters/vae_hunyuan_video15.py``), filled through
:func:`jaxdit.loading.vae.filled`."""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp

from converters import vae_hunyuan_video15
from jaxdit.loading.vae import filled
from jaxdit.vae.hunyuan_video15_vae import HunyuanVideo15VAE, abstract_vae

__all__ = ["load_hunyuan_video15_vae"]


def load_hunyuan_video15_vae(path: str | os.PathLike[str], dtype: Any = jnp.float32) -> HunyuanVideo15VAE:
    """A diffusers ``AutoencoderKLHunyuanVideo15`` folder (or the pipeline folder holding ``vae/``)."""
    ckpt = vae_hunyuan_video15.detect(path)
    dtype = jnp.dtype(dtype)
    return filled(abstract_vae(ckpt.config, dtype), ckpt.resolve, dtype)
