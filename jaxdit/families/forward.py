"""Argument handling shared by the families' diffusers-style forward callables."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["as_float", "per_batch"]


def as_float(x: Any, dtype: Any) -> Any:
    """jax arrays stay on device; anything else becomes a numpy array (padded on the host)."""
    if isinstance(x, jax.Array):
        return x.astype(dtype)
    return np.asarray(x).astype(jnp.dtype(dtype))


def per_batch(x: Any, batch: int, name: str) -> Any:
    """A scalar or [1] value broadcast to [batch] (fp32), or a [batch] one as is; else an error."""
    x = as_float(x, jnp.float32)
    if x.ndim == 0:
        x = x.reshape(1)
    if x.shape[0] == 1 and batch > 1:
        x = jnp.broadcast_to(x, (batch,)) if isinstance(x, jax.Array) else np.broadcast_to(x, (batch,))
    if x.shape != (batch,):
        raise ValueError(f"{name} has shape {x.shape}; expected ({batch},) or a scalar")
    return x
