"""From a model's logical parameter axes to PartitionSpecs, NamedShardings and sharded placement."""

from __future__ import annotations

from collections.abc import Mapping

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdit.parallel.fsdp import shard_rest, shard_stacks
from sharding_rules import logical_to_spec
from sharding_rules.parameter_axes import logical_axes


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def partition_specs(state: nnx.State, rules: Mapping[str, object]):
    """A pytree (like ``state``) of PartitionSpecs from each parameter's logical axes."""
    return jax.tree.map(
        lambda v: v.replace(logical_to_spec(logical_axes(v), rules)) if _is_var(v) else PartitionSpec(),
        state,
        is_leaf=_is_var,
    )


def named_shardings(state: nnx.State, rules: Mapping[str, object], mesh: Mesh, parallel=None):
    """NamedShardings (how the parameters are stored) from the rule table; with ``parallel`` (a
    ParallelConfig) whose ``fsdp`` is set, the stacked blocks' weights also split over the fsdp axes, and
    the other weights stored split too, gathered whole once per step (``jaxdit.parallel.fsdp``)."""
    specs = partition_specs(state, rules)
    if parallel is not None and parallel.fsdp:
        specs, _ = shard_stacks(state, specs, parallel)
        specs = shard_rest(state, specs, parallel)
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def parameter_shapes(model: nnx.Module) -> dict[str, tuple[int, ...]]:
    """Dotted parameter path -> shape (stacked blocks with their leading layer axis); works on abstract models."""
    state = nnx.state(model, nnx.Param)
    return {".".join(map(str, path)): tuple(v.shape) for path, v in nnx.to_flat_state(state)}
