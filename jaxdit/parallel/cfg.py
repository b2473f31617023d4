"""CFG parallel: the unconditional and conditional branches of classifier-free guidance on two devices.

The batch is laid out ``[unconditional; conditional]`` and split over the ``cfg`` axis, so each cfg
shard runs the model on one branch. Guidance needs both predictions: each shard sends its prediction to
the other (one collective-permute of one noise prediction per step, the only cfg communication) and
both compute ``uncond + scale * (cond - uncond)`` locally, so the guided result and the sampler state
stay replicated over cfg. With cfg=1 both halves live on every device and no communication happens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jaxdit.mesh import DeviceMesh, MeshLike

CFG_AXIS = "cfg"


def guidance(uncond: jax.Array, cond: jax.Array, scale) -> jax.Array:
    """Classifier-free guidance in fp32, returned in the predictions' dtype."""
    u = uncond.astype(jnp.float32)
    return (u + scale * (cond.astype(jnp.float32) - u)).astype(cond.dtype)


def interleave_branches(uncond: jax.Array, cond: jax.Array, data: int) -> jax.Array:
    """[B, ...] x 2 -> [2B, ...] ordered (data shard, branch, request): each (data, cfg) shard of the
    batch then holds one branch of its own requests, and with cfg=1 each data shard holds both."""
    if uncond.shape != cond.shape or uncond.shape[0] % data:
        raise ValueError(f"branches of shapes {uncond.shape}, {cond.shape} do not split over data={data}")
    per = uncond.shape[0] // data
    pairs = jnp.stack(
        [uncond.reshape(data, per, *uncond.shape[1:]), cond.reshape(data, per, *cond.shape[1:])], 1
    )
    return pairs.reshape(2 * uncond.shape[0], *uncond.shape[1:])


def renormalized(guided: jax.Array, cond: jax.Array, factor: float, seq_sharded: bool) -> jax.Array:
    """``guided`` scaled down per sample where its L2 norm exceeds ``factor`` x the conditional
    prediction's (CFG renormalisation, as diffusers' ``ZImagePipeline(cfg_normalization=...)``). The norms
    run over every non-batch element; with ``seq_sharded`` each device holds a slice of the tokens, so the
    squared sums are added over (ring, ulysses) (inside ``shard_map``). Padded tokens must be zero."""
    axes = tuple(range(1, guided.ndim))
    g, c = guided.astype(jnp.float32), cond.astype(jnp.float32)
    sums = jnp.stack([jnp.sum(g * g, axis=axes), jnp.sum(c * c, axis=axes)])
    if seq_sharded:
        sums = lax.psum(sums, ("ring", "ulysses"))
    new, limit = jnp.sqrt(sums[0]), factor * jnp.sqrt(sums[1])
    ratio = jnp.where(new > limit, limit / jnp.where(new > 0, new, 1.0), 1.0)
    return (g * ratio.reshape(-1, *(1,) * len(axes))).astype(guided.dtype)


def combine_branches(
    prediction: jax.Array, scale, mesh: MeshLike, *, seq_sharded: bool = False, renorm: float = 0.0
) -> jax.Array:
    """Predictions laid out by :func:`interleave_branches`, batch over (data, cfg) -> guided [B, ...].

    The output batch is split over data only (replicated over cfg). ``seq_sharded``: axis 1 is a token
    axis in the model's padded shard layout, split over (ring, ulysses); it stays where it is.
    ``renorm`` > 0: the guided prediction's norm is capped at ``renorm`` x the conditional one's
    (:func:`renormalized`; the predictions of padded tokens must be zero).
    """
    where = DeviceMesh.of(mesh)  # a DeviceMesh passes through; a plain mesh gives its degrees
    mesh, config = where.mesh, where.parallel
    if renorm > 0:
        plain = guidance

        def guidance_fn(uncond, cond, scale):
            return renormalized(plain(uncond, cond, scale), cond, renorm, seq_sharded)
    else:
        guidance_fn = guidance
    if prediction.shape[0] % (2 * config.data):
        raise ValueError(f"CFG batch {prediction.shape[0]} is not 2 x a multiple of data={config.data}")
    rest = (
        (("ring", "ulysses"),) + (None,) * (prediction.ndim - 2)
        if seq_sharded
        else (None,) * (prediction.ndim - 1)
    )

    if config.cfg == 1:

        def local(pred, scale):
            # This data shard holds its own [uncond; cond] pair: split locally, nothing moves.
            uncond, cond = jnp.split(pred, 2, axis=0)
            return guidance_fn(uncond, cond, scale)

        in_spec = PartitionSpec("data", *rest)
    else:

        def local(pred, scale):
            other = lax.ppermute(pred, CFG_AXIS, [(0, 1), (1, 0)])
            is_cond = lax.axis_index(CFG_AXIS) == 1
            return guidance_fn(jnp.where(is_cond, other, pred), jnp.where(is_cond, pred, other), scale)

        in_spec = PartitionSpec(("data", CFG_AXIS), *rest)

    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(in_spec, PartitionSpec()),
        out_specs=PartitionSpec("data", *rest),
        check_vma=False,
    )
    return fn(prediction, jnp.asarray(scale, jnp.float32))


def replicate_branches(x: jax.Array, mesh: MeshLike, *, seq_sharded: bool = False) -> jax.Array:
    """Latents [B, ...] (requests over data, replicated over cfg) -> the model batch [2B, ...] in
    :func:`interleave_branches`' order, batch over (data, cfg), without communication.

    Both branches denoise the same latents, so every device already holds the rows its branch needs: a
    cfg shard passes its rows on as they are; with cfg=1 each device stacks them twice. Written as a
    ``shard_map`` because XLA's partitioner, given the global stack of the latents with themselves, moves
    them with all-to-alls over cfg instead (measured: three per step).
    """
    where = DeviceMesh.of(mesh)  # a DeviceMesh passes through; a plain mesh gives its degrees
    mesh, config = where.mesh, where.parallel
    seq = (("ring", "ulysses"),) if seq_sharded else ()
    rest = seq + (None,) * (x.ndim - 1 - len(seq))
    local = (lambda t: t) if config.cfg == 2 else (lambda t: jnp.concatenate([t, t], axis=0))
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=PartitionSpec("data", *rest),
        out_specs=PartitionSpec(("data", CFG_AXIS), *rest),
        check_vma=False,
    )(x)
