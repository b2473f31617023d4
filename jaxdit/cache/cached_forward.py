"""A feature cache inside the sharded forward: one decision for the whole mesh, one compiled step.

:class:`CachedForward` turns a model's staged forward (``jaxdit.models.staged``) into a forward with a
cache state carried from step to step, built on :meth:`ShardedForward.carry_step` (the same
``shard_map`` as the plain forward, with the state going in and out). Inside it, in the local view of
one device:

1. ``embed``, then the first stack is entered; the blocks before the cache's start (``CACHE_FROM``:
   Z-Image's refiners) run. First-Block-Cache runs the cache's first block and takes its residual on
   the model's metric stream (``model.cache_metric_stream``: FLUX's image tokens, Wan's video tokens,
   Z-Image's joint stream);
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

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxdit.cache import segments, taylor
from jaxdit.cache.hooks import hooks_for
from jaxdit.cache.policies import (
    RUN,
    SKIP,
    first_block_decision,
    host_plan,
    teacache_decision,
    teacache_pattern,
)
from jaxdit.cache.report import CacheReport
from jaxdit.cache.resolve import Policy, resolve
from jaxdit.mesh import MESH_AXES
from jaxdit.models.sharded_forward import ShardedForward
from jaxdit.parallel.context import ShardContext
from jaxdit.parallel.layout import SequenceLayout
from sharding_rules import logical_to_spec

__all__ = ["CachedForward", "Policy", "resolve"]

#: The streams' logical layout (``jaxdit.models.staged``: every stream is [B, L, E]).
STREAM_AXES = ("batch", "seq", None)
#: Records with one row per device: sharded over every mesh axis.
PER_DEVICE = PartitionSpec(MESH_AXES, None)


# --------------------------------------------------------------------------------------------------------
# The local view (inside shard_map)
# --------------------------------------------------------------------------------------------------------


def _masked_l1(x: jax.Array, reference: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum |x - reference|, sum |reference|) over the real tokens (axis 1) of this device, fp32."""
    mask = valid[None, :, None]
    x, reference = x.astype(jnp.float32), reference.astype(jnp.float32)
    numerator = jnp.sum(jnp.where(mask, jnp.abs(x - reference), 0.0))
    denominator = jnp.sum(jnp.where(mask, jnp.abs(reference), 0.0))
    return numerator, denominator


def _norm_ratio(x: jax.Array, previous: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum over real tokens of ||x|| / ||previous|| (L2 over features), their count): MagCache's ratio."""
    norm = lambda a: jnp.sqrt(jnp.sum(jnp.square(a.astype(jnp.float32)), axis=-1))  # noqa: E731
    mask = jnp.broadcast_to(valid[None, :], x.shape[:2])
    return jnp.sum(jnp.where(mask, norm(x) / norm(previous), 0.0)), jnp.sum(mask.astype(jnp.float32))


