"""The contract every backend meets, and the small pieces the fused backends share to meet it.

Every backend takes q [B, Tq, H, D], k/v [B, Tk, H, D] and key_valid [B, Tk] bool (or None: every key is
real) and returns ``(out [B, Tq, H, D], lse [B, Tq, H] fp32)``, the log-sum-exp in natural log of the
scaled scores over the valid keys. A query whose keys are all masked gets out = 0 and lse = -inf: that
is the identity of Ring's log-sum-exp merge, so a K/V block made only of padding changes nothing.

The mask is one row per batch element, the same for every query and head, so "all keys masked" is a
property of a batch element; the fused kernels compute such rows as a (finite) average over masked keys
and :func:`clear_empty_rows` replaces them afterwards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_axis(x: jax.Array, axis: int, length: int, value=0) -> jax.Array:
    """Pad ``x`` along ``axis`` at the end to ``length`` (no-op when it is already that long)."""
    extra = length - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def clear_empty_rows(
    out: jax.Array, lse: jax.Array, key_valid: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """out -> 0 and lse -> -inf for the batch elements whose keys are all masked."""
    if key_valid is None:
        return out, lse
    empty = ~jnp.any(key_valid, axis=1)  # [B]
    out = jnp.where(empty[:, None, None, None], jnp.zeros((), out.dtype), out)
    lse = jnp.where(empty[:, None, None], -jnp.inf, lse)
    return out, lse
