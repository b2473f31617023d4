"""PipeFusion's compiled programs (arXiv 2405.14430), written once for every model family.

Two programs per generation geometry, both inside ``shard_map`` over the model's mesh:

- the synchronous warm-up step: every patch at once goes through the stages, pass after pass (each
  device runs its slots of the pass's stack when the sequence reaches it, P ticks per pass with one hop
  between ticks), filling every layer's K/V buffer; then head, CFG and one sampler step on all patches;
- the pipelined phase: the remaining steps as ONE ``lax.scan`` over ticks (``PipeSchedule``): at every
  tick each device runs each of its V passes once, on whichever patches the schedule puts there, against
  the fresh K/V of its patch and the stale K/V of the others.

Generic over

- the passes: V = ``len(model.STACKS)``, stack i being pass i, V-shaped (even passes up the stages, odd
  ones down). Even V: the last pass ends on stage 0, where the patch's next step starts, so the latent
  never moves. Odd V: it ends on stage P-1, which runs the head and the sampler step and sends the
  updated fp32 latent patch back to stage 0 (one more permute per tick);
- the sampler (``jaxdit.samplers.sampler``): its per-sample state is a tuple of arrays shaped like the
  latents, so patch m's state is their [:, m] slices; the step index of a tick's item is the phase's first
  step plus the item's step in the schedule;
- the family (``family.PatchFamily``): how a patch is embedded and conditioned, by the model's own staged
  pieces; the blocks run through the model's ``enter`` / ``run_block`` / ``output``.

Hand-over. Between stages a patch travels as ONE fp32 array [b, L, E], its streams' token groups joined
(:class:`Wire`), so a hop is one collective-permute however many streams a stack carries (FLUX's double
blocks: text and image). The streams entering pass v + 1 are ``model.enter`` of pass v's output, taken on
the device where pass v ends (the turn of the V).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jaxdit.cache import taylor
from jaxdit.models.staged import stack_gathers
from jaxdit.parallel.cfg import guidance as cfg_guidance
from jaxdit.parallel.context import ShardContext
from jaxdit.parallel.fsdp import gathered_scan
from jaxdit.parallel.layout import SequenceLayout
from jaxdit.parallel.pipefusion import (
    PatchContext,
    PipeSchedule,
    guide_patch,
    shift,
    stage_index,
    to_first_stage,
    write_patch,
)
from jaxdit.pipelines.pipefusion.family import PatchFamily
from jaxdit.pipelines.pipefusion.geometry import PatchGeometry
from jaxdit.pipelines.pipefusion.stages import StagedModel
from jaxdit.samplers.sampler import Sampler
from sharding_rules import logical_to_spec

__all__ = ["KV_AXES", "LATENT_AXES", "RESIDUAL_AXES", "PipeFusionPrograms", "Wire"]

#: Latent patches (and the sampler state): one copy per stage [P, requests, M, S*n, K], tokens over seq.
LATENT_AXES = ("stage", "request", None, "seq", None)
#: K/V buffers [slots, batch, M, L, H, D]: layer slots split like the stacks, heads as after Ulysses.
KV_AXES = ("layers", "batch", None, None, "kv_heads", None)
#: A host-planned cache's residual of all blocks (``cache.py``), per patch [P, batch, M, S*piece, E]: one
#: copy per stage (the stage where a patch's step ends holds it), the model batch over (data, cfg).
RESIDUAL_AXES = ("stage", "batch", None, "seq", None)


class Wire:
    """A pass's streams as one array and back: their leaves joined along the token axis (a single-leaf
    stream is its own wire). The structure of each stack's streams is recorded when it is first packed."""

    def __init__(self) -> None:
        self._formats: dict[str, tuple[Any, list[int]]] = {}

    def pack(self, stack: str, streams: Any) -> jax.Array:
        leaves, treedef = jax.tree.flatten(streams)
        self._formats[stack] = (treedef, [leaf.shape[1] for leaf in leaves])
        return leaves[0] if len(leaves) == 1 else jnp.concatenate(leaves, axis=1)

    def unpack(self, stack: str, x: jax.Array) -> Any:
        treedef, sizes = self._formats[stack]
        parts = [x] if len(sizes) == 1 else jnp.split(x, np.cumsum(sizes)[:-1].tolist(), axis=1)
        return jax.tree.unflatten(treedef, parts)