def _mesh_sum(numerator: jax.Array, denominator: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Both sums over every device of the mesh, as ONE all-reduce of two scalars."""
    both = jax.lax.psum(jnp.stack([numerator, denominator]), MESH_AXES)
    return both[0], both[1]


def cached_body(
    policy: Policy, model: Any, ctx: ShardContext, cache: dict[str, Any], **inputs: jax.Array
) -> tuple[jax.Array, dict[str, Any]]:
    """One shard's cached forward (module docstring): -> (its prediction, the new cache state)."""
    hooks = hooks_for(model, policy.name)
    streams, cond = model.embed(inputs, ctx)
    streams = segments.start(model, streams, ctx)
    total, begin = segments.depth(model), segments.cache_start(model)
    streams = segments.advance(model, streams, 0, begin, cond, ctx)  # before the cache's blocks: always run
    head, tail = begin + policy.fn, total - policy.bn
    step = cache["step"]
    code = cache["plan"][step]
    reference = cache.get("reference")
    ratio = jnp.float32(jnp.nan)
    new = dict(cache, step=step + 1)

    start = segments.advance(model, streams, begin, head, cond, ctx)  # the head: always computed
    if policy.metric == "first_block":
        x_in, valid = hooks.cache_metric_stream(segments.carry(model, streams, begin, head, ctx), ctx)
        x_out, _ = hooks.cache_metric_stream(start, ctx)
        fresh = x_out - x_in  # the head's residual on the metric stream
        numerator, denominator = _mesh_sum(*_masked_l1(fresh, reference, valid))
        run = first_block_decision(code, numerator, denominator, policy.threshold)
        if policy.max_continuous >= 0:
            run = run | (cache["skipped"] >= policy.max_continuous)
        ratio = numerator / denominator
    elif policy.metric in ("step_input", "teacache_calibrate"):
        fresh, valid = hooks.teacache_input(segments.first_block(model), streams, cond, ctx)
        numerator, denominator = _mesh_sum(*_masked_l1(fresh, reference, valid))
        if policy.metric == "step_input":
            run, new["accumulated"] = teacache_decision(
                code, numerator, denominator, cache["accumulated"], policy.threshold, policy.coefficients
            )
        else:
            run = code == RUN  # the calibration computes every step
        ratio = numerator / denominator
    else:  # the host decided every step
        run = code == RUN
    distance = step - cache["last_full"] if policy.taylor_order else None

    def full(start, stored, reference):
        s = segments.advance(model, start, head, tail, cond, ctx)
        residual = jax.tree.map(jnp.subtract, s, segments.carry(model, start, head, tail, ctx))
        if policy.taylor_order:
            residual_state = taylor.update(stored, residual, distance, cache["full_steps"])
        else:
            residual_state = residual
        kept = fresh if policy.metric == "first_block" else reference
        return s, residual_state, kept

    def skip(start, stored, reference):
        residual = taylor.forecast(stored, distance) if policy.taylor_order else stored
        base = segments.carry(model, start, head, tail, ctx)
        return jax.tree.map(jnp.add, base, residual), stored, reference

    if policy.metric == "calibrate":
        # Every step computes; MagCache's ratio ||r_t|| / ||r_{t-1}|| of the output tokens is recorded.
        final, residual, _ = full(start, cache["residual"], reference)
        x, valid = hooks.cache_output_stream(residual, ctx)
        previous, _ = hooks.cache_output_stream(cache["residual"], ctx)
        total_ratio, count = _mesh_sum(*_norm_ratio(x, previous, valid))
        ratio, kept = total_ratio / count, reference
    else:
        final, residual, kept = jax.lax.cond(run, full, skip, start, cache["residual"], reference)
    final = segments.advance(model, final, tail, total, cond, ctx)  # the tail: always computed
    prediction = model.output(final, cond, ctx)
    new["residual"] = residual
    if reference is not None:
        # TeaCache compares consecutive steps: its reference is this step's input, full or not.
        new["reference"] = fresh if policy.metric in ("step_input", "teacache_calibrate") else kept
    if policy.metric == "teacache_calibrate":
        # The prediction's change since the previous step, over the output tokens' real ones.
        _, out_valid = hooks.cache_output_stream(final, ctx)
        changed = _mesh_sum(*_masked_l1(prediction, cache["previous_output"], out_valid))
        new["previous_output"] = prediction
        new["output_ratio"] = cache["output_ratio"].at[0, step].set(changed[0] / changed[1])
    if "skipped" in cache:
        new["skipped"] = jnp.where(run, 0, cache["skipped"] + 1)
    if policy.taylor_order:
        new["last_full"] = jnp.where(run, step, cache["last_full"])
        new["full_steps"] = cache["full_steps"] + run.astype(jnp.int32)
    new["ran"] = cache["ran"].at[0, step].set(run.astype(jnp.int32))
    new["ratio"] = cache["ratio"].at[0, step].set(ratio.astype(jnp.float32))
    return prediction, new


def _probe(policy: Policy, model: Any, ctx: ShardContext, **inputs: jax.Array) -> tuple[Any, Any, Any]:
    """The final streams, the metric stream and (TeaCache's calibration) the prediction of one shard,
    for their shapes (no block runs)."""
    hooks = hooks_for(model, policy.name)
    streams, cond = model.embed(inputs, ctx)
    streams = segments.start(model, streams, ctx)
    total, begin = segments.depth(model), segments.cache_start(model)
    streams = segments.carry(model, streams, 0, begin, ctx)
    final = segments.carry(model, streams, begin, total - policy.bn, ctx)
    if policy.metric == "first_block":
        head = begin + policy.fn
        return (
            final,
            hooks.cache_metric_stream(segments.carry(model, streams, begin, head, ctx), ctx)[0],
            None,
        )
    if policy.metric == "step_input":
        return final, hooks.teacache_input(segments.first_block(model), streams, cond, ctx)[0], None
    if policy.metric == "teacache_calibrate":
        metric = hooks.teacache_input(segments.first_block(model), streams, cond, ctx)[0]
        return (
            final,
            metric,
            model.output(segments.carry(model, final, total - policy.bn, total, ctx), cond, ctx),
        )
    return final, None, None


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
        return segments.depth(self.model)

    # ------------------------------------------------------------------ specs and state
    def specs(self, shapes: Mapping[str, Any]) -> dict[str, Any]:
        """PartitionSpecs of a state with these (abstract) arrays."""
        by_name = {
            "residual": jax.tree.map(lambda _: self.stream_spec, shapes["residual"]),
            "reference": self.stream_spec,
            "previous_output": self.stream_spec,
            "ran": PER_DEVICE,
            "ratio": PER_DEVICE,
            "output_ratio": PER_DEVICE,
        }
        return {name: by_name.get(name, self.replicated) for name in shapes}

    def state_shapes(
        self, layout: SequenceLayout, names: tuple[str, ...], inputs: Sequence[Any], steps: int
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """The global shapes of the state for a step of these (abstract, padded) forward inputs."""
        fwd, policy = self.forward, self.policy
        ctx = ShardContext(fwd.config, layout, fwd.kernel, gathers=fwd.gathers)

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
        final, metric, prediction = jax.eval_shape(probe, params, *inputs)
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
        if prediction is not None:  # TeaCache's calibration: the last prediction and its changes
            shapes["previous_output"] = prediction
            shapes["output_ratio"] = jax.ShapeDtypeStruct((devices, steps), jnp.float32)
        if self.policy.metric == "step_input":
            shapes["accumulated"] = jax.ShapeDtypeStruct((), jnp.float32)
        if self.policy.max_continuous >= 0:
            shapes["skipped"] = jax.ShapeDtypeStruct((), jnp.int32)
        if self.policy.taylor_order:
            # The derivative estimates D_0 .. D_m of the skipped blocks' residual (jaxdit.cache.taylor).
            shapes["residual"] = tuple(final for _ in range(self.policy.taylor_order + 1))
            shapes["last_full"] = jax.ShapeDtypeStruct((), jnp.int32)
            shapes["full_steps"] = jax.ShapeDtypeStruct((), jnp.int32)
        return shapes

    def shardings(self, shapes: Mapping[str, Any]) -> dict[str, Any]:
        return jax.tree.map(
            lambda spec: NamedSharding(self.mesh, spec),
            self.specs(shapes),
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )

    def init_state(self, shapes: Mapping[str, Any], plan: np.ndarray) -> dict[str, jax.Array]:
        """The state on the mesh: zeros, the host plan, records of -1 (no step yet). The zeros' program is
        kept per shapes and shardings: a served request of a compiled shape compiles nothing."""
        leaves, tree = jax.tree.flatten(dict(shapes))
        specs = tuple((tuple(s.shape), np.dtype(s.dtype).name) for s in leaves)
        state = _zeros(tree, specs, tuple(jax.tree.leaves(self.shardings(shapes))))()
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
        if self.policy.metric in ("host", "calibrate", "teacache_calibrate"):
            return np.where(self.policy.host_pattern(steps, forced), RUN, SKIP).astype(np.int32)
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
        output = state.get("output_ratio")
        return CacheReport(
            title=self.policy.title,
            threshold=self.policy.threshold,
            ran=ran[0] > 0,
            ratios=ratio[0],
            devices=ran.shape[0],
            devices_agree=bool((ran == ran[:1]).all()),
            blocks_per_step=self.blocks_per_step,
            always_run=self.policy.always_run + segments.cache_start(self.model),
            bytes_per_device=self.bytes_per_device(shapes),
            per_device=ran,
            setting=self.policy.describe(),
            output_ratios=None if output is None else np.asarray(jax.device_get(output))[0],
        )


@functools.lru_cache(maxsize=64)
def _zeros(tree: Any, specs: tuple, shardings: tuple) -> Any:
    """A jitted builder of a cache state: zeros, and -1 / NaN in the records (no step yet)."""
    fill = {"ran": -1, "ratio": np.nan, "output_ratio": np.nan}

    def build():
        state = jax.tree.unflatten(tree, [jnp.zeros(shape, dtype) for shape, dtype in specs])
        state.update({k: jnp.full(state[k].shape, v, state[k].dtype) for k, v in fill.items() if k in state})
        return state

    return jax.jit(build, out_shardings=jax.tree.unflatten(tree, list(shardings)))
