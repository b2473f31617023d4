"""Ulysses sequence parallelism (DeepSpeed-Ulysses, arXiv 2309.14509).

Tokens arrive sharded by sequence: every head of 1/U of the tokens. A tiled all_to_all over the
``ulysses`` axis turns that into 1/U of the heads for every token, attention runs locally per head, and a
second all_to_all turns the output back into sequence shards. Per attention layer each device sends
(U-1)/U of four tensors of [seq/U, heads, head_dim] (q, k, v, output); heads must divide by U.

These functions run inside ``shard_map`` (local view); ``jaxdit.parallel.attention`` is the entry point.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax

ULYSSES_AXIS = "ulysses"


def seq_to_heads(x: jax.Array, degree: int, axis_name: str = ULYSSES_AXIS) -> jax.Array:
    """[B, n, H, D] (a sequence shard, all heads) -> [B, n*U, H/U, D] (all shards' tokens, some heads).

    The gathered sequence is ordered by the ulysses rank the tokens came from.
    """
    if degree == 1:
        return x
    return lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x: jax.Array, degree: int, axis_name: str = ULYSSES_AXIS) -> jax.Array:
    """Inverse of :func:`seq_to_heads`: [B, n*U, H/U, D] -> [B, n, H, D]."""
    if degree == 1:
        return x
    return lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)


def ulysses_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    attend: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    degree: int,
    axis_name: str = ULYSSES_AXIS,
) -> jax.Array:
    """Sequence-sharded q/k/v [B, n, H, D] -> sequence-sharded output [B, n, H, D].

    ``attend(q, k, v)`` computes attention over the gathered sequence for the local heads (a local
    kernel, or Ring attention across ring members for USP); it owns the key mask, which it knows in
    the gathered order.
    """
    heads = q.shape[2]
    if heads % degree:
        raise ValueError(f"{heads} local heads cannot be split over ulysses={degree}")
    qh, kh, vh = (seq_to_heads(t, degree, axis_name) for t in (q, k, v))
    return heads_to_seq(attend(qh, kh, vh), degree, axis_name)
