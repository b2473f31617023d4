"""Ring attention (Liu et al., arXiv 2310.01889) over the ``ring`` mesh axis.

Each ring member keeps its queries and passes its K/V block to the next member; after R-1 hops every
query has seen every key. The next hop's ppermute is issued before the local block is computed, so the
transfer can overlap the computation (on GPU that needs XLA's latency-hiding scheduler), and there is no
trailing hop: exactly R-1 collective-permutes of K and of V. Partial results are merged by log-sum-exp in
fp32. DiT attention is not causal, so no load balancing of the token order is needed. A caller may keep
the blocks that pass through (PipeFusion stores them as the next step's stale K/V).

Runs inside ``shard_map`` (local view).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxdit.parallel.local_attention import local_attention, merge_partials

RING_AXIS = "ring"

#: key_valid_for(source_ring_rank) -> [B, Tk] bool mask for the K/V block that rank owns, or None.
KeyValidFn = Callable[[jax.Array], jax.Array | None]


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    degree: int,
    key_valid_for: KeyValidFn | None = None,
    axis_name: str = RING_AXIS,
    *,
    out_dtype=None,
    keep_blocks: bool = False,
    **kernel_kwargs,
) -> tuple:
    """q [B, Tq, H, D] against the K/V blocks of all ``degree`` ring members; returns (out, lse fp32).

    ``key_valid_for`` gives the key mask of the block owned by a ring rank, computed locally from the
    static padding layout, so no mask travels with K/V. ``out_dtype``: the output's dtype (default q's;
    fp32 for a caller that merges more partial results). ``keep_blocks``: also return the K and V blocks
    that passed through, every member's, as ``(k_all, v_all)`` [B, degree*Tk, H, D] in ring-rank order
    (what an all-gather over the ring would give, at no extra communication): (out, lse, (k_all, v_all)).
    """
    key_valid_for = key_valid_for or (lambda src: None)
    if degree == 1:
        out, lse = local_attention(q, k, v, key_valid_for(jnp.int32(0)), out_dtype=out_dtype, **kernel_kwargs)
        return (out, lse, (k, v)) if keep_blocks else (out, lse)
    me = lax.axis_index(axis_name)
    forward = [(i, (i + 1) % degree) for i in range(degree)]
    out = lse = None
    kept = []
    for hop in range(degree):  # static: degree is a mesh size, and the last hop sends nothing
        if hop < degree - 1:
            k_next = lax.ppermute(k, axis_name, forward)
            v_next = lax.ppermute(v, axis_name, forward)
        source = (me - hop) % degree  # whose K/V block is here after `hop` hops
        o, l = local_attention(q, k, v, key_valid_for(source), out_dtype=jnp.float32, **kernel_kwargs)
        out, lse = (o, l) if out is None else merge_partials(out, lse, o, l)
        kept.append((k, v))
        if hop < degree - 1:
            k, v = k_next, v_next
    out = out.astype(out_dtype or q.dtype)
    if not keep_blocks:
        return out, lse
    return out, lse, tuple(_by_rank([kv[i] for kv in kept], me) for i in range(2))


def _by_rank(blocks: list[jax.Array], me: jax.Array) -> jax.Array:
    """The blocks a member held after 0, 1, ... hops -> [B, degree*Tk, ...] in their owners' rank order."""
    stacked = jnp.stack(blocks)  # [hop, B, Tk, ...]; after `hop` hops the block is rank (me - hop)'s
    stacked = stacked[(me - jnp.arange(len(blocks))) % len(blocks)]  # [rank, B, Tk, ...]
    return jnp.moveaxis(stacked, 0, 1).reshape(stacked.shape[1], -1, *stacked.shape[3:])
