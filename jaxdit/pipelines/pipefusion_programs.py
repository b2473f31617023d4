"""The compiled programs of a PipeFusion pipeline (arXiv 2405.14430), minus what depends on the model.

A family's pipeline (``pipefusion_flux``, ``pipefusion_wan``) compiles two programs per generation
geometry: the synchronous warm-up step and the pipelined phase (one ``lax.scan`` over ticks). Both run
inside ``shard_map`` over the model's mesh; :class:`StagePrograms` holds what they share: the shardings
of the family's named specs, the lazy builds, the zeroed K/V buffers, the scan over one device's slots
of a stack with stale-K/V attention, CFG on one patch's prediction, and the ``shard_map`` + ``jit``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jaxdit.parallel.cfg import CFG_AXIS
from jaxdit.parallel.cfg import guidance as cfg_guidance
from jaxdit.parallel.layout import SequenceLayout
from jaxdit.parallel.pipefusion import PatchContext, PipeSchedule
from jaxdit.pipelines.pipefusion_stages import StagedModel

__all__ = ["StagePrograms"]


class StagePrograms:
    """The warm-up step and the pipelined phase for one geometry ``g``, compiled lazily.

    A subclass sets ``passes`` (V: passes over the stages per forward), passes its ``specs`` (name ->
    ``PartitionSpec``; ``"kv"`` is the K/V buffers') and defines ``buffer_shapes``, ``_build_warmup`` and
    ``_build_async``. ``guided``: the call runs classifier-free guidance (both branches in the batch).
    """

    passes: ClassVar[int]

    def __init__(
        self,
        model: StagedModel,
        g: Any,
        guided: bool,
        kernel: tuple,
        compiler_options: Mapping[str, Any] | None,
        specs: dict[str, PartitionSpec],
    ) -> None:
        self.model, self.g, self.guided, self.kernel = model, g, guided, kernel
        self.compiler_options = dict(compiler_options) if compiler_options else None
        self.parallel = model.parallel
        self.specs = specs
        self.shardings = {k: NamedSharding(model.mesh, s) for k, s in specs.items()}
        self._warmup = None
        self._zeros = None
        self._async: dict[tuple, Callable] = {}

    # ------------------------------------------------------------- shapes
    def buffer_shapes(self) -> list[tuple[int, ...]]:
        """The K/V buffers' shapes, in the order the programs take them."""
        raise NotImplementedError

    def zero_buffers(self) -> tuple[jax.Array, ...]:
        """The K/V buffers, zeroed, created on the devices that own them."""
        if self._zeros is None:
            shapes, dtype, sharding = self.buffer_shapes(), self.model.dtype, self.shardings["kv"]
            self._zeros = jax.jit(
                lambda: tuple(jnp.zeros(s, dtype) for s in shapes), out_shardings=(sharding,) * len(shapes)
            )
        return self._zeros()

    def sds(self, shape: tuple[int, ...], dtype: Any, key: str) -> jax.ShapeDtypeStruct:
        """An abstract argument placed as the spec named ``key``."""
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.shardings[key])

    def abstract_params(self) -> Any:
        """The parameters as ``jax.ShapeDtypeStruct`` with their shardings (for ``.lower``)."""
        mdl = self.model
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), mdl.state, mdl.param_shardings
        )

    def abstract_buffers(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        return tuple(self.sds(s, self.model.dtype, "kv") for s in self.buffer_shapes())

    def schedule(self, steps: int) -> PipeSchedule:
        return PipeSchedule(self.parallel.pipefusion, self.g.patches, self.passes, steps)

    # ------------------------------------------------------------- builds
    def warmup(self) -> Callable:
        if self._warmup is None:
            self._warmup = self._build_warmup()
        return self._warmup

    def asynchronous(self, *key: int) -> Callable:
        """The pipelined phase for ``key`` (``_build_async``'s arguments), built once."""
        if key not in self._async:
            self._async[key] = self._build_async(*key)
        return self._async[key]

    def _build_warmup(self) -> Callable:
        raise NotImplementedError

    def _build_async(self, *key: int) -> Callable:
        raise NotImplementedError

    # ------------------------------------------------------------- pieces (inside shard_map)
    def scan_slots(
        self,
        stack: tuple[nnx.GraphDef, nnx.State],
        carry: Any,
        call: Callable,
        layout: SequenceLayout,
        fresh_valid: jax.Array | None = None,
        stale_bufs: tuple[jax.Array, jax.Array] | None = None,
        stale_valid: jax.Array | None = None,
    ) -> tuple[Any, tuple[jax.Array, jax.Array]]:
        """Scan this device's slots of a stack (``nnx.split`` of it): ``call(block, carry, ctx)`` per
        slot, attention against the slot's stale buffer when ``stale_bufs`` (K, V [slots, B, M, L, h, D])
        are given. Returns the carry and each slot's fresh K/V."""
        graphdef, state = stack

        def body(c, xs):
            if stale_bufs is None:
                block_state, stale = xs, None
            else:
                block_state, kb, vb = xs
                flat = lambda b: b.reshape(b.shape[0], -1, *b.shape[3:])  # [B, M*L, h, D]
                stale = (flat(kb), flat(vb), stale_valid)
            ctx = PatchContext(self.parallel, layout, self.kernel, fresh_valid=fresh_valid, stale=stale)
            c = call(nnx.merge(graphdef, block_state), c, ctx)
            ((k, v),) = ctx.fresh
            return c, (k, v)

        xs = state if stale_bufs is None else (state, *stale_bufs)
        return lax.scan(body, carry, xs)

    def guide(self, pred: jax.Array, scale: jax.Array) -> jax.Array:
        """CFG over the local branches (cfg=1) or with the other cfg device's branch (cfg=2: one permute
        of this patch's prediction); the prediction as is without guidance."""
        if not self.guided:
            return pred
        if self.parallel.cfg == 1:
            uncond, cond = jnp.split(pred, 2, axis=0)
            return cfg_guidance(uncond, cond, scale)
        other = lax.ppermute(pred, CFG_AXIS, [(0, 1), (1, 0)])
        is_cond = lax.axis_index(CFG_AXIS) == 1
        return cfg_guidance(jnp.where(is_cond, other, pred), jnp.where(is_cond, pred, other), scale)

    def model_batch(self, x: jax.Array) -> jax.Array:
        # cfg=1 with guidance: this data shard's [uncond; cond] halves share the latent.
        return jnp.concatenate([x, x], 0) if self.guided and self.parallel.cfg == 1 else x

    # ------------------------------------------------------------- jit
    def jit(
        self, local: Callable, in_specs: tuple, out_specs: Any, donate_argnums: tuple[int, ...]
    ) -> Callable:
        """``local(params, *args)`` under ``shard_map`` over the model's mesh, jitted; ``in_specs`` are the
        specs of ``args`` (pytrees of ``PartitionSpec``), the parameters' come from the model."""
        mesh = self.model.mesh
        specs = (self.model.param_specs, *in_specs)
        fn = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)
        shard = lambda spec: NamedSharding(mesh, spec)
        is_spec = lambda x: isinstance(x, PartitionSpec)
        return jax.jit(
            fn,
            in_shardings=(self.model.param_shardings, *jax.tree.map(shard, in_specs, is_leaf=is_spec)),
            out_shardings=jax.tree.map(shard, out_specs, is_leaf=is_spec),
            donate_argnums=donate_argnums,
            compiler_options=self.compiler_options,
        )
