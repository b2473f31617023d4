"""A feature cache inside the sharded forward: one decision for the whole mesh, one compiled step.

:class:`CachedForward` turns a model's staged forward (``jaxdit.models.staged``) into a forward with a
cache state carried from step to step, built on :meth:`ShardedForward.carry_step` (the same
``shard_map`` as the plain forward, with the state going in and out). Inside it, in the local view of
one device:

1. ``embed``, then the first stack is entered. First-Block-Cache runs block 0 and takes its residual on
   the model's metric stream (``model.cache_metric_stream``: FLUX's image tokens, Wan's video tokens);
   TeaCache takes the model's metric input (``model.teacache_input``: FLUX's block-0 modulated image
   input) or, when the model's metric depends on the schedule only (``model.teacache_timestep_input``:
   Wan's timestep embedding), nothing: the host planned the step.
2. The metric's numerator and denominator are summed over this device's real tokens (padding masked
   with ``ShardContext.token_valid``) and all-reduced over EVERY mesh axis, as two scalars in one
   ``psum``. Every axis whose devices share the step's collectives must agree (ring, ulysses and tensor
   share attention and the row-parallel sums; cfg shares the guidance exchange); data is included too,
   so that a batch takes the decision one device holding the whole batch would take (diffusers' hook
   also averages over the batch), which makes the result, decisions included, the same on every mesh.
   After the ``psum`` every device holds the same two numbers, hence the same decision.
3. ONE ``lax.cond`` on that decision: the "run" branch runs the remaining blocks of every stack, entering
   each stack as the model says (FLUX joins its text and image streams before the single blocks), and
   stores their residual ``final streams - the start streams carried through the same enter
   transitions``; the "skip" branch carries the start streams through the transitions and adds the stored
   residual. The skip branch holds no collective; the run branch holds the model's. The residual covers
   every final stream (FLUX: the joined text + image stream), as ``output`` needs them.
4. ``output`` (the head) runs on the result.

The state (:func:`init_state`) is a dict of arrays that stays on the devices for the whole loop and is
donated to each step: the residual (laid out like the final streams: batch over (data, cfg), tokens over
(ring, ulysses)), the reference of the metric (laid out like the metric stream), replicated scalars (the
step counter, TeaCache's accumulator, the host plan of :mod:`jaxdit.cache.policies`) and two records
sharded over every mesh axis, one row per device: the decision each device took and the ratio it saw.
Reading the records back (:func:`read_report`) shows whether all devices decided alike.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxdit.cache.policies import (
    RUN,
    FirstBlockCache,
    TeaCache,
    first_block_decision,
    host_plan,
    teacache_decision,
    teacache_pattern,
)
from jaxdit.cache.report import CacheReport
from jaxdit.mesh import MESH_AXES
from jaxdit.models.sharded_forward import ShardedForward
from jaxdit.models.staged import scan_blocks
from jaxdit.parallel.context import ShardContext
from jaxdit.parallel.layout import SequenceLayout
from sharding_rules import logical_to_spec

__all__ = ["CachedForward", "Policy", "resolve"]

#: The streams' logical layout (``jaxdit.models.staged``: every stream is [B, L, E]).
STREAM_AXES = ("batch", "seq", None)
#: Records with one row per device: sharded over every mesh axis.
PER_DEVICE = PartitionSpec(MESH_AXES, None)


@dataclasses.dataclass(frozen=True)
class Policy:
    """A cache config resolved for one model (static: it is traced into the step).

    ``metric``: ``"first_block"`` (First-Block-Cache), ``"step_input"`` (TeaCache on an input computed
    in the step) or ``"schedule"`` (TeaCache on an input that depends on the timestep only).
    """

    name: str
    title: str
    threshold: float
    metric: str
    coefficients: tuple[float, ...] = ()

    @property
    def runs_first_block(self) -> bool:
        return self.metric == "first_block"

    def forced(self, steps: int, switches: Sequence[int] = ()) -> list[int]:
        """Steps that always run every block: the first; TeaCache's last; where the parameters change."""
        last = [steps - 1] if self.name == TeaCache.name else []
        return sorted({0, *last, *switches})

    def describe(self) -> str:
        return f"{self.title} (threshold {self.threshold:g})"


