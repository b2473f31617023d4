"""FP8 weights in the cost model: what a block of each stack saves per device with its linear layers in
FP8 (``jaxdit.models.quantize``), counted from the family's abstract model under the configuration's
rule table, so the planner, the memory guard and the compiled programs price the same parameters."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxdit.models.partitioning import logical_axes
from jaxdit.models.quantize import fp8_layers, quantize_model
from sharding_rules import logical_to_spec, rules_for

__all__ = ["fp8_block_saving"]


def _local_bytes(variable: nnx.Variable, rules: Any, tensor: int) -> int:
    """Bytes one device holds of ``variable`` (only ``tensor`` splits weights on an FP8 mesh)."""
    value = variable.get_value()
    spec = logical_to_spec(logical_axes(variable), rules)
    shape = list(value.shape)
    for axis, entry in enumerate(tuple(spec)):
        names = entry if isinstance(entry, tuple) else (entry,)
        if "tensor" in names:
            shape[axis] //= tensor
    return math.prod(shape) * jnp.dtype(value.dtype).itemsize


def _stack_bytes(model: Any, rules: Any, tensor: int) -> tuple[int, ...]:
    out = []
    for name in model.STACKS:
        stack = getattr(model, name)
        state = nnx.state(stack, nnx.Param) if stack is not None else None
        leaves = [v for _, v in nnx.to_flat_state(state)] if state is not None else []
        out.append(sum(_local_bytes(v, rules, tensor) for v in leaves))
    return tuple(out)


@functools.cache
def fp8_block_saving(family: Any, config: Any, dtype: str, tensor: int) -> tuple[int, ...]:
    """Bytes per device one block of each stack (``STACKS`` order) holds less with FP8 weights."""
    rules = rules_for(tensor=tensor)
    plain = family.checkpoints.abstract_model(config, jnp.dtype(dtype))
    before = _stack_bytes(plain, rules, tensor)
    quantized = family.checkpoints.abstract_model(config, jnp.dtype(dtype))
    if not any(True for _ in fp8_layers(quantized)):
        return (0,) * len(before)
    quantize_model(quantized, "weight")
    after = _stack_bytes(quantized, rules, tensor)
    depths = family.stack_depths(config)
    return tuple((b - a) // d if d else 0 for b, a, d in zip(before, after, depths, strict=True))
