"""USP: Unified Sequence Parallelism (Fang & Zhao, arXiv 2405.07719), Ulysses inside Ring.

The sequence is sharded over (ring, ulysses), ring outer. Ulysses' all_to_all gathers the tokens of the
U members of a ring position (fast, neighbouring links) and splits heads; Ring attention then circulates
those gathered K/V blocks among the R ring positions (slower links, overlapped with compute); a final
all_to_all restores sequence shards. Either degree may be 1, which reduces USP to plain Ring or plain
Ulysses (no collective is emitted for a size-1 axis).

Runs inside ``shard_map`` (local view).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxdit.parallel.ring import RING_AXIS, ring_attention
from jaxdit.parallel.ulysses import ULYSSES_AXIS, ulysses_attention

#: key_valid_for_shard(sequence_shard_index) -> [B, n] bool mask of that shard's local keys, or None.
ShardKeyValidFn = Callable[[jax.Array], jax.Array | None]


def usp_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    ring_degree: int,
    ulysses_degree: int,
    key_valid_for_shard: ShardKeyValidFn | None = None,
    **kernel_kwargs,
) -> jax.Array:
    """Sequence-sharded q/k/v [B, n, H, D] -> attention output [B, n, H, D] over the whole sequence.

    Sequence shard s = ring_rank * ulysses_degree + ulysses_rank. ``key_valid_for_shard`` says which
    of a shard's n local keys are real (padding is masked); it is evaluated locally for any shard.
    """

    def keys_of_ring_member(src: jax.Array) -> jax.Array | None:
        # After Ulysses' all_to_all the keys held are the ulysses members' shards of ring position src,
        # concatenated in ulysses-rank order.
        if key_valid_for_shard is None:
            return None
        parts = [key_valid_for_shard(src * ulysses_degree + u) for u in range(ulysses_degree)]
        if any(p is None for p in parts):  # the layout has no padding and there is no user mask
            return None
        return jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]

    def attend(qh, kh, vh):
        out, _ = ring_attention(qh, kh, vh, ring_degree, keys_of_ring_member, RING_AXIS, **kernel_kwargs)
        return out

    return ulysses_attention(q, k, v, attend, ulysses_degree, ULYSSES_AXIS)
