"""VAEs from a checkpoint: the checkpoint side of ``jaxdit.vae``.

``load_flux_vae`` reads FLUX's AutoencoderKL (a diffusers ``vae/`` folder or BFL's ``ae.safetensors``,
``converters/vae_kl.py``); ``load_wan_vae`` Wan 2.1's and 2.2's causal 3D VAE (``converters/vae_wan.py``).
The decoders themselves, and how they split work over a mesh, are in ``jaxdit/vae/``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from converters import vae_kl, vae_wan
from jaxdit.vae import autoencoder_kl, wan_vae
from jaxdit.vae.autoencoder_kl import FluxVAE, VAEConfig
from jaxdit.vae.wan_vae import WanVAE, WanVAEConfig

__all__ = ["load_flux_vae", "load_wan_vae"]


def _filled(abstract: nnx.Module, resolve: Any, dtype: Any) -> nnx.Module:
    """The abstract module with every parameter read from the checkpoint's lazy tensors, in ``dtype``."""
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    key = lambda path: ".".join(map(str, path))
    lazies = resolve({key(p): tuple(v.shape) for p, v in flat})
    filled = [(p, v.replace(jnp.asarray(np.asarray(lazies[key(p)]), dtype))) for p, v in flat]
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def load_flux_vae(
    path: str | os.PathLike[str],
    dtype: Any = None,
    *,
    config: VAEConfig | Mapping[str, Any] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> FluxVAE:
    """A diffusers ``vae/`` folder (or a pipeline folder holding one) or a BFL ``ae.safetensors``.

    ``dtype`` defaults to the checkpoint's storage dtype; ``config`` overrides the one read (diffusers) or
    inferred from the keys (BFL).
    """
    ckpt = vae_kl.detect(path, config)
    dtype = jnp.dtype(dtype or ckpt.dtype)
    model = _filled(autoencoder_kl.abstract_model(ckpt.config, dtype), ckpt.resolve, dtype)
    return FluxVAE(model, compiler_options=compiler_options)


def load_wan_vae(
    path: str | os.PathLike[str],
    dtype: Any = None,
    *,
    config: WanVAEConfig | Mapping[str, Any] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> WanVAE:
    """A diffusers ``vae/`` folder (or a pipeline folder holding one), Wan's ``Wan2.1_VAE.pth`` or
    ``Wan2.2_VAE.pth`` (or a folder holding it), or a single ``.safetensors`` of either key layout.

    ``dtype`` defaults to the checkpoint's storage dtype; ``config`` overrides the one read or inferred (a
    ``.pth`` has none: the Wan 2.1 or 2.2 preset, by its keys, with widths read from the tensors).
    """
    ckpt = vae_wan.detect(path, config)
    dtype = jnp.dtype(dtype or ckpt.dtype)
    model = _filled(wan_vae.abstract_model(ckpt.config, dtype), ckpt.resolve, dtype)
    return WanVAE(model, compiler_options=compiler_options)