def resolve(config: Any, model: Any, grid: Sequence[int] = ()) -> Policy:
    """A ``FirstBlockCache`` / ``TeaCache`` for ``model`` (a staged transformer, possibly abstract);
    TeaCache's missing threshold and coefficients are the model's published ones for ``grid`` (the
    latent token grid: Wan I2V picks its 480P or 720P model's numbers by it)."""
    kind = type(model).__name__
    if isinstance(config, FirstBlockCache):
        if not hasattr(model, "cache_metric_stream"):
            raise ValueError(f"{kind} does not say which stream First-Block-Cache compares")
        return Policy(config.name, config.title, float(config.threshold), "first_block")
    if isinstance(config, TeaCache):
        if hasattr(model, "teacache_timestep_input"):
            metric = "schedule"
        elif hasattr(model, "teacache_input"):
            metric = "step_input"
        else:
            raise ValueError(f"TeaCache needs the model's metric input; {kind} has none")
        defaults = model.teacache_defaults(tuple(grid))
        coefficients = config.coefficients or (defaults[0] if defaults else None)
        threshold = config.threshold or (defaults[1] if defaults else None)
        if coefficients is None or threshold is None:
            raise ValueError(
                f"TeaCache has no published coefficients for this {kind} (not a published model size); "
                "pass TeaCache(threshold=..., coefficients=(...)) explicitly"
            )
        return Policy(config.name, config.title, float(threshold), metric, tuple(map(float, coefficients)))
    raise TypeError(
        f"cache must be a jaxdit.cache.FirstBlockCache or TeaCache (or None), got {type(config).__name__}"
    )


# --------------------------------------------------------------------------------------------------------
# The local view (inside shard_map)
# --------------------------------------------------------------------------------------------------------


def _first_stack(model: Any) -> int:
    for k, name in enumerate(model.STACKS):
        if getattr(model, name) is not None:
            return k
    raise ValueError(f"{type(model).__name__} has no blocks to cache")


def _split_first(blocks: nnx.Module) -> tuple[nnx.Module, nnx.Module]:
    """A stacked block module -> (its block 0, the stack of the others)."""
    graphdef, state = nnx.split(blocks)
    first = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))
    rest = nnx.merge(graphdef, jax.tree.map(lambda a: a[1:], state))
    return first, rest


def _masked_l1(x: jax.Array, reference: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum |x - reference|, sum |reference|) over the real tokens (axis 1) of this device, fp32."""
    mask = valid[None, :, None]
    x, reference = x.astype(jnp.float32), reference.astype(jnp.float32)
    numerator = jnp.sum(jnp.where(mask, jnp.abs(x - reference), 0.0))
    denominator = jnp.sum(jnp.where(mask, jnp.abs(reference), 0.0))
    return numerator, denominator


def _mesh_sum(numerator: jax.Array, denominator: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Both sums over every device of the mesh, as ONE all-reduce of two scalars."""
    both = jax.lax.psum(jnp.stack([numerator, denominator]), MESH_AXES)
    return both[0], both[1]


def _enter_stacks(model: Any, names: Sequence[str], streams: Any, ctx: ShardContext) -> Any:
    for name in names:
        streams = model.enter(name, streams, ctx)
    return streams


