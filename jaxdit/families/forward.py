"""Argument handling shared by the families' diffusers-style forward callables."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["as_float", "expect_shape", "per_batch"]


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


def expect_shape(name: str, x: Any, dims: tuple[int | str, ...], sizes: dict[str, int] | None = None) -> None:
    """Raise ValueError naming ``name``, its shape and the expected one unless ``x`` has ``len(dims)`` axes
    whose sizes match: an int must be equal; a letter is free, but the same letter across calls sharing
    ``sizes`` must be the same size (e.g. the batch ``B``). Before any tracing, so the error is the
    caller's, not an einsum's."""
    shape = tuple(np.shape(x))
    seen = {} if sizes is None else sizes
    known = dict(seen)  # sizes fixed by the arguments checked before this one
    ok = len(shape) == len(dims)
    for size, want in zip(shape, dims, strict=False):
        if isinstance(want, int):
            ok = ok and size == want
        elif seen.setdefault(want, size) != size:
            ok = False
    if not ok:
        expected = ", ".join(f"{d}={known[d]}" if isinstance(d, str) and d in known else str(d) for d in dims)
        raise ValueError(f"{name} has shape {shape}; this model takes [{expected}]")
