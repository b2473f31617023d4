"""fsdp in the cost model: what each block stack holds per device and what its per-layer all-gathers move
(``jaxdit.parallel.fsdp``), read off the family's abstract model with the same ``shard_stacks`` the
sharded forward uses, so the planner, the memory guard and the compiled programs price the same bytes.

Per stack and per block: the bytes a device keeps (the parameters fsdp splits hold 1/ways of their
tensor-split shard; one whose dimensions the axes do not divide stays whole), the bytes of one gathered
layer (what tensor parallelism alone would hold), and the all-gathers of one layer grouped by operand
(elements, dtype, group size): ``gathered_scan`` gathers every split parameter once per layer plus once
more for the prefetch of layer 0, i.e. ``n + 1`` times per stack of ``n`` layers and forward.
PipeFusion's stage layout splits the layer axis over ``pipefusion``; a block's other dimensions are
split as on a plain mesh, so a stage's blocks are priced from the plain model without that axis.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdit.mesh import ParallelConfig
from jaxdit.models.partitioning import logical_axes, partition_specs
from jaxdit.parallel.fsdp import shard_stacks
from sharding_rules import rules_for

__all__ = ["StackFsdp", "fsdp_stacks"]


@dataclasses.dataclass(frozen=True)
class StackFsdp:
    """One stack's blocks under fsdp, per device: ``resident`` bytes a block keeps, ``gathered`` bytes
    of one gathered block, ``gathers``: ((elements, dtype, group), parameters of that operand) of one
    layer's all-gathers."""

    resident: int
    gathered: int
    gathers: tuple[tuple[tuple[int, str, int], int], ...]


def _split(spec: Any, ndim: int) -> list[tuple[str, ...]]:
    out = []
    for i in range(ndim):
        p = spec[i] if i < len(spec) else None
        out.append(() if p is None else (p,) if isinstance(p, str) else tuple(p))
    return out


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


@functools.cache
def fsdp_stacks(family: Any, model_config: Any, dtype: str, fp8: bool, config: ParallelConfig):
    """Per stack (``STACKS`` order): a :class:`StackFsdp`, or None for a stack of no blocks."""
    plain = dataclasses.replace(config, pipefusion=1)  # a stage's blocks split as a plain mesh's
    degrees = plain.degrees
    model = family.checkpoints.abstract_model(model_config, jnp.dtype(dtype))
    if fp8:
        from jaxdit.models.quantize import quantize_model

        quantize_model(model, "weight")
    state = nnx.split(model)[1]
    specs = partition_specs(state, rules_for(tensor=plain.tensor))
    sharded, _ = shard_stacks(state, specs, plain)
    flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_var)
    before = jax.tree_util.tree_leaves(specs, is_leaf=_is_var)
    after = jax.tree_util.tree_leaves(sharded, is_leaf=_is_var)
    stacks: dict[str, dict[str, Any]] = {}
    for (path, var), old, new in zip(flat, before, after, strict=True):
        if logical_axes(var)[0] != "layers":
            continue
        stack = str(path[0].key if hasattr(path[0], "key") else path[0])
        entry = stacks.setdefault(stack, {"resident": 0, "gathered": 0, "gathers": {}, "layers": 0})
        shape, item = tuple(var.shape), jnp.dtype(var.dtype).itemsize
        entry["layers"] = shape[0]

        def local(spec, shape=shape):
            parts = _split(spec.get_value(), len(shape))
            return [s // math.prod(degrees[a] for a in p) for s, p in zip(shape, parts, strict=True)]

        whole, mine = local(old), local(new)
        per_layer = math.prod(whole[1:]) * item
        entry["gathered"] += per_layer
        entry["resident"] += math.prod(mine[1:]) * item
        group = math.prod(whole) // math.prod(mine)
        if group > 1:
            key = (math.prod(mine[1:]), jnp.dtype(var.dtype).name, group)
            entry["gathers"][key] = entry["gathers"].get(key, 0) + 1
    out = []
    for name in model.STACKS:
        e = stacks.get(name)
        if e is None or not e["layers"]:
            out.append(None)
            continue
        out.append(StackFsdp(e["resident"], e["gathered"], tuple(sorted(e["gathers"].items()))))
    return tuple(out)