def cached_body(
    policy: Policy, model: Any, ctx: ShardContext, cache: dict[str, Any], **inputs: jax.Array
) -> tuple[jax.Array, dict[str, Any]]:
    """One shard's cached forward (module docstring): -> (its prediction, the new cache state)."""
    streams, cond = model.embed(inputs, ctx)
    k = _first_stack(model)
    first, later = model.STACKS[k], model.STACKS[k + 1 :]
    streams = _enter_stacks(model, model.STACKS[: k + 1], streams, ctx)
    block0, others = _split_first(getattr(model, first))
    step = cache["step"]
    code = cache["plan"][step]
    reference = cache.get("reference")
    ratio = jnp.float32(jnp.nan)

    def run_blocks(stack: str, blocks: nnx.Module, s: Any) -> Any:
        return scan_blocks(blocks, s, lambda block, c: model.run_block(stack, block, c, cond, ctx))

    if policy.metric == "first_block":
        start = model.run_block(first, block0, streams, cond, ctx)
        rest_of_first = others
        x_in, valid = model.cache_metric_stream(streams, ctx)
        x_out, _ = model.cache_metric_stream(start, ctx)
        fresh = x_out - x_in  # block 0's residual on the metric stream
        numerator, denominator = _mesh_sum(*_masked_l1(fresh, reference, valid))
        run = first_block_decision(code, numerator, denominator, policy.threshold)
        ratio = numerator / denominator
    else:
        start = streams
        rest_of_first = getattr(model, first)
        accumulated = cache.get("accumulated")
        if policy.metric == "step_input":
            fresh, valid = model.teacache_input(block0, streams, cond, ctx)
            numerator, denominator = _mesh_sum(*_masked_l1(fresh, reference, valid))
            run, accumulated = teacache_decision(
                code, numerator, denominator, accumulated, policy.threshold, policy.coefficients
            )
            ratio = numerator / denominator
        else:  # the host decided every step
            run = code == RUN

    def full(start, residual, reference):
        s = run_blocks(first, rest_of_first, start)
        for name in later:
            s = model.enter(name, s, ctx)
            if getattr(model, name) is not None:
                s = run_blocks(name, getattr(model, name), s)
        base = _enter_stacks(model, later, start, ctx)
        stored = fresh if policy.metric == "first_block" else reference
        return s, jax.tree.map(jnp.subtract, s, base), stored

    def skip(start, residual, reference):
        base = _enter_stacks(model, later, start, ctx)
        return jax.tree.map(jnp.add, base, residual), residual, reference

    final, residual, kept = jax.lax.cond(run, full, skip, start, cache["residual"], reference)
    new = dict(cache, step=step + 1, residual=residual)
    if reference is not None:
        # TeaCache compares consecutive steps: its reference is this step's input, full or not.
        new["reference"] = fresh if policy.metric == "step_input" else kept
    if "accumulated" in cache:
        new["accumulated"] = accumulated
    new["ran"] = cache["ran"].at[0, step].set(run.astype(jnp.int32))
    new["ratio"] = cache["ratio"].at[0, step].set(ratio.astype(jnp.float32))
    return model.output(final, cond, ctx), new


def _probe(policy: Policy, model: Any, ctx: ShardContext, **inputs: jax.Array) -> tuple[Any, Any]:
    """The final streams and the metric stream of one shard, for their shapes (no block runs)."""
    streams, cond = model.embed(inputs, ctx)
    k = _first_stack(model)
    streams = _enter_stacks(model, model.STACKS[: k + 1], streams, ctx)
    final = _enter_stacks(model, model.STACKS[k + 1 :], streams, ctx)
    if policy.metric == "first_block":
        return final, model.cache_metric_stream(streams, ctx)[0]
    if policy.metric == "step_input":
        block0, _ = _split_first(getattr(model, model.STACKS[k]))
        return final, model.teacache_input(block0, streams, cond, ctx)[0]
    return final, None


# --------------------------------------------------------------------------------------------------------
# On the mesh
# --------------------------------------------------------------------------------------------------------


