"""VAEs from a checkpoint: the checkpoint side of ``jaxdit.vae``.

``load_flux_vae`` reads the AutoencoderKL FLUX.1 and the families after it share (a diffusers ``vae/``
folder or BFL's ``ae.safetensors``, ``converters/vae_kl.py``); :func:`filled` is how any VAE's abstract
module is filled from a checkpoint (a family's own VAE loader, e.g. ``loading/wan.py``, uses it). The
decoders themselves, and how they split work over a mesh, are in ``jaxdit/vae/``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from converters import vae_kl
from jaxdit.vae import autoencoder_kl
from jaxdit.vae.autoencoder_kl import FluxVAE, VAEConfig

__all__ = ["filled", "load_flux_vae"]


def filled(abstract: nnx.Module, resolve: Any, dtype: Any) -> nnx.Module:
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
    model = filled(autoencoder_kl.abstract_model(ckpt.config, dtype), ckpt.resolve, dtype)
    return FluxVAE(model, compiler_options=compiler_options)
