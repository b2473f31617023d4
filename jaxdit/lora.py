"""LoRAs fused into a transformer's weights where they lie on the device mesh, and taken out again.

``W <- W + sum_k scale_k * (alpha_k / rank_k) * a_k @ b_k`` (Hu et al., arXiv 2106.09685) for every
parameter the LoRAs touch, as MaxDiffusion merges on device with jit and PEFT's ``merge`` does on one:

- Each device computes only its own slice. A parameter's update runs in ``shard_map`` with the
  parameter's own PartitionSpec, the factors sliced along the same axes (``a`` [in, r] like the kernel's
  input axis, ``b`` [r, out] like its output axis, both like the stack's layer axis); the rank axis is
  never split, so the program has no collective and no device ever holds another's slice. Tensor
  parallel (heads and MLP over ``tensor``), stacked (scanned) blocks and PipeFusion's layer split all come
  from the parameter's own sharding.
- Precision: ``a @ b`` in fp32 (``Precision.HIGHEST``, no TF32), added to the weight in fp32, the sum cast
  to the parameter's own dtype (bf16 weights; Wan keeps its time embedding fp32).
- Memory: one parameter at a time: its factors (all layers of a stack, this device's slice) come to the
  device, the weight is donated and updated in place one local layer at a time (a ``fori_loop``), so a
  device holds its own slice of the model, one parameter's factors and one layer's fp32 temporaries
  (:func:`fuse_memory` reads this from the compiled programs). XLA:CPU widens a bf16
  dynamic-update-slice to fp32, which costs a copy of the parameter's slice there; fp32 updates in place.
- Stacks: a LoRA on block i updates layer i of the stacked parameter. In PipeFusion's stage layout
  (``StagedModel``: P x ceil(L/P) slots, padded with zeros) pass its ``stack_orders`` (slot -> layer): the
  update of layer i goes to the slot holding layer i, padded slots stay exactly zero.
- Several LoRAs at once, each with its own scale: factors side by side along the rank axis, one pass.
  Ranks are padded with zeros to a multiple of 16 so that LoRAs of other ranks reuse compiled programs.

Switching: :func:`unfuse_loras` subtracts the same update computed the same way (same program, factors
negated, which is exact), and :func:`switch_loras` takes the old set out and puts the new one in with one
pass (one rounding). No copy of the base weights is kept: that would be a second model's worth of memory
held only for undo. The price is rounding: fuse then unfuse gives each weight back within one rounding
of the fused weight's dtype (measured in tests/test_lora_fuse.py), and repeated switches can drift by
that much each time; reload the checkpoint if bit-exact base weights matter. Shapes, dtypes and
shardings never change, so a compiled denoising step keeps running without recompiling.

Wan 2.2's two experts are two models: call once per model's state, with the files meant for it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from converters.lora import DeltaUpdate, LoraError, LoraFile, LowRankUpdate, read_lora
from jaxdit.distributed import fetch

__all__ = [
    "FuseCost",
    "FusedLoras",
    "fuse_cost",
    "fuse_loras",
    "fuse_memory",
    "parse_lora",
    "read_loras",
    "switch_loras",
    "unfuse_loras",
]

PathLike = str | os.PathLike[str]
LoraArg = PathLike | LoraFile | tuple[PathLike | LoraFile, float]
Options = tuple[tuple[str, Any], ...]
#: Ranks are padded to a multiple of this (zeros add exactly nothing) so programs are reused across LoRAs.
RANK_STEP = 16
#: A stack whose fp32 update on one device is at most this is updated in one matmul; a bigger one one
#: layer at a time (a ``fori_loop``, so temporaries are one layer's), which costs more to compile.
WHOLE_STACK_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class FusedLoras:
    """LoRAs fused into a state ((file, scale) each), with what :func:`unfuse_loras` needs to take them
    out the same way: the stack layout and the compiler options of the programs."""

    loras: tuple[tuple[LoraFile, float], ...]
    stack_orders: Mapping[str, np.ndarray] | None = None
    compiler_options: Options = ()

    def negated(self) -> list[tuple[LoraFile, float]]:
        return [(lora, -scale) for lora, scale in self.loras]


@dataclasses.dataclass(frozen=True)
class FuseCost:
    """One parameter's fuse program, per device: memory from XLA's analysis of the compiled program,
    traffic and arithmetic counted from the shapes (XLA's cost analysis counts a loop body once)."""

    target: str
    weight: int  # bytes of this device's slice of the parameter (donated: the output lives in it)
    factors: int  # bytes of this device's slice of the factors / full deltas
    temp: int  # bytes of temporaries
    extra_output: int  # bytes of output not aliased to the donated weight (0 when updated in place)
    flops: int  # 2 x rank per weight element (the matmul), + 1 per element (the add)

    @property
    def extra(self) -> int:
        """Bytes the program needs beyond the weight's own slice: factors + temporaries + unaliased output."""
        return self.factors + self.temp + self.extra_output

    @property
    def bytes_moved(self) -> int:
        """Memory traffic: the weight read and written once, the factors read once."""
        return 2 * self.weight + self.factors


# --------------------------------------------------------------------------------------------------------
# API
# --------------------------------------------------------------------------------------------------------


def parse_lora(arg: str, flag: str = "--lora") -> tuple[str, float]:
    """``FILE`` or ``FILE:SCALE`` -> (FILE, SCALE); a colon inside the path is kept (the scale is what
    follows the last one when it is a number, or when the whole is no file but what precedes it is).
    ``flag``: the option the text came from, for the error messages."""
    path, sep, scale = arg.rpartition(":")
    if not sep:
        return arg, 1.0
    try:
        value = float(scale)
    except ValueError:
        if Path(path).is_file() and not Path(arg).exists():
            raise ValueError(f"{flag} {arg}: the scale {scale!r} is not a number") from None
        return arg, 1.0
    if not math.isfinite(value):
        raise ValueError(f"{flag} {arg}: the scale {scale} is not a finite number")
    return path, value


def read_loras(loras: Sequence[LoraArg], config: Any) -> list[tuple[LoraFile, float]]:
    """Read and check LoRAs for ``config``'s model: paths or :class:`LoraFile`\\ s, alone (scale 1) or as
    ``(lora, scale)``. Nothing touches a device; errors name the file and the key."""
    out = []
    for item in loras:
        source, scale = item if isinstance(item, tuple) else (item, 1.0)
        lora = source if isinstance(source, LoraFile) else read_lora(source, config)
        if not math.isfinite(scale):
            raise ValueError(f"{lora.path}: scale {scale} is not finite")
        out.append((lora, float(scale)))
    return out


def fuse_loras(
    state: nnx.State | nnx.Module,
    config: Any,
    loras: Sequence[LoraArg],
    *,
    stack_orders: Mapping[str, np.ndarray] | None = None,
    donate: bool = True,
    compiler_options: Mapping[str, Any] | None = None,
) -> FusedLoras:
    """Fuse LoRAs into the parameters of ``state`` (a model's ``nnx.State``, or the model) on its mesh, in
    place, and return the handle :func:`unfuse_loras` and :func:`switch_loras` take.

    ``config``: the model's ``FluxConfig`` / ``WanConfig``. ``loras``: paths or :class:`LoraFile`\\ s, each
    alone (scale 1) or as ``(lora, scale)``. ``stack_orders``: slot -> layer of each stack for PipeFusion's
    stage layout (``StagedModel.orders``); None when stacks hold their layers in order. ``donate``: update
    weights in place (the old arrays are deleted: holders of the state see the new values through its
    variables, as models sharing them with ``nnx.split`` do); False keeps the old arrays alive, at the
    cost of a second copy of each weight while it is updated. ``compiler_options``: XLA options of the
    programs (e.g. ``{"xla_backend_optimization_level": 0}`` for quick CPU compiles).

    Every file is read and checked, and every update checked against the state's shapes, before the
    first weight changes; if a device program fails part-way, the parameters already changed are put
    back before the error is raised.
    """
    terms = read_loras(loras, config)
    options = tuple(sorted((compiler_options or {}).items()))
    _apply(state, terms, stack_orders, donate, options)
    check_fused_finite(state, terms)
    return FusedLoras(tuple(terms), stack_orders, options)


def check_fused_finite(state: nnx.State | nnx.Module, terms: Sequence[tuple[LoraFile, float]]) -> None:
    """Raise ValueError naming the LoRA files (and scales) whose fused weights overflowed the weights'
    dtype (a finite file can still overflow once scaled: alpha 1e38, values x 1e18, a scale of 1e30, or
    float16 weights), rather than let the run stop at its first step blaming the checkpoint."""
    flat = _flat(state)
    owners: dict[str, list[tuple[LoraFile, float]]] = {}
    for lora, scale in terms:
        for update in lora.updates:
            owners.setdefault(update.target, []).append((lora, scale))
    finite = jax.jit(lambda x: jnp.isfinite(x).all())
    broken = [t for t in sorted(owners) if t in flat and not bool(fetch(finite(_value(flat[t]))))]
    if not broken:
        return
    culprits = {(str(lora.path), scale) for t in broken for lora, scale in owners[t]}
    named = ", ".join(f"{path} x {scale:g}" for path, scale in sorted(culprits))
    dtype = jnp.dtype(_value(flat[broken[0]]).dtype).name
    raise ValueError(
        f"fusing the LoRA {named} made {len(broken)} weight(s) non-finite in {dtype} (first: {broken[0]}): "
        "its values, alpha or scale overflow the weights; lower the scale or check the file. The weights "
        "now hold those values: load the model again before using it"
    )


def unfuse_loras(state: nnx.State | nnx.Module, fused: FusedLoras, *, donate: bool = True) -> None:
    """Subtract what :func:`fuse_loras` added: the same updates, computed by the same programs, negated."""
    _apply(state, fused.negated(), fused.stack_orders, donate, fused.compiler_options)


def switch_loras(
    state: nnx.State | nnx.Module,
    config: Any,
    fused: FusedLoras | None,
    loras: Sequence[LoraArg],
    *,
    stack_orders: Mapping[str, np.ndarray] | None = None,
    donate: bool = True,
    compiler_options: Mapping[str, Any] | None = None,
) -> FusedLoras:
    """Replace the fused ``fused`` (None: nothing fused) by ``loras`` in one pass over the weights.

    The new files are read and checked before anything changes. The stack layout and compiler options
    are ``fused``'s when given, else the arguments.
    """
    new = read_loras(loras, config)
    if fused is not None:
        stack_orders, options = fused.stack_orders, fused.compiler_options
    else:
        options = tuple(sorted((compiler_options or {}).items()))
    _apply(state, (fused.negated() if fused is not None else []) + new, stack_orders, donate, options)
    return FusedLoras(tuple(new), stack_orders, options)


def fuse_memory(
    state: nnx.State | nnx.Module,
    config: Any,
    loras: Sequence[LoraArg],
    *,
    stack_orders: Mapping[str, np.ndarray] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> list[FuseCost]:
    """Compile, without running, the fuse program of every parameter these LoRAs touch; per-device costs.

    ``state`` may hold ``jax.ShapeDtypeStruct``\\ s with shardings instead of arrays.
    """
    options = tuple(sorted((compiler_options or {}).items()))
    jobs = _plan(_flat(state), read_loras(loras, config), stack_orders)
    return [job.cost(options) for job in jobs]


def fuse_cost(
    state: nnx.State | nnx.Module, rank: int, *, compiler_options: Mapping[str, Any] | None = None
) -> list[FuseCost]:
    """Per-device cost of fusing a rank-``rank`` LoRA into every 2-D kernel (stacked or not) of ``state``,
    from programs compiled on shapes alone: an estimate for a full-size model without its weights.

    ``state`` holds arrays or ``jax.ShapeDtypeStruct``\\ s with shardings (e.g. an abstract model's state
    with ``named_shardings``). A fuse is bound by memory traffic: it takes about
    ``sum(bytes_moved) / memory bandwidth`` per device (each weight read and written once; its arithmetic,
    2 x rank flops per weight element, is small next to that), plus the programs' first compile and the
    host-to-device copy of the factors.
    """
    options = tuple(sorted((compiler_options or {}).items()))
    out = []
    for target, var in _flat(state).items():
        shape = tuple(_value(var).shape)
        stacked = target.split(".", 1)[0] in _stacks(state)
        if not target.endswith("kernel") or len(shape) != 2 + stacked:
            continue
        lead = shape[:1] if stacked else ()
        a = jax.ShapeDtypeStruct(lead + (shape[-2], _padded_rank(rank)), jnp.float32)
        b = jax.ShapeDtypeStruct(lead + (_padded_rank(rank), shape[-1]), jnp.float32)
        out.append(_Job(target, var, stacked, a, b, None).cost(options))
    return out


# --------------------------------------------------------------------------------------------------------
# One parameter's update
# --------------------------------------------------------------------------------------------------------


def _flat(state: nnx.State | nnx.Module) -> dict[str, nnx.Variable]:
    if isinstance(state, nnx.Module):
        state = nnx.state(state, nnx.Param)
    return {".".join(map(str, path)): var for path, var in nnx.to_flat_state(state)}


def _stacks(state: nnx.State | nnx.Module) -> set[str]:
    """Names of the stacked block containers (their parameters carry a leading "layers" axis)."""
    flat = _flat(state)
    return {
        t.split(".", 1)[0]
        for t, v in flat.items()
        if len(v.get_metadata().get("logical_axes", ())) + 1 == len(_value(v).shape)
    }


def _value(var: nnx.Variable) -> Any:
    return var.get_value()


def _padded_rank(rank: int) -> int:
    return max(RANK_STEP, -(-rank // RANK_STEP) * RANK_STEP)


def _full_spec(spec: PartitionSpec, ndim: int) -> PartitionSpec:
    return PartitionSpec(*(tuple(spec) + (None,) * (ndim - len(spec))))


def _factor_specs(spec: PartitionSpec, stacked: bool) -> tuple[PartitionSpec, PartitionSpec]:
    """a [(L,) in, r] split like the kernel's input (and layer) axis, b [(L,) r, out] like its output."""
    if stacked:
        layers, d_in, d_out = spec
        return PartitionSpec(layers, d_in, None), PartitionSpec(layers, None, d_out)
    d_in, d_out = spec
    return PartitionSpec(d_in, None), PartitionSpec(None, d_out)


@dataclasses.dataclass
class _Job:
    """One parameter and what to add to it: ``a @ b`` per layer (slot) and/or the full delta ``d``."""

    target: str
    var: nnx.Variable
    stacked: bool
    a: Any  # [(slots,) in, R] fp32, or None
    b: Any  # [(slots,) R, out] fp32, or None
    d: Any  # the parameter's shape, fp32, or None

    @property
    def sharding(self) -> NamedSharding:
        sharding = getattr(_value(self.var), "sharding", None)
        if not isinstance(sharding, NamedSharding):
            raise TypeError(
                f"{self.target}: expected a parameter placed with a NamedSharding, got {sharding}"
            )
        return sharding

    @property
    def spec(self) -> PartitionSpec:
        return _full_spec(self.sharding.spec, len(_value(self.var).shape))

    def inputs(self) -> list[tuple[Any, NamedSharding]]:
        """(array, sharding) of the factors and the delta."""
        mesh, out = self.sharding.mesh, []
        if self.a is not None:
            a_spec, b_spec = _factor_specs(self.spec, self.stacked)
            out += [(self.a, NamedSharding(mesh, a_spec)), (self.b, NamedSharding(mesh, b_spec))]
        if self.d is not None:
            out.append((self.d, NamedSharding(mesh, self.spec)))
        return out

    def program(self, donate: bool, options: Options):
        local = self.sharding.shard_shape(tuple(_value(self.var).shape))
        by_layer = self.stacked and math.prod(local) * 4 > WHOLE_STACK_BYTES
        return _program(
            self.sharding.mesh,
            self.spec,
            self.stacked,
            by_layer,
            self.a is not None,
            self.d is not None,
            donate,
            options,
        )

    def abstract(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        value = _value(self.var)
        out = [jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=self.sharding)]
        return tuple(out + [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in self.inputs()])

    def compiled(self, donate: bool, options: Options) -> jax.stages.Compiled:
        return _compiled(self.program(donate, options), self.abstract())

    def run(self, donate: bool, options: Options) -> None:
        args = [jax.device_put(x, s) for x, s in self.inputs()]
        self.var.set_value(self.compiled(donate, options)(_value(self.var), *args))

    def negated(self) -> _Job:
        neg = lambda x: None if x is None else -x
        return dataclasses.replace(self, b=neg(self.b), d=neg(self.d))

    def cost(self, options: Options) -> FuseCost:
        value = _value(self.var)
        compiled = self.compiled(True, options)
        memory = compiled.memory_analysis()
        per_device = lambda x, s: math.prod(s.shard_shape(tuple(x.shape))) * jnp.dtype(x.dtype).itemsize
        elements = math.prod(self.sharding.shard_shape(tuple(value.shape)))
        rank = 0 if self.a is None else self.a.shape[-1]
        return FuseCost(
            target=self.target,
            weight=per_device(value, self.sharding),
            factors=sum(per_device(x, s) for x, s in self.inputs()),
            temp=memory.temp_size_in_bytes,
            extra_output=memory.output_size_in_bytes - memory.alias_size_in_bytes,
            flops=elements * (2 * rank + 1),
        )


@functools.lru_cache(maxsize=256)
def _compiled(program: Any, abstract: tuple[jax.ShapeDtypeStruct, ...]) -> jax.stages.Compiled:
    """One compile per program and shapes, shared by running and by the cost reports."""
    return program.lower(*abstract).compile()


@functools.lru_cache(maxsize=256)
def _program(
    mesh: jax.sharding.Mesh,
    spec: PartitionSpec,
    stacked: bool,
    by_layer: bool,
    low_rank: bool,
    full: bool,
    donate: bool,
    options: Options,
):
    """The jitted update of one parameter sharded as ``spec``: W + a @ b (+ d) in fp32, per device.

    ``stacked``: the parameter has a leading layer axis; ``by_layer``: update one local layer at a time.
    """

    def add(w: jax.Array, a: jax.Array | None, b: jax.Array | None, d: jax.Array | None) -> jax.Array:
        total = w.astype(jnp.float32)
        if a is not None:
            total = total + jnp.matmul(
                a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
            )
        if d is not None:
            total = total + d
        return total.astype(w.dtype)

    def local(w: jax.Array, *args: jax.Array) -> jax.Array:
        a, b = (args[0], args[1]) if low_rank else (None, None)
        d = args[-1] if full else None
        if not by_layer:
            return add(w, a, b, d)  # a stack's matmul is batched over its layers
        pick = lambda x, i: None if x is None else lax.dynamic_index_in_dim(x, i, keepdims=False)

        def layer(i, w):  # one local layer at a time: the fp32 temporaries are one layer's slice
            return lax.dynamic_update_index_in_dim(
                w, add(pick(w, i), pick(a, i), pick(b, i), pick(d, i)), i, 0
            )

        return lax.fori_loop(0, w.shape[0], layer, w)

    specs = [spec] + (list(_factor_specs(spec, stacked)) if low_rank else []) + ([spec] if full else [])
    sharded = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=spec, check_vma=False)
    return jax.jit(
        sharded,
        in_shardings=tuple(NamedSharding(mesh, s) for s in specs),
        out_shardings=NamedSharding(mesh, spec),
        donate_argnums=(0,) if donate else (),
        compiler_options=dict(options) or None,
    )


# --------------------------------------------------------------------------------------------------------
# Planning: every check before any device work
# --------------------------------------------------------------------------------------------------------


def _slots(target: str, length: int, orders: Mapping[str, np.ndarray] | None) -> dict[int, int]:
    """Layer -> slot of a stacked parameter with ``length`` slots."""
    stack = target.split(".", 1)[0]
    if orders is None or stack not in orders:
        return {i: i for i in range(length)}
    order = np.asarray(orders[stack])
    if len(order) != length:
        raise ValueError(f"the stack order of {stack!r} has {len(order)} slots, but {target} has {length}")
    return {int(layer): slot for slot, layer in enumerate(order) if layer >= 0}


def _plan(
    flat: Mapping[str, nnx.Variable],
    terms: Sequence[tuple[LoraFile, float]],
    orders: Mapping[str, np.ndarray] | None,
) -> list[_Job]:
    by_target: dict[str, list[tuple[LowRankUpdate | DeltaUpdate, float, LoraFile]]] = {}
    for lora, scale in terms:
        for update in lora.updates:
            by_target.setdefault(update.target, []).append((update, scale, lora))
    jobs = []
    for target, updates in by_target.items():
        if target not in flat:
            raise LoraError(f"{updates[0][2].path}: updates {target}, which the model's state does not have")
        job = _job(target, flat[target], updates, orders)
        job.sharding  # noqa: B018  (a parameter that is not on a mesh fails here, before any work)
        jobs.append(job)
    return jobs


def _job(
    target: str,
    var: nnx.Variable,
    updates: Sequence[tuple[LowRankUpdate | DeltaUpdate, float, LoraFile]],
    orders: Mapping[str, np.ndarray] | None,
) -> _Job:
    shape = tuple(_value(var).shape)
    stacked = updates[0][0].layer is not None
    slots = _slots(target, shape[0], orders) if stacked else {}
    layer_shape = shape[1:] if stacked else shape
    pairs: dict[Any, list[tuple[np.ndarray, np.ndarray]]] = {}
    d = None
    for update, scale, lora in updates:
        where = f"{lora.path}: {update.key!r} -> {target}"
        at: Any = ...
        if stacked:
            if update.layer not in slots:
                raise LoraError(
                    f"{where}: layer {update.layer} is not one of the model's {len(slots)} layers"
                )
            at = slots[update.layer]
        if isinstance(update, LowRankUpdate):
            if len(layer_shape) != 2 or (update.a.shape[0], update.b.shape[1]) != layer_shape:
                raise LoraError(
                    f"{where}: an update of shape ({update.a.shape[0]}, {update.b.shape[1]}) for a parameter "
                    f"of shape {layer_shape}"
                )
            pairs.setdefault(at, []).append((update.a, update.b * np.float32(scale)))
        else:
            if update.delta.shape != layer_shape:
                raise LoraError(
                    f"{where}: a delta of shape {update.delta.shape} for a parameter of {layer_shape}"
                )
            d = np.zeros(shape, np.float32) if d is None else d
            d[at] += update.delta * np.float32(scale)
    a = b = None
    if pairs:  # every layer's LoRAs side by side along the rank axis, zero-padded to one rank
        rank = _padded_rank(max(sum(x.shape[1] for x, _ in p) for p in pairs.values()))
        lead = shape[:1] if stacked else ()
        a = np.zeros(lead + (layer_shape[0], rank), np.float32)
        b = np.zeros(lead + (rank, layer_shape[1]), np.float32)
        for at, p in pairs.items():
            used = sum(x.shape[1] for x, _ in p)
            a[at][..., :used] = np.concatenate([x for x, _ in p], axis=1)
            b[at][:used] = np.concatenate([y for _, y in p], axis=0)
    return _Job(target, var, stacked, a, b, d)


def _apply(
    state: nnx.State | nnx.Module,
    terms: Sequence[tuple[LoraFile, float]],
    orders: Mapping[str, np.ndarray] | None,
    donate: bool,
    options: Options,
) -> None:
    jobs = _plan(_flat(state), terms, orders)
    done: list[_Job] = []
    try:
        for job in jobs:
            job.run(donate, options)
            done.append(job)
    except Exception:
        for job in reversed(done):  # put back what was already changed, then report the failure
            job.negated().run(donate, options)
        raise