class CachedForward:
    """A :class:`ShardedForward` with a cache (module docstring).

    Args:
      forward: the model's sharded forward (its ``graphdef`` is the staged transformer).
      policy: from :func:`resolve`.
    """

    def __init__(self, forward: ShardedForward, policy: Policy) -> None:
        self.forward = forward
        self.policy = policy
        self.mesh = forward.mesh
        self.stream_spec = logical_to_spec(STREAM_AXES, forward.rules)
        self.replicated = PartitionSpec()

    @property
    def model(self) -> Any:
        return nnx.merge(self.forward.graphdef, self.forward.state)

    @property
    def blocks_per_step(self) -> int:
        model = self.model
        return sum(
            int(jax.tree.leaves(nnx.state(getattr(model, name)))[0].shape[0])
            for name in model.STACKS
            if getattr(model, name) is not None
        )

    # ------------------------------------------------------------------ specs and state
    def specs(self, shapes: Mapping[str, Any]) -> dict[str, Any]:
        """PartitionSpecs of a state with these (abstract) arrays."""
        by_name = {
            "residual": jax.tree.map(lambda _: self.stream_spec, shapes["residual"]),
            "reference": self.stream_spec,
            "ran": PER_DEVICE,
            "ratio": PER_DEVICE,
        }
        return {name: by_name.get(name, self.replicated) for name in shapes}

    def state_shapes(
        self, layout: SequenceLayout, names: tuple[str, ...], inputs: Sequence[Any], steps: int
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """The global shapes of the state for a step of these (abstract, padded) forward inputs."""
        fwd, policy = self.forward, self.policy
        ctx = ShardContext(fwd.config, layout, fwd.kernel)

        def local(state, *args):
            local_ctx, inputs = fwd.bind(ctx, names, args)
            return _probe(policy, nnx.merge(fwd.graphdef, state), local_ctx, **inputs)

        probe = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(fwd.param_specs, *(fwd.spec(fwd.inputs[n]) for n in names)),
            out_specs=self.stream_spec,  # every stream is [B, L, E]
            check_vma=False,
        )
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), fwd.state)
        final, metric = jax.eval_shape(probe, params, *inputs)
        devices = self.mesh.devices.size
        shapes: dict[str, Any] = {
            "step": jax.ShapeDtypeStruct((), jnp.int32),
            "plan": jax.ShapeDtypeStruct((steps,), jnp.int32),
            "residual": final,
            "ran": jax.ShapeDtypeStruct((devices, steps), jnp.int32),
            "ratio": jax.ShapeDtypeStruct((devices, steps), jnp.float32),
        }
        if metric is not None:
            shapes["reference"] = metric
        if self.policy.metric == "step_input":
            shapes["accumulated"] = jax.ShapeDtypeStruct((), jnp.float32)
        return shapes

    def shardings(self, shapes: Mapping[str, Any]) -> dict[str, Any]:
        return jax.tree.map(
            lambda spec: NamedSharding(self.mesh, spec),
            self.specs(shapes),
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )

    def init_state(self, shapes: Mapping[str, Any], plan: np.ndarray) -> dict[str, jax.Array]:
        """The state on the mesh: zeros, the host plan, records of -1 (no step yet)."""
        fill = {"ran": -1, "ratio": np.nan}

        def build():
            state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), dict(shapes))
            state.update({k: jnp.full(shapes[k].shape, v, shapes[k].dtype) for k, v in fill.items()})
            return state

        state = jax.jit(build, out_shardings=self.shardings(shapes))()
        state["plan"] = jax.device_put(np.asarray(plan, np.int32), NamedSharding(self.mesh, self.replicated))
        return state

    def bytes_per_device(self, shapes: Mapping[str, Any]) -> int:
        """Bytes of cache state one device holds (residual, reference, records, scalars)."""
        total = 0
        for shape, sharding in zip(
            jax.tree.leaves(dict(shapes)), jax.tree.leaves(self.shardings(shapes)), strict=True
        ):
            total += math.prod(sharding.shard_shape(tuple(shape.shape))) * jnp.dtype(shape.dtype).itemsize
        return total

    # ------------------------------------------------------------------ the step
    def step(self, layout: SequenceLayout, names: tuple[str, ...], shapes: Mapping[str, Any]):
        """``fn(params, cache, *padded_inputs) -> (prediction, cache)`` (see ``ShardedForward.carry_step``)."""
        policy = self.policy
        return self.forward.carry_step(
            layout,
            names,
            lambda model, ctx, carry, **x: cached_body(policy, model, ctx, carry, **x),
            self.specs(shapes),
        )

    # ------------------------------------------------------------------ host side
    def plan(
        self,
        steps: int,
        switches: Sequence[int] = (),
        schedule_inputs: Any = None,
        branch_rows: Sequence[np.ndarray] = (),
    ) -> np.ndarray:
        """The host plan of one generation (``jaxdit.cache.policies``). For a schedule metric,
        ``schedule_inputs`` [steps, rows, ...] are the metric inputs of every step (the model's
        ``teacache_timestep_input``) and ``branch_rows`` the rows of each guidance branch."""
        forced = self.policy.forced(steps, switches)
        if self.policy.metric != "schedule":
            return host_plan(steps, forced)
        x = np.asarray(schedule_inputs, np.float32)
        rows = branch_rows or [np.arange(x.shape[1])]
        ratios = np.full((len(rows), steps), np.nan, np.float32)
        for b, r in enumerate(rows):
            current, previous = x[1:, r], x[:-1, r]
            axes = tuple(range(1, current.ndim))
            ratios[b, 1:] = np.abs(current - previous).mean(axes) / np.abs(previous).mean(axes)
        return teacache_pattern(ratios, self.policy.threshold, self.policy.coefficients, forced)

    def report(self, state: Mapping[str, jax.Array], shapes: Mapping[str, Any]) -> CacheReport:
        ran = np.asarray(jax.device_get(state["ran"]))
        ratio = np.asarray(jax.device_get(state["ratio"]))
        return CacheReport(
            title=self.policy.title,
            threshold=self.policy.threshold,
            ran=ran[0] > 0,
            ratios=ratio[0],
            devices=ran.shape[0],
            devices_agree=bool((ran == ran[:1]).all()),
            blocks_per_step=self.blocks_per_step,
            always_run=1 if self.policy.runs_first_block else 0,
            bytes_per_device=self.bytes_per_device(shapes),
            per_device=ran,
        )
