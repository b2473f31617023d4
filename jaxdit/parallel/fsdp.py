"""Weight sharding of the stacked blocks (``ParallelConfig(fsdp=...)``, ``--fsdp``), gathered per layer.

Sequence, CFG and data parallelism keep every weight on every device; only tensor parallelism and
PipeFusion split them. With ``fsdp`` every parameter of a block stack (a leading "layers" axis) is
additionally split over the fsdp mesh axes along one of its other dimensions, so a device holds 1/P of
each block. Inside the scan over a stack, the next layer's weights are all-gathered while the current
layer runs, and each gathered layer is dropped after its step:

- the scan's carry holds the current layer's gathered weights; the body starts the gather of layer
  ``i + 1`` (an ``all_gather`` that does not depend on the block's compute), then runs layer ``i``.
  Gather and compute are independent within one iteration, so XLA's latency-hiding scheduler runs the
  gather (``all-gather-start`` ... ``all-gather-done`` on GPU) under the block's matmuls: an explicit
  prefetch rather than relying on the compiler's collective pipeliner. The last iteration gathers
  layer 0 again (discarded): one extra layer gathered per stack and forward, so a stack of ``n``
  layers gathers ``n + 1`` times. Two gathered layers are live at once;
- ``all_gather`` only moves bytes, so the result is bit-identical to the unsharded step;
- the parameters outside the stacks (embedders, modulation projections, head) are stored split too
  (:func:`shard_rest`, storage shardings only): the step's ``shard_map`` takes them whole, so the jitted
  step gathers each once per call, before its body.

Which axes: by default every mesh axis but ``data`` and ``cfg`` whose degree is > 1 (the gathers run
over the same links as Ulysses' all-to-alls); per parameter, axes its own spec already uses (``tensor``
on a tensor-split weight, ``pipefusion`` on PipeFusion's layer axis) are left out, so under PipeFusion a
stage's own layers are sharded over the non-pipefusion axes. The dimension: the largest non-layer one
whose local size the axes divide; a parameter with none (a tiny norm scale) stays as it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec

from jaxdit.mesh import ParallelConfig
from sharding_rules.parameter_axes import logical_axes

__all__ = ["DEFAULT_EXCLUDED", "Gathers", "fsdp_axes", "gathered_scan", "shard_rest", "shard_stacks"]

#: Axes fsdp leaves alone by default: each data / cfg shard runs a different request or branch.
DEFAULT_EXCLUDED = ("data", "cfg")

#: Per stack name: ((keystr of a block parameter, dimension, gather axes), ...); hashable, static.
Gathers = tuple[tuple[str, tuple[tuple[str, int, tuple[str, ...]], ...]], ...]


def fsdp_axes(config: ParallelConfig) -> tuple[str, ...]:
    """The mesh axes (degree > 1) the stacked weights are split over; () without fsdp."""
    if not config.fsdp:
        return ()
    degrees = config.degrees
    chosen = [a for a in degrees if a not in DEFAULT_EXCLUDED] if config.fsdp is True else config.fsdp
    return tuple(a for a in degrees if a in chosen and degrees[a] > 1)


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _parts(spec: PartitionSpec, ndim: int) -> list[tuple[str, ...]]:
    out = []
    for i in range(ndim):
        p = spec[i] if i < len(spec) else None
        out.append(() if p is None else (p,) if isinstance(p, str) else tuple(p))
    return out


def shard_stacks(state: nnx.State, specs: Any, config: ParallelConfig) -> tuple[Any, Gathers]:
    """``specs`` (from ``partition_specs``) with every stacked parameter also split over the fsdp axes,
    and the gathers the scan must do. Unchanged specs and no gathers without fsdp."""
    axes = fsdp_axes(config)
    if not axes:
        return specs, ()
    degrees = config.degrees
    flat_state, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_var)
    flat_specs, spec_def = jax.tree_util.tree_flatten(specs, is_leaf=_is_var)
    new_specs, gathers = [], {}
    for (path, var), spec_var in zip(flat_state, flat_specs, strict=True):
        names = logical_axes(var)
        spec = spec_var.get_value()
        if names[0] != "layers":
            new_specs.append(spec_var)
            continue
        shape = tuple(var.shape)
        parts = _parts(spec, len(shape))
        used = {a for p in parts for a in p}
        free = tuple(a for a in axes if a not in used)
        ways = math.prod(degrees[a] for a in free)
        local = [shape[d] // math.prod(degrees[a] for a in parts[d]) for d in range(len(shape))]
        dims = sorted(range(1, len(shape)), key=lambda d: -local[d])
        dim = next((d for d in dims if free and local[d] % ways == 0), None)
        if dim is None:
            new_specs.append(spec_var)
            continue
        parts[dim] = parts[dim] + free
        new = [None if not p else p[0] if len(p) == 1 else p for p in parts]
        new_specs.append(spec_var.replace(PartitionSpec(*new)))
        stack = str(path[0].key if hasattr(path[0], "key") else path[0])
        gathers.setdefault(stack, []).append((jax.tree_util.keystr(path[1:]), dim, free))
    out = jax.tree_util.tree_unflatten(spec_def, new_specs)
    return out, tuple((k, tuple(v)) for k, v in gathers.items())


def _split_dim(shape: tuple[int, ...], parts: list[tuple[str, ...]], free, degrees, first: int) -> int | None:
    """The largest dimension from ``first`` on whose local size the ``free`` axes divide, or None."""
    ways = math.prod(degrees[a] for a in free)
    local = [shape[d] // math.prod(degrees[a] for a in parts[d]) for d in range(len(shape))]
    dims = sorted(range(first, len(shape)), key=lambda d: -local[d])
    return next((d for d in dims if free and local[d] % ways == 0), None)


def shard_rest(state: nnx.State, specs: Any, config: ParallelConfig) -> Any:
    """Storage specs for the parameters outside the block stacks under fsdp: each split over the fsdp
    axes its spec does not use, along its largest dimension they divide (a parameter with none stays
    whole). Only how they are stored: the step's ``shard_map`` still takes them whole, so the jitted
    step all-gathers each once per call before its body runs (XLA's resharding of the arguments), and
    they are used where they always were (embedders, modulation, head). ``specs``: from
    :func:`shard_stacks` (stacked parameters are left as they are)."""
    axes = fsdp_axes(config)
    if not axes:
        return specs
    degrees = config.degrees
    flat_state, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_var)
    flat_specs, spec_def = jax.tree_util.tree_flatten(specs, is_leaf=_is_var)
    out = []
    for (_, var), spec_var in zip(flat_state, flat_specs, strict=True):
        shape = tuple(var.shape)
        if logical_axes(var)[0] == "layers" or not shape:
            out.append(spec_var)
            continue
        parts = _parts(spec_var.get_value(), len(shape))
        used = {a for p in parts for a in p}
        free = tuple(a for a in axes if a not in used)
        dim = _split_dim(shape, parts, free, degrees, 0)
        if dim is None:
            out.append(spec_var)
            continue
        parts[dim] = parts[dim] + free
        out.append(
            spec_var.replace(PartitionSpec(*[None if not p else p[0] if len(p) == 1 else p for p in parts]))
        )
    return jax.tree_util.tree_unflatten(spec_def, out)


def _gather_layer(layer: nnx.State, gathers: Mapping[str, tuple[int, tuple[str, ...]]]) -> nnx.State:
    flat, treedef = jax.tree_util.tree_flatten_with_path(layer, is_leaf=_is_var)
    out = []
    for path, var in flat:
        how = gathers.get(jax.tree_util.keystr(path))
        if how is None:
            out.append(var)
            continue
        dim, axes = how  # the layer axis is gone here: the parameter's dim d is the slice's d - 1
        out.append(var.replace(lax.all_gather(var.get_value(), axes, axis=dim - 1, tiled=True)))
    return jax.tree_util.tree_unflatten(treedef, out)


def gathered_scan(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    carry: Any,
    step: Callable[..., Any],
    gathers: Mapping[str, tuple[int, tuple[str, ...]]],
    xs: Any = None,
) -> Any:
    """``lax.scan`` over the stacked ``state`` with each layer all-gathered one iteration ahead (see the
    module docstring). Without ``xs``: ``step(block, carry) -> carry``, returns the carry. With ``xs``
    (scanned alongside the layers): ``step(block, carry, x) -> (carry, y)``, returns ``(carry, ys)``."""
    n = jax.tree.leaves(state)[0].shape[0]

    def layer(i):
        sliced = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, 0, keepdims=False), state)
        return _gather_layer(sliced, gathers)

    def body(c, scanned):
        i, x = scanned
        c, current = c
        upcoming = layer((i + 1) % n)  # independent of this layer's compute: overlaps it
        block = nnx.merge(graphdef, current)
        if xs is None:
            return (step(block, c), upcoming), None
        c, y = step(block, c, x)
        return (c, upcoming), y

    index = jnp.arange(n, dtype=jnp.int32)
    (carry, _), ys = lax.scan(body, (carry, layer(jnp.int32(0))), (index, xs))
    return carry if xs is None else (carry, ys)
