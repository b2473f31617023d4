"""The block sequence of a staged transformer as positions 0..depth, across its stacks.

A cache cuts the forward into a head (blocks always computed: First-Block-Cache's block 0, DBCache's
first Fn), a middle (computed or reused) and a tail (DBCache's last Bn, always computed). The cuts may
fall anywhere, inside a stack or across the boundary between two (FLUX: 19 double blocks, then 38 single
blocks on the joined stream), so this module names a point of the forward by the number of blocks run
before it. The streams "at position p" have entered every stack that starts at or before p
(``model.enter``: FLUX joins text and image before its single blocks): a stack is entered when the
position reaches its first block, and an empty stack (None) is entered as its position is passed.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jaxdit.models.staged import scan_blocks, stack_gathers
from jaxdit.parallel.context import ShardContext

__all__ = ["advance", "carry", "depth", "first_block", "first_stack", "stack_ranges", "start"]


def _count(blocks: Any) -> int:
    return 0 if blocks is None else int(jax.tree.leaves(nnx.state(blocks))[0].shape[0])


def stack_ranges(model: Any) -> list[tuple[str, int, int]]:
    """(stack name, first position, end position) of every stack, in the forward's order."""
    ranges, position = [], 0
    for name in model.STACKS:
        n = _count(getattr(model, name))
        ranges.append((name, position, position + n))
        position += n
    return ranges


def depth(model: Any) -> int:
    """Blocks in one forward, every stack together."""
    return stack_ranges(model)[-1][2] if model.STACKS else 0


def first_stack(model: Any) -> str:
    """The first stack holding blocks."""
    for name, first, end in stack_ranges(model):
        if end > first:
            return name
    raise ValueError(f"{type(model).__name__} has no blocks to cache")


def _slice(blocks: nnx.Module, lo: int, hi: int) -> nnx.Module:
    """Blocks ``lo:hi`` of a stacked block module (the parameters' leading layer axis)."""
    graphdef, state = nnx.split(blocks)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[lo:hi], state))


def first_block(model: Any) -> nnx.Module:
    """The first block of the forward, as one (unstacked) block module."""
    graphdef, state = nnx.split(getattr(model, first_stack(model)))
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))


def start(model: Any, streams: Any, ctx: ShardContext) -> Any:
    """The embedded streams at position 0 (every stack starting there entered)."""
    for name, first, _ in stack_ranges(model):
        if first <= 0:
            streams = model.enter(name, streams, ctx)
    return streams


def advance(model: Any, streams: Any, p0: int, p1: int, cond: Any, ctx: ShardContext) -> Any:
    """The streams at position ``p0`` -> at ``p1``: blocks ``p0..p1-1`` run, stacks entered on the way."""
    for name, first, end in stack_ranges(model):
        if p0 < first <= p1:
            streams = model.enter(name, streams, ctx)
        lo, hi = max(first, p0), min(end, p1)
        if lo < hi:
            blocks = _slice(getattr(model, name), lo - first, hi - first)
            streams = scan_blocks(
                blocks,
                streams,
                lambda block, s, name=name: model.run_block(name, block, s, cond, ctx),
                stack_gathers(ctx.gathers, name),
            )
    return streams


def carry(model: Any, streams: Any, p0: int, p1: int, ctx: ShardContext) -> Any:
    """The streams at ``p0`` carried to ``p1`` through the stacks' ``enter`` alone (no block runs): what
    a residual of blocks ``p0..p1-1`` is added to."""
    for name, first, _ in stack_ranges(model):
        if p0 < first <= p1:
            streams = model.enter(name, streams, ctx)
    return streams
