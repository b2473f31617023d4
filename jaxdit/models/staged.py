"""The staged forward every model family implements: embed -> block stacks -> output.

A diffusion transformer here is a few named pieces (embed, block stacks, output) rather than one opaque
``__call__``, so that the code that reshapes the forward reuses the model's own pieces instead of
copying them:

- the plain sharded forward (``models/sharded_forward.py``) runs :func:`run_stacks` between ``embed``
  and ``output``;
- PipeFusion (arXiv 2405.14430) runs each stack's blocks on the stage that holds them, one patch at a
  time, and embeds / predicts on the first / last stage with the model's own pieces;
- feature caches (First-Block-Cache, TeaCache) run the first block, decide, and either run the rest or
  reuse a cached residual;
- LoRA only touches parameters, but finds them by the same stack names.

The contract (:class:`StagedTransformer`), in the local view of one shard (inside ``shard_map``):

- ``STACKS``: the names of the model's stacked block attributes, in the order a forward runs them.
  Each is an ``nnx`` module whose parameters carry a leading layer axis (or None when the model has no
  block of that kind); ``lax.scan`` runs them, so a program holds ONE block whatever the depth.
- ``FP8_KEEP`` (optional): dotted path parts of block layers that stay in the model's dtype under FP8
  (``jaxdit.models.quantize``): the layers the family knows to lose quality there.
- ``CACHE_FROM`` (optional): the stack whose first block is a feature cache's first block; the blocks of
  the stacks before it always run (Z-Image's refiners, outside the block list diffusers' cache hooks
  take). Without it the caches start at the first block of the forward.
- ``embed(inputs, ctx) -> (streams, cond)``: the residual stream(s) entering the first stack (a pytree
  of fp32 arrays, e.g. FLUX's ``(text, image)``) and what every block reads besides them (time
  modulation, RoPE angles, text context: a pytree computed once per step).
- ``enter(stack, streams, ctx) -> streams``: the streams as the blocks of ``stack`` take them (FLUX
  joins its text and image streams before the single blocks; identity elsewhere).
- ``run_block(stack, block, streams, cond, ctx) -> streams``: one block of ``stack``.
- ``output(streams, cond, ctx) -> prediction``: the model's head on the last stack's streams (named
  ``output`` because a family's parameters may already use ``head``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol

import jax
from flax import nnx

from jaxdit.parallel.context import ShardContext

__all__ = ["StagedTransformer", "run_stacks", "scan_blocks", "stack_gathers", "staged_forward"]

Streams = Any  # a pytree of [B, L, E] fp32 arrays
Cond = Any  # a pytree of per-step conditioning


class StagedTransformer(Protocol):
    """What a model family's transformer provides (see the module docstring)."""

    STACKS: ClassVar[tuple[str, ...]]

    def embed(self, inputs: dict[str, jax.Array], ctx: ShardContext) -> tuple[Streams, Cond]: ...

    def enter(self, stack: str, streams: Streams, ctx: ShardContext) -> Streams: ...

    def run_block(
        self, stack: str, block: nnx.Module, streams: Streams, cond: Cond, ctx: ShardContext
    ) -> Streams: ...

    def output(self, streams: Streams, cond: Cond, ctx: ShardContext) -> jax.Array: ...


def scan_blocks(
    blocks: nnx.Module,
    carry: Any,
    step: Callable[[nnx.Module, Any], Any],
    gathers: Mapping[str, tuple[int, tuple[str, ...]]] | None = None,
) -> Any:
    """Run stacked ``blocks`` in order with ``lax.scan``: the program holds ONE block, whatever the depth.

    ``gathers``: the fsdp-sharded parameters of one block and how to gather them
    (``jaxdit.parallel.fsdp``): each layer is then all-gathered one iteration ahead of its step."""
    graphdef, state = nnx.split(blocks)
    if gathers:
        from jaxdit.parallel.fsdp import gathered_scan

        return gathered_scan(graphdef, state, carry, step, gathers)

    def body(c, block_state):
        return step(nnx.merge(graphdef, block_state), c), None

    carry, _ = jax.lax.scan(body, carry, state)
    return carry


def stack_gathers(gathers: tuple, stack: str) -> dict[str, tuple[int, tuple[str, ...]]]:
    """One stack's fsdp gathers (``ShardContext.gathers``): keystr -> (dimension, axes); {} for none."""
    for name, items in gathers:
        if name == stack:
            return {k: (d, a) for k, d, a in items}
    return {}


def run_stacks(model: StagedTransformer, streams: Streams, cond: Cond, ctx: ShardContext) -> Streams:
    """Every stack of ``model`` in order, each entered as the model says and scanned block by block."""
    for name in model.STACKS:
        streams = model.enter(name, streams, ctx)
        stack = getattr(model, name)
        if stack is not None:
            streams = scan_blocks(
                stack,
                streams,
                lambda block, s, name=name: model.run_block(name, block, s, cond, ctx),
                stack_gathers(ctx.gathers, name),
            )
    return streams


def staged_forward(model: StagedTransformer, inputs: dict[str, jax.Array], ctx: ShardContext) -> jax.Array:
    """embed -> every stack -> output: the whole forward of one shard."""
    streams, cond = model.embed(inputs, ctx)
    return model.output(run_stacks(model, streams, cond, ctx), cond, ctx)
