"""fsdp in the cost model: what each block stack holds per device and what its per-layer all-gathers move
(``jaxdit.parallel.fsdp``), read off the family's abstract model with the same ``shard_stacks`` the
sharded forward uses, so the planner, the memory guard and the compiled programs price the same bytes.

Per stack and per block: the bytes a device keeps (the parameters fsdp splits hold 1/ways of their
tensor-split shard; one whose dimensions the axes do not divide stays whole), the bytes of one gathered
layer (what tensor parallelism alone would hold), and the all-gathers of one layer grouped by operand
(elements, dtype, group size): ``gathered_scan`` gathers every split parameter once per layer plus once
more for the prefetch of layer 0, i.e. ``n + 1`` times per stack of ``n`` layers and forward.
PipeFusion's stage layout splits the layer axis over ``pipefusion``; a block's other dimensions are
split as on a plain mesh, so a stage's blocks are priced from the plain model without that axis. The
weights outside the stacks (embedders, modulation, head) are stored split the same way and gathered
whole once per compiled step (``shard_rest``).
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
from jaxdit.parallel.fsdp import shard_rest, shard_stacks
from sharding_rules import rules_for

__all__ = ["StackFsdp", "fsdp_rest", "fsdp_stacks"]


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


def _local(spec: Any, shape: tuple[int, ...], degrees: dict[str, int]) -> list[int]:
    parts = _split(spec, len(shape))
    return [s // math.prod(degrees[a] for a in p) for s, p in zip(shape, parts, strict=True)]


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def fsdp_stacks(family: Any, model_config: Any, dtype: str, fp8: bool, config: ParallelConfig):
    """Per stack (``STACKS`` order): a :class:`StackFsdp`, or None for a stack of no blocks."""
    return _fsdp(family, model_config, dtype, fp8, config)[0]


def fsdp_rest(family: Any, model_config: Any, dtype: str, fp8: bool, config: ParallelConfig) -> StackFsdp:
    """The parameters outside the stacks (``shard_rest``): stored split, gathered whole once per step
    (``resident``: their bytes per device, ``gathered``: whole)."""
    return _fsdp(family, model_config, dtype, fp8, config)[1]


@functools.cache
def _fsdp(family: Any, model_config: Any, dtype: str, fp8: bool, config: ParallelConfig):
    plain = dataclasses.replace(config, pipefusion=1)  # a stage's blocks split as a plain mesh's
    degrees = plain.degrees
    model = family.checkpoints.abstract_model(model_config, jnp.dtype(dtype))
    if fp8:
        from jaxdit.models.quantize import quantize_model

        quantize_model(model, "weight")
    state = nnx.split(model)[1]
    specs = partition_specs(state, rules_for(tensor=plain.tensor))
    sharded, _ = shard_stacks(state, specs, plain)
    # Outside the stacks nothing uses the pipefusion axis: those weights split over it as well.
    stored = shard_rest(state, sharded, config)
    flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_var)
    before = jax.tree_util.tree_leaves(specs, is_leaf=_is_var)
    after = jax.tree_util.tree_leaves(sharded, is_leaf=_is_var)
    kept = jax.tree_util.tree_leaves(stored, is_leaf=_is_var)
    stacks: dict[str, dict[str, Any]] = {}
    rest = {"resident": 0, "gathered": 0, "gathers": {}, "layers": 1}
    for (path, var), old, new, store in zip(flat, before, after, kept, strict=True):
        if logical_axes(var)[0] != "layers":
            shape, item = tuple(var.shape), jnp.dtype(var.dtype).itemsize
            whole = _local(old.get_value(), shape, config.degrees)
            mine = _local(store.get_value(), shape, config.degrees)
            rest["gathered"] += math.prod(whole) * item
            rest["resident"] += math.prod(mine) * item
            group = math.prod(whole) // math.prod(mine)
            if group > 1:
                key = (math.prod(mine), jnp.dtype(var.dtype).name, group)
                rest["gathers"][key] = rest["gathers"].get(key, 0) + 1
            continue
        stack = str(path[0].key if hasattr(path[0], "key") else path[0])
        entry = stacks.setdefault(stack, {"resident": 0, "gathered": 0, "gathers": {}, "layers": 0})
        shape, item = tuple(var.shape), jnp.dtype(var.dtype).itemsize
        entry["layers"] = shape[0]

        whole = _local(old.get_value(), shape, degrees)
        mine = _local(new.get_value(), shape, degrees)
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
    return tuple(out), StackFsdp(rest["resident"], rest["gathered"], tuple(sorted(rest["gathers"].items())))
