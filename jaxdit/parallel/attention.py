"""Parallel attention, chosen from the mesh: the one entry point models and users call.

Two views of the same operation:

* :func:`attention_in_shard` runs inside ``shard_map`` (models call it on their local tokens). It picks
  the strategy from the degrees: USP when ring and ulysses are both > 1, Ring or Ulysses when one is,
  the local kernel when neither. Heads may additionally be split over ``tensor`` by the caller's specs.
* :func:`parallel_attention` takes global arrays, one or several token groups, pads them to the shard
  layout, runs :func:`attention_in_shard` under ``shard_map`` and returns global outputs.

Communication is exactly the design's: Ulysses' four all_to_alls and Ring's R-1 permutes of K and V.
A key mask per batch element (real prompt lengths) adds one small all-gather of booleans per forward;
padding alone needs none (it is a static function of the layout).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxdit.mesh import DeviceMesh, MeshLike, ParallelConfig
from jaxdit.parallel.layout import SequenceLayout
from jaxdit.parallel.usp import usp_attention
from sharding_rules import ACTIVATIONS, logical_to_spec

SEQ_AXES = ("ring", "ulysses")

#: Logical layout of q, k, v and the output: [batch, seq, heads, head_dim].
QKV_AXES = ("batch", "seq", "act_heads", None)


def gather_key_mask(key_mask: jax.Array | None, layout: SequenceLayout) -> jax.Array | None:
    """This shard's key mask [B, n] -> every shard's [B, S*n] in shard order (ring outer), or None.

    The one key mask attention uses: the layout's padding is False in it as well as the caller's masked
    keys (a caller pads its mask with False, and the padding is cleared here too, so a mask that says True
    at padding cannot unmask it). Inside ``shard_map``; one small all-gather of booleans over the sequence
    axes, once per forward (``ShardContext.with_key_mask``), not per layer. None when there is no caller
    mask: attention then takes the padding from the static layout, with no communication.
    """
    if key_mask is None:
        return None
    if key_mask.ndim != 2 or key_mask.shape[1] != layout.local_length:
        raise ValueError(f"key mask has shape {key_mask.shape}; expected [batch, {layout.local_length}]")
    if layout.shards == 1:
        mask = key_mask.astype(bool)
    else:
        mask = lax.all_gather(key_mask.astype(bool), SEQ_AXES, axis=1, tiled=True)
    if layout.has_padding():
        mask = mask & layout.all_keys_valid()[None]
    return mask


def attention_in_shard(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layout: SequenceLayout,
    config: ParallelConfig,
    key_mask: jax.Array | None = None,
    *,
    all_keys: jax.Array | None = None,
    **kernel_kwargs,
) -> jax.Array:
    """Local view. q/k/v [B, n, H_local, D] are this shard's joined token groups (``layout``).

    ``key_mask`` [B, n] (optional) marks this shard's real keys beyond the layout's padding, per batch
    element (e.g. each prompt's real length). ``all_keys`` [B, S*n] is the same mask already gathered over
    the shards (:func:`gather_key_mask`): what a model's :class:`ShardContext` holds, so that the gather
    happens once per forward. Pass at most one of the two.
    """
    if layout.shards != config.sequence_degree:
        raise ValueError(f"layout has {layout.shards} shards but ring x ulysses = {config.sequence_degree}")
    if q.shape[1] != layout.local_length:
        raise ValueError(f"local q has {q.shape[1]} tokens, layout expects {layout.local_length}")
    if key_mask is not None and all_keys is not None:
        raise ValueError("pass key_mask (this shard's) or all_keys (gathered), not both")
    batch = q.shape[0]
    n = layout.local_length
    if all_keys is None:
        all_keys = gather_key_mask(key_mask, layout)
    elif all_keys.shape != (batch, layout.shards * n):
        raise ValueError(
            f"gathered key mask has shape {all_keys.shape}; expected {(batch, layout.shards * n)}"
        )

    def key_valid_for_shard(shard):
        # One mask: the gathered one already holds the padding; without it, the static layout's padding.
        if all_keys is not None:
            return lax.dynamic_slice_in_dim(all_keys, shard * n, n, axis=1)
        if layout.has_padding():
            return jnp.broadcast_to(layout.key_valid(shard), (batch, n))
        return None

    return usp_attention(
        q,
        k,
        v,
        ring_degree=config.ring,
        ulysses_degree=config.ulysses,
        key_valid_for_shard=key_valid_for_shard,
        **kernel_kwargs,
    )


def sharded_attention(mesh: MeshLike, layout: SequenceLayout, *, with_mask: bool = False, **kernel_kwargs):
    """``shard_map`` of :func:`attention_in_shard` over token groups already padded to ``layout``.

    Call it as ``fn(qs, ks, vs[, masks])`` with tuples of global padded arrays [B, padded_len, H, D]
    (and [B, padded_len] masks); returns a tuple of padded outputs. This is the whole communication of
    parallel attention; padding and unpadding are the caller's (a model pads once per step).
    """
    where = DeviceMesh.of(mesh)  # a DeviceMesh passes through; a plain mesh gives its degrees
    mesh, config = where.mesh, where.parallel
    qkv_spec = logical_to_spec(QKV_AXES, ACTIVATIONS)
    mask_spec = logical_to_spec(("batch", "seq"), ACTIVATIONS)
    group_specs = (qkv_spec,) * len(layout.lengths)

    def local(qs, ks, vs, *masks):
        mask = layout.join_local(masks) if masks else None
        join = layout.join_local
        out = attention_in_shard(join(qs), join(ks), join(vs), layout, config, mask, **kernel_kwargs)
        return tuple(layout.split_local(out))

    in_specs = (group_specs,) * 3 + ((mask_spec,) * len(layout.lengths) if with_mask else ())
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=group_specs, check_vma=False)


def _as_groups(x):
    return (tuple(x), True) if isinstance(x, list | tuple) else ((x,), False)


def parallel_attention(
    q: jax.Array | Sequence[jax.Array],
    k: jax.Array | Sequence[jax.Array],
    v: jax.Array | Sequence[jax.Array],
    mesh: MeshLike,
    *,
    key_mask: jax.Array | Sequence[jax.Array | None] | None = None,
    **kernel_kwargs,
):
    """Global view: softmax attention of q over k/v of shape [batch, seq, heads, head_dim].

    q, k, v may each be a tuple of token groups (e.g. FLUX's text and image tokens) with equal batch,
    heads and head_dim; the groups are attended jointly, as if concatenated along seq, but are joined
    per shard only. Any lengths work (padding + key mask; exact). The batch is split over (data, cfg),
    the sequence over (ring, ulysses) and heads over tensor. Returns the output in the same structure.

    Lengths the degrees do not divide are padded here and the padding is sliced off the sharded output,
    which XLA does by moving data (an all-gather at the edges). Models avoid it by keeping the padded
    layout for the whole step (see :func:`sharded_attention`).
    """
    qs, grouped = _as_groups(q)
    ks, _ = _as_groups(k)
    vs, _ = _as_groups(v)
    if not (len(qs) == len(ks) == len(vs)):
        raise ValueError(f"q, k, v have {len(qs)}, {len(ks)}, {len(vs)} token groups; they must match")
    for i, (a, b, c) in enumerate(zip(qs, ks, vs, strict=True)):
        if a.ndim != 4 or a.shape != b.shape or a.shape != c.shape:
            raise ValueError(
                f"token group {i}: q, k, v must share one shape [batch, seq, heads, head_dim] "
                f"(self-attention); got {a.shape}, {b.shape}, {c.shape}"
            )
        if a.shape[0] != qs[0].shape[0] or a.shape[2:] != qs[0].shape[2:]:
            raise ValueError(f"token group {i} has shape {a.shape}, group 0 has {qs[0].shape}")
    masks = (None,) * len(qs) if key_mask is None else _as_groups(key_mask)[0]
    if len(masks) != len(qs):
        raise ValueError(f"{len(masks)} key masks for {len(qs)} token groups")

    where = DeviceMesh.of(mesh)  # a DeviceMesh passes through; a plain mesh gives its degrees
    mesh, config = where.mesh, where.parallel
    batch, _, heads, _ = qs[0].shape
    config.validate_heads(heads)
    if batch % (config.data * config.cfg):
        raise ValueError(f"batch {batch} does not split over data={config.data} x cfg={config.cfg}")
    layout = SequenceLayout(tuple(a.shape[1] for a in qs), config.sequence_degree)

    use_mask = any(m is not None for m in masks)
    if use_mask:
        masks = tuple(
            jnp.ones(a.shape[:2], bool) if m is None else jnp.asarray(m, bool)
            for a, m in zip(qs, masks, strict=True)
        )
        masks = tuple(layout.pad(m, g, value=False) for g, m in enumerate(masks))
    pad = lambda xs: tuple(layout.pad(x, g) for g, x in enumerate(xs))
    qs, ks, vs = pad(qs), pad(ks), pad(vs)

    sharded = sharded_attention(where, layout, with_mask=use_mask, **kernel_kwargs)
    outs = sharded(qs, ks, vs, *(masks if use_mask else ()))
    outs = tuple(layout.unpad(o, g) for g, o in enumerate(outs))
    return outs if grouped else outs[0]