class PipeFusionPrograms:
    """The warm-up step and the pipelined phase of a family's model for one geometry ``g``, compiled
    lazily. ``guided``: the calls run classifier-free guidance (both branches in the model batch);
    ``kernel``: attention tile sizes; ``compiler_options``: XLA options of the compiled programs;
    ``guidance(uncond, cond, scale)``: the family's per-token CFG combination (None: plain CFG)."""

    def __init__(
        self,
        family: PatchFamily,
        model: StagedModel,
        g: PatchGeometry,
        guided: bool,
        sampler: Sampler,
        kernel: Mapping[str, int] | None = None,
        compiler_options: Mapping[str, Any] | None = None,
        guidance: Callable | None = None,
        cache_order: int | None = None,
    ) -> None:
        self.family, self.model, self.g, self.guided, self.sampler = family, model, g, guided, sampler
        #: A host-planned cache (``cache.py``): None for none, else the Taylor order of its forecast
        #: (0: MagCache's plain reuse of the residual).
        self.cache_order = cache_order
        self.guidance = cfg_guidance if guidance is None else guidance
        self.kernel = tuple(sorted((kernel or {}).items()))  # attention tile sizes, hashable
        self.compiler_options = dict(compiler_options) if compiler_options else None
        self.parallel = model.parallel
        self.stacks = tuple(model.orders)  # the forward's order: stack i is pass i
        spec = lambda axes: logical_to_spec(axes, model.rules)
        self.specs = {"latents": spec(LATENT_AXES), "kv": spec(KV_AXES), "scalar": PartitionSpec()}
        self.specs["residual"] = spec(RESIDUAL_AXES)
        self.specs.update({name: spec(axes) for name, axes in family.context_axes.items()})
        self.shardings = {k: NamedSharding(model.mesh, s) for k, s in self.specs.items()}
        self._built: dict[tuple, Callable] = {}

    # ------------------------------------------------------------------ shapes and placement
    def schedule(self, steps: int) -> PipeSchedule:
        return PipeSchedule(self.parallel.pipefusion, self.g.patches, len(self.stacks), steps)

    def latent_shape(self) -> tuple[int, ...]:
        g = self.g
        return (self.model.stages, g.requests, g.patches, g.seq * g.latent_piece, self.family.latent_features)

    def kv_shape(self, stack: str | None = None) -> tuple[int, ...]:
        """One K (or V) buffer of ``stack`` (default: the only one): [slots, B, M, L, H, D]."""
        (stack,) = self.stacks if stack is None else (stack,)
        g, c = self.g, self.model.config
        slots = len(self.model.orders[stack])
        return (slots, g.batch, g.patches, g.seq * g.piece, c.num_heads, c.head_dim)

    def buffer_shapes(self) -> list[tuple[int, ...]]:
        """K and V of every stack, in pass order."""
        return [self.kv_shape(s) for s in self.stacks for _ in range(2)]

    def zero_buffers(self) -> tuple[jax.Array, ...]:
        """The K/V buffers, zeroed, created on the devices that own them."""
        shapes, dtype, sharding = self.buffer_shapes(), self.model.dtype, self.shardings["kv"]
        return self._cached(
            ("zeros",),
            lambda: jax.jit(
                lambda: tuple(jnp.zeros(s, dtype) for s in shapes), out_shardings=(sharding,) * len(shapes)
            ),
        )()

    def residual_shape(self) -> tuple[int, ...]:
        """One array of a host-planned cache's state: the residual of all blocks per patch (or one of its
        Taylor derivatives) [P, batch, M, S*piece, E]."""
        g = self.g
        return (self.model.stages, g.batch, g.patches, g.seq * g.piece, self.family.width)

    def zero_residual(self) -> tuple[jax.Array, ...]:
        """The cache state, zeroed: ``cache_order + 1`` arrays (the residual, then its derivatives)."""
        shape, sharding, count = self.residual_shape(), self.shardings["residual"], self.cache_order + 1
        return self._cached(
            ("zero-residual",),
            lambda: jax.jit(
                lambda: tuple(jnp.zeros(shape, jnp.float32) for _ in range(count)),
                out_shardings=(sharding,) * count,
            ),
        )()

    def residual_bytes_per_device(self) -> int:
        sharding = self.shardings["residual"]
        per = int(np.prod(sharding.shard_shape(self.residual_shape()))) * 4
        return per * (self.cache_order + 1)

    def init_state(self, lat: jax.Array) -> tuple[jax.Array, ...]:
        """The sampler's state for the placed latents, laid out like them."""
        count = len(jax.eval_shape(self.sampler.init_state, lat))
        if not count:
            return ()
        init = jax.jit(self.sampler.init_state, out_shardings=(self.shardings["latents"],) * count)
        return tuple(init(lat))

    def _sds(self, shape: tuple[int, ...], dtype: Any, key: str) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.shardings[key])

    def abstract_args(self, steps: int | None, schedule: Any) -> tuple:
        """``jax.ShapeDtypeStruct`` arguments of the warm-up step (``steps=None``) or of the pipelined
        phase over ``steps`` steps with the sampler's host ``schedule``, for ``.lower(*args)`` without
        weights or data."""
        mdl = self.model
        params = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), mdl.state, mdl.param_shardings
        )
        lat = self._sds(self.latent_shape(), jnp.float32, "latents")
        state = tuple(
            self._sds(a.shape, a.dtype, "latents") for a in jax.eval_shape(self.sampler.init_state, lat)
        )
        kv = tuple(self._sds(s, mdl.dtype, "kv") for s in self.buffer_shapes())
        context = {
            name: None if entry is None else self._sds(*entry, name)
            for name, entry in self.family.abstract_context(self.g, mdl.dtype).items()
        }
        schedule = jax.tree.map(lambda a: self._sds(np.shape(a), np.asarray(a).dtype, "scalar"), schedule)
        scale = self._sds((), jnp.float32, "scalar")
        if steps is None:
            return (params, lat, state, kv, context, schedule, self._sds((), jnp.int32, "scalar"), scale)
        return (params, lat, state, kv, context, schedule, scale)

    # ------------------------------------------------------------------ builds
    def _cached(self, key: tuple, build: Callable[[], Callable]) -> Callable:
        if key not in self._built:
            self._built[key] = build()
        return self._built[key]

    def warmup(self) -> Callable:
        """``(params, lat, state, kv, context, schedule, i, scale) -> (lat, state, kv)``: step ``i``.

        With a host-planned cache (``cache_order`` not None): ``(params, lat, state, kv, residual,
        context, schedule, i, scale, follow, distance, full_before) -> (lat, state, kv, residual)``: the
        step also stores the residual of all blocks per patch, then applies the ``follow[i]`` skipped
        steps after it (``cache.py``)."""
        return self._cached(("warmup",), self._build_warmup)

    def asynchronous(self, steps: int, first_step: int) -> Callable:
        """``(params, lat, state, kv, context, schedule, scale) -> (lat, state)``: steps ``first_step``
        to ``first_step + steps - 1`` pipelined. The sampler state comes back so that a later segment of
        the schedule (another expert's, ``segments.py``) continues the same trajectory."""
        return self._cached(("async", steps, first_step), lambda: self._build_async(steps, first_step))

    def asynchronous_cached(self, total_steps: int) -> Callable:
        """A host-planned cache's pipelined phase: ``(params, lat, state, kv, residual, context, schedule,
        scale, follow, distance, full_before, full_index, full_count) -> (lat, state, residual)``: the
        loop runs the ``full_count`` full steps ``full_index`` (absolute, of ``total_steps``; [total_steps],
        padded after the count) pipelined, and right after each patch's full step the ``follow`` skipped
        steps after it (``cache.py``). One program per step count: which steps are full, and how many, is
        data, so every threshold of a cache runs the same program."""
        return self._cached(
            ("async-cached", total_steps), lambda: self._build_async(total_steps, 0, total_steps)
        )

    # ------------------------------------------------------------------ host-planned cache pieces
    def _enter_all(self, model: nnx.Module, streams: Any, ctx: ShardContext) -> Any:
        """Embedded streams carried through every stack's ``enter`` without a block: what the residual of
        all blocks is measured from and added to."""
        for stack in self.stacks:
            streams = model.enter(stack, streams, ctx)
        return streams

    def _measure(self, streams: Any, embedded: Any) -> jax.Array:
        """The residual of all blocks: the last pass's output streams minus the embedded streams carried
        through every ``enter``, their leaves joined along the tokens [b, tokens, E] (``Wire``), so one
        array holds it whatever streams the last stack carries (FLUX's joined stream; HunyuanVideo 1.5's
        video and context streams)."""
        wire, stack = Wire(), self.stacks[-1]
        return wire.pack(stack, streams) - wire.pack(stack, embedded)

    def _add_residual(self, embedded: Any, residual: jax.Array) -> Any:
        """The embedded streams (through every ``enter``) plus a kept residual (:meth:`_measure`'s join)."""
        wire, stack = Wire(), self.stacks[-1]
        return wire.unpack(stack, wire.pack(stack, embedded) + residual.astype(jnp.float32))

    def _patches_of_full(self, x: jax.Array) -> jax.Array:
        """A stream in the warm-up's local layout [b, M*g_0 + M*g_1 + ..., E] -> per patch [b, M, piece, E]."""
        g = self.g
        bounds = np.cumsum([g.patches * p for p in g.pieces])[:-1].tolist()
        parts = [a.reshape(a.shape[0], g.patches, -1, a.shape[-1]) for a in jnp.split(x, bounds, axis=1)]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=2)

    def _residual_update(self, stored: tuple, fresh: jax.Array, distance: jax.Array, before: jax.Array):
        """The cache state after a full step that measured residual ``fresh``: MagCache keeps it, TaylorSeer
        refreshes its derivative estimates (``jaxdit.cache.taylor.update``)."""
        if not self.cache_order:
            return (fresh,)
        return taylor.update(stored, fresh, distance, before)

    def _skip_steps(self, model, pieces, ctx, schedule, scale, x, state, stored, m, last, count):
        """Patch ``m``'s skipped steps ``last + 1 .. last + count`` after its full step ``last``: embed,
        the stored residual (or its Taylor forecast) added with no block run, head, CFG, sampler step.
        ``count`` must be the same on every device (the cfg exchange runs inside)."""
        sampler = self.sampler

        def body(k, carry):
            x, state = carry
            i = last + k
            cond = pieces.cond(pieces.step_cond(sampler.model_time(schedule, i)), m)
            residual = taylor.forecast(stored, k) if self.cache_order else stored[0]
            final = self._add_residual(self._enter_all(model, pieces.embed(x, m), ctx), residual)
            pred = self._guide(pieces.prediction(model.output(final, cond, ctx)), scale)
            x_new, state_new = sampler.step(schedule, i, state, x, pred)
            return x_new.astype(x.dtype), tuple(state_new)

        return lax.fori_loop(1, count + 1, body, (x, tuple(state)))

    # ------------------------------------------------------------------ pieces (inside shard_map)
    def _model_batch(self, x: jax.Array) -> jax.Array:
        # cfg=1 with guidance: this data shard's [uncond; cond] halves share the latent.
        return jnp.concatenate([x, x], 0) if self.guided and self.parallel.cfg == 1 else x

    def _guide(self, pred: jax.Array, scale: jax.Array) -> jax.Array:
        return guide_patch(pred, scale, self.parallel.cfg, self.guidance) if self.guided else pred

    @staticmethod
    def _sample_masks(pieces: Any, g: PatchGeometry) -> Any:
        """The per-row key masks of a family whose pieces carry ``sample_valid`` (None: the geometry's)."""
        samples = getattr(pieces, "sample_valid", None)  # optional member of PatchPieces
        return None if samples is None else g.sample_masks(samples)

    def _run_slots(
        self,
        model: nnx.Module,
        stack: str,
        streams: Any,
        cond: Any,
        layout: SequenceLayout,
        fresh_valid: jax.Array | None,
        stale: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    ) -> tuple[Any, tuple[jax.Array, jax.Array]]:
        """Scan this device's slots of ``stack`` on ``streams``, attention against the slot's stale
        buffer when ``stale`` = (K, V [slots, B, M, L, h, D], valid [M*L]) is given. Returns the streams
        and each slot's fresh K/V [slots, B, L', h, D]."""
        graphdef, state = nnx.split(getattr(model, stack))

        def body_block(block, c, kv):
            if stale is None:
                stale_kv = None
            else:
                kb, vb = kv
                flat = lambda b: b.reshape(b.shape[0], -1, *b.shape[3:])  # [B, M*L, h, D]
                stale_kv = (flat(kb), flat(vb), stale[2])
            ctx = PatchContext(self.parallel, layout, self.kernel, fresh_valid=fresh_valid, stale=stale_kv)
            c = model.run_block(stack, block, c, cond, ctx)
            ((k, v),) = ctx.fresh  # one self-attention per block
            return c, (k, v)

        def body(c, xs):
            block_state, kv = (xs, None) if stale is None else (xs[0], xs[1:])
            return body_block(nnx.merge(graphdef, block_state), c, kv)

        gathers = stack_gathers(self.model.gathers, stack)
        if gathers:  # fsdp: each slot's weights gathered one slot ahead (jaxdit.parallel.fsdp)
            kv = () if stale is None else stale[:2]
            return gathered_scan(graphdef, state, streams, body_block, gathers, xs=kv)
        return lax.scan(body, streams, state if stale is None else (state, *stale[:2]))

    def _jit(self, local: Callable, *, pipelined: bool, state_count: int, cached: bool = False) -> Callable:
        """``local(params, lat, state, kv, context, schedule, [i,] scale)`` under ``shard_map``, jitted.
        ``cached`` (a host-planned cache): ``local(params, lat, state, kv, residual, context, schedule,
        [i,] scale, follow, distance, full_before[, full_index, full_count])`` returning the residual
        last."""
        sp = self.specs
        lat, kv = sp["latents"], (sp["kv"],) * 2 * len(self.stacks)
        state = (lat,) * state_count
        context = {name: sp[name] for name in self.family.context_axes}
        index = () if pipelined else (sp["scalar"],)
        in_specs = (lat, state, kv, context, sp["scalar"], *index, sp["scalar"])  # schedule: replicated
        out_specs = (lat, state) if pipelined else (lat, state, kv)
        if cached:  # the residual after the K/V; the plan's tables (replicated) last
            residual = (sp["residual"],) * (self.cache_order + 1)
            tables = (sp["scalar"],) * (5 if pipelined else 3)
            in_specs = (lat, state, kv, residual, *in_specs[3:], *tables)
            out_specs = (*out_specs, residual)
        mesh, model = self.model.mesh, self.model
        fn = jax.shard_map(
            local, mesh=mesh, in_specs=(model.param_specs, *in_specs), out_specs=out_specs, check_vma=False
        )
        shard = lambda spec: NamedSharding(mesh, spec)
        is_spec = lambda x: isinstance(x, PartitionSpec)
        return jax.jit(
            fn,
            in_shardings=(model.param_shardings, *jax.tree.map(shard, in_specs, is_leaf=is_spec)),
            out_shardings=jax.tree.map(shard, out_specs, is_leaf=is_spec),
            # The latents, sampler state, (in warm-up) the K/V buffers and a cache's residual are updated
            # in place.
            donate_argnums=((1, 2) if pipelined else (1, 2, 3)) + ((4,) if cached else ()),
            compiler_options=self.compiler_options,
        )

    def _state_count(self) -> int:
        return len(jax.eval_shape(self.sampler.init_state, jax.ShapeDtypeStruct((1,), jnp.float32)))

    # ------------------------------------------------------------------ warm-up
    def _build_warmup(self) -> Callable:
        g, pc, sampler = self.g, self.parallel, self.sampler
        stages, sched = pc.pipefusion, self.schedule(1)
        layout, full_valid = g.full_layout(), g.full_valid()
        valid = None if full_valid is None else jnp.asarray(full_valid)

        cached = self.cache_order is not None

        def local(params, lat, state, kv, *rest):
            if cached:
                residual, context, schedule, i, scale, follow, distance, full_before = rest
            else:
                context, schedule, i, scale = rest
            model = nnx.merge(self.model.graphdef, params)
            pieces = self.family.pieces(model, context, g, full=True, batch=self._model_batch)
            masks = self._sample_masks(pieces, g)
            keys = valid if masks is None else masks.full_valid()
            ctx, wire, s = ShardContext(pc, layout, self.kernel), Wire(), stage_index()
            flat = lambda a: a[0].reshape(a.shape[1], -1, a.shape[-1])  # [b, M*n, K]: every patch
            x_lat, sampler_state = flat(lat), tuple(flat(a) for a in state)
            cond = pieces.cond(pieces.step_cond(sampler.model_time(schedule, i)), None)

            def run_pass(pass_index, stack, x, kb, vb):
                direction = 1 if pass_index % 2 == 0 else -1

                def tick(c, position):
                    x, kb, vb = c
                    streams, (k, v) = self._run_slots(model, stack, wire.unpack(stack, x), cond, layout, keys)
                    active = sched.position(pass_index, s) == position  # the sequence is on this device
                    kb = jnp.where(active, jax.vmap(g.to_slots)(k).astype(kb.dtype), kb)
                    vb = jnp.where(active, jax.vmap(g.to_slots)(v).astype(vb.dtype), vb)
                    return wire.pack(stack, streams), kb, vb

                def hop(c, position):
                    y, kb, vb = tick(c, position)
                    return (shift(y, direction, stages), kb, vb), None

                carry, _ = lax.scan(hop, (x, kb, vb), jnp.arange(stages - 1))
                return tick(carry, stages - 1)  # the pass ends on its last device, which starts the next

            streams, kv = pieces.embed(x_lat, None), list(kv)
            for v, stack in enumerate(self.stacks):
                x = wire.pack(stack, model.enter(stack, streams, ctx))
                x, kv[2 * v], kv[2 * v + 1] = run_pass(v, stack, x, kv[2 * v], kv[2 * v + 1])
                streams = wire.unpack(stack, x)
            pred = self._guide(pieces.prediction(model.output(streams, cond, ctx)), scale)
            x_new, sampler_state = sampler.step(schedule, i, sampler_state, x_lat, pred)
            if cached:  # the residual of all blocks per patch; then the skipped steps that follow
                fresh = self._measure(streams, self._enter_all(model, pieces.embed(x_lat, None), ctx))
                stored = tuple(a[0] for a in residual)
                stored = self._residual_update(
                    stored, self._patches_of_full(fresh), distance[i], full_before[i]
                )
                x_new, sampler_state = self._skip_after_warmup(
                    model, context, schedule, scale, x_new, sampler_state, stored, i, follow[i]
                )
            if sched.last_stage != 0:  # the updated latent goes back to stage 0
                x_new = jnp.where(s == 0, to_first_stage(x_new, stages), x_new)
            out = tuple(a.reshape(lat.shape) for a in (x_new, *sampler_state))
            if cached:
                return out[0], out[1:], tuple(kv), tuple(a[None] for a in stored)
            return out[0], out[1:], tuple(kv)

        return self._jit(local, pipelined=False, state_count=self._state_count(), cached=cached)

    def _skip_after_warmup(self, model, context, schedule, scale, x, state, stored, last, count):
        """The skipped steps after warm-up step ``last`` on the full latent [b, M*n, K], patch by patch."""
        g, pc = self.g, self.parallel
        pieces = self.family.pieces(model, context, g, full=False, batch=self._model_batch)
        ctx = ShardContext(pc, g.patch_layout(), self.kernel)
        patched = lambda a: a.reshape(a.shape[0], g.patches, -1, a.shape[-1])  # [b, M, n, K]
        pick = lambda a, m: lax.dynamic_index_in_dim(a, m, 1, keepdims=False)
        put = lambda a, v, m: lax.dynamic_update_index_in_dim(a, v, m, 1)

        def patch(m, carry):
            x, state = carry
            xm, sm = self._skip_steps(
                model,
                pieces,
                ctx,
                schedule,
                scale,
                pick(x, m),
                tuple(pick(a, m) for a in state),
                tuple(pick(d, m) for d in stored),
                m,
                last,
                count,
            )
            return put(x, xm, m), tuple(put(a, b, m) for a, b in zip(state, sm, strict=True))

        x, state = lax.fori_loop(0, g.patches, patch, (patched(x), tuple(patched(a) for a in state)))
        flat = lambda a: a.reshape(a.shape[0], -1, a.shape[-1])
        return flat(x), tuple(flat(a) for a in state)

    # ------------------------------------------------------------------ pipelined phase
    def _build_async(self, steps: int, first_step: int, total: int | None = None) -> Callable:
        """The pipelined phase; ``total`` (a host-planned cache): the loop runs the plan's ``full_count``
        full steps ``full_index`` of ``total``, each followed by its skipped steps (``cache.py``). Its trip
        count is then data (a ``fori_loop`` with a traced bound: a ``while`` whose trip count XLA does not
        know), so one program serves every plan of ``total`` steps; ``steps`` is the most full steps."""
        g, pc, sampler, stacks = self.g, self.parallel, self.sampler, self.stacks
        cached = total is not None
        stages, sched = pc.pipefusion, self.schedule(steps)
        layout, patch_valid = g.patch_layout(), g.patch_valid()
        end = sched.last_stage
        pick = lambda a, m: lax.dynamic_index_in_dim(a, m, 1, keepdims=False)
        put = lambda a, x, m: lax.dynamic_update_index_in_dim(a, x, m, 1)

        def local(params, lat, state, kv, *rest):
            if cached:
                residual, context, schedule, scale, follow, distance, full_before, full_index, full_count = (
                    rest
                )
                absolute = lambda j: full_index[j]  # noqa: E731
                item = lambda t, v, stage: sched.item(t, v, stage, full_count)  # noqa: E731
            else:
                context, schedule, scale = rest
                absolute = lambda j: first_step + j  # noqa: E731
                item = sched.item
            model = nnx.merge(self.model.graphdef, params)
            pieces = self.family.pieces(model, context, g, full=False, batch=self._model_batch)
            ctx, wire, s = ShardContext(pc, layout, self.kernel), Wire(), stage_index()
            # Every step's conditioning once per call, indexed by the step of each tick's items.
            times = jax.vmap(lambda j: sampler.model_time(schedule, absolute(j)))(jnp.arange(steps))
            step_conds = jax.vmap(pieces.step_cond)(times)
            masks = self._sample_masks(pieces, g)
            fresh = None if patch_valid is None else jnp.asarray(patch_valid)
            if masks is not None:
                fresh = masks.patch_valid()
            stale_valid = g.stale_valid if masks is None else masks.stale_valid
            lat, state = lat[0], tuple(a[0] for a in state)  # [b, M, n, K]; used where the step ends

            def tick(carry, t):
                if cached:
                    lat, state, wires, kv, residual = carry
                else:
                    lat, state, wires, kv = carry
                kv, outs, turns = list(kv), [], []
                for v, stack in enumerate(stacks):
                    ok, step, m = item(t, v, s)
                    cond = pieces.cond(jax.tree.map(lambda a, step=step: a[step], step_conds), m)
                    x = wires[v]
                    if v == 0:  # stage 0 embeds the patch that enters the pipeline
                        entering = model.enter(stack, pieces.embed(pick(lat, m), m), ctx)
                        x = jnp.where(s == 0, wire.pack(stack, entering), x)
                    stale = (kv[2 * v], kv[2 * v + 1], stale_valid(m))
                    mask = None if fresh is None else fresh[m]
                    streams, (k, vv) = self._run_slots(
                        model, stack, wire.unpack(stack, x), cond, layout, mask, stale
                    )
                    kv[2 * v], kv[2 * v + 1] = (
                        write_patch(kv[2 * v], k, m, ok),
                        write_patch(kv[2 * v + 1], vv, m, ok),
                    )
                    outs.append(wire.pack(stack, streams))
                    if v + 1 < len(stacks):  # the next pass starts on the device where this one ends
                        turns.append(wire.pack(stacks[v + 1], model.enter(stacks[v + 1], streams, ctx)))

                # The last pass ends the patch's step on stage `end`: head, CFG, sampler on its state slice.
                pred = self._guide(pieces.prediction(model.output(streams, cond, ctx)), scale)
                x_old = pick(lat, m)
                x_new, new_state = sampler.step(
                    schedule, absolute(step), tuple(pick(a, m) for a in state), x_old, pred
                )
                done = ok & (s == end)
                if cached:  # store the patch's residual of all blocks, then run the skipped steps after it
                    i = absolute(step)
                    measured = self._measure(streams, self._enter_all(model, pieces.embed(x_old, m), ctx))
                    old = tuple(pick(d, m) for d in residual)
                    stored = self._residual_update(old, measured, distance[i], full_before[i])
                    residual = tuple(
                        put(d, jnp.where(done, n, o), m)
                        for d, n, o in zip(residual, stored, old, strict=True)
                    )
                    # The trip count of the item ending on stage `end` this tick: the same on every device.
                    ok_e, step_e, _ = item(t, len(stacks) - 1, jnp.int32(end))
                    count = jnp.where(ok_e, follow[absolute(step_e)], 0)
                    x_new, new_state = self._skip_steps(
                        model, pieces, ctx, schedule, scale, x_new, new_state, stored, m, i, count
                    )
                lat = put(lat, jnp.where(done, x_new, x_old), m)
                state = tuple(
                    put(a, jnp.where(done, b, pick(a, m)), m) for a, b in zip(state, new_state, strict=True)
                )
                if end != 0:  # (odd V, P > 1) the updated patch goes back to stage 0 for its next step
                    ok_r, _, m_r = item(t, len(stacks) - 1, jnp.int32(end))
                    back = jnp.where(ok_r & (s == 0), to_first_stage(x_new, stages), pick(lat, m_r))
                    lat = put(lat, back, m_r)

                wires = [shift(outs[0], 1, stages)]
                for v in range(1, len(stacks)):
                    turn = sched.position(v, 0)  # the device where pass v - 1 hands over to pass v
                    onward = shift(outs[v], 1 if v % 2 == 0 else -1, stages)
                    wires.append(jnp.where(s == turn, turns[v - 1], onward))
                out = (lat, state, tuple(wires), tuple(kv))
                return (*out, residual) if cached else out, None

            local_batch = g.batch // (pc.data * pc.cfg)
            zero = jnp.zeros((local_batch, layout.local_length, self.family.width), jnp.float32)
            carry = (lat, state, (zero,) * len(stacks), kv)
            if cached:
                carry = (*carry, tuple(a[0] for a in residual))
                final = lax.fori_loop(0, sched.ticks_of(full_count), lambda t, c: tick(c, t)[0], carry)
            else:
                final, _ = lax.scan(tick, carry, jnp.arange(sched.ticks))
            lat, state = final[0], final[1]
            if cached:
                return lat[None], tuple(a[None] for a in state), tuple(a[None] for a in final[4])
            return lat[None], tuple(a[None] for a in state)

        return self._jit(local, pipelined=True, state_count=self._state_count(), cached=cached)
