"""One jitted ``shard_map`` around a model's local-view forward: the generic glue FLUX and Wan share.

A model written as the local view of one shard (``model(..., ctx=ShardContext)``) becomes a global
function of global arrays here:

- parameters enter ``shard_map`` with PartitionSpecs from their logical axes and the rule table
  (replicated, or split over ``tensor``); nothing but the parameters' own shards is ever on a device;
- every input and the output declare logical axes (:class:`Arg`); "batch" lands on (data, cfg) and "seq"
  on (ring, ulysses) through the same rule table (``sharding_rules.ACTIVATIONS``), so this module is
  where "batch over (data, cfg), seq over (ring, ulysses)" happens;
- inputs whose "seq" axis belongs to a token group are padded to the group's shard-major layout
  (:class:`SequenceLayout`) before, and the output group is unpadded after. Padding happens outside the
  compiled step, so the step itself contains only the model's collectives.

Preconditions are checked before anything is traced: heads against ulysses x tensor, batch against
data x cfg, token-group lengths that agree between inputs, and no pipefusion (PipeFusion splits the stacked
layers over devices and needs its own runner; a plain forward needs every layer on every device).

:meth:`ShardedForward.step` is the compiled step on padded, sharded arrays, for denoising loops that
keep their latents in the padded layout across steps; :meth:`ShardedForward.lower` compiles it from
``jax.ShapeDtypeStruct`` parameters and inputs (full-size compiles without weights).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxdit.mesh import DeviceMesh, MeshLike, ParallelConfig
from jaxdit.models.partitioning import named_shardings, partition_specs
from jaxdit.models.staged import staged_forward
from jaxdit.parallel.context import ShardContext
from jaxdit.parallel.fsdp import shard_stacks
from jaxdit.parallel.kernels import check_kernel_options
from jaxdit.parallel.layout import SequenceLayout
from sharding_rules import logical_to_spec, rules_for

__all__ = ["Arg", "ShardedForward", "validate_batch", "validate_forward"]


@dataclasses.dataclass(frozen=True)
class Arg:
    """How one input (or the output) of a forward lies on the mesh.

    ``axes``: a logical name per dimension (e.g. ``("batch", "seq", None)``). ``group``: the token group
    whose length the "seq" dimension has; such arrays are padded to the group's shard-major layout.
    ``model_dtype``: features the model embeds (text, pooled, image features), placed in the model's
    dtype; other inputs (positions, timesteps, guidance) keep their own. ``key_mask``: a [batch, seq]
    bool mask of the group's real tokens per batch element (a family whose text tokens carry a mask:
    real prompt lengths). It is not handed to the model: it becomes the self-attention key mask of the
    model's :class:`ShardContext` (padded with False like the tokens), so every attention call, strategy
    and kernel masks those keys.
    """

    axes: tuple[str | None, ...]
    group: int | None = None
    model_dtype: bool = False
    key_mask: bool = False

    def __post_init__(self) -> None:
        if (self.group is not None) != ("seq" in self.axes):
            raise ValueError(f"Arg{self.axes}: a token group needs a 'seq' axis and vice versa")
        if self.key_mask and (self.axes != ("batch", "seq") or self.model_dtype):
            raise ValueError(f"Arg{self.axes}: a key mask is a [batch, seq] bool array of one token group")

    @property
    def seq_axis(self) -> int | None:
        return self.axes.index("seq") if "seq" in self.axes else None

    @property
    def batch_axis(self) -> int | None:
        return self.axes.index("batch") if "batch" in self.axes else None


def validate_batch(batch: int, config: ParallelConfig) -> None:
    """Raise unless the batch splits over data x cfg."""
    ways = config.data * config.cfg
    if batch % ways:
        valid = [d for d in range(1, batch + 1) if batch % d == 0]
        raise ValueError(
            f"batch {batch} cannot be split over data={config.data} x cfg={config.cfg} = {ways}; "
            f"data x cfg must divide the batch (divisors of {batch}: {', '.join(map(str, valid))}); "
            f"cfg=2 needs the conditional and unconditional halves stacked in one batch"
        )


def validate_forward(config: ParallelConfig, num_heads: int) -> None:
    """Raise unless a plain (non-pipelined) forward of a model with ``num_heads`` heads runs on ``config``.

    Cheap and weight-free: loaders call it before reading a checkpoint.
    """
    if config.pipefusion > 1:
        raise ValueError(
            f"pipefusion={config.pipefusion}: PipeFusion splits the stacked layers over devices and needs "
            "the pipeline runner; a plain forward needs every layer on every device "
            "(put the devices on ring/ulysses/tensor/cfg/data instead)"
        )
    config.validate_heads(num_heads)


def _pad(x: Any, layout: SequenceLayout, group: int, axis: int) -> Any:
    if isinstance(x, np.ndarray):
        return layout.pad(x, group, axis=axis)
    return layout.pad(jnp.asarray(x), group, axis=axis)


class ShardedForward:
    """A model's local-view forward as one jitted ``shard_map`` over a mesh.

    Args:
      model: an ``nnx.Module`` (its parameters already placed, or abstract ``ShapeDtypeStruct``s for
        :meth:`lower`), or a ``(graphdef, state)`` pair from ``nnx.split``.
      mesh: a mesh from ``ParallelConfig.make_mesh``, or a ``DeviceMesh`` (its degrees then come with it).
      inputs: name -> :class:`Arg`, in the order ``body`` takes them. An input passed as ``None`` is
        left out (e.g. FLUX-schnell's guidance).
      output: the :class:`Arg` of the result.
      body: ``body(model, ctx, **local_inputs) -> local output``, run inside ``shard_map``.
      num_heads: checked against ulysses x tensor before anything is compiled.
      rules: logical -> mesh axes; default ``rules_for(tensor=..., pipefusion=...)`` of the mesh.
      kernel: local attention kernel options: ``backend`` (auto, xla, cudnn, triton, splash), the XLA
        kernel's tiles ``block_q``/``block_k`` (see ``jaxdit.parallel.kernels``).
      compiler_options: XLA options for compiling the step (``jax.jit(compiler_options=...)``), e.g.
        ``{"xla_backend_optimization_level": 0}`` for quick test compiles on CPU.
    """

    def __init__(
        self,
        model: nnx.Module | tuple[nnx.GraphDef, nnx.State],
        mesh: MeshLike,
        *,
        inputs: Mapping[str, Arg],
        output: Arg,
        body: Callable[..., jax.Array],
        num_heads: int,
        rules: Mapping[str, object] | None = None,
        kernel: Mapping[str, Any] | None = None,
        compiler_options: Mapping[str, Any] | None = None,
    ) -> None:
        check_kernel_options(kernel)
        #: The mesh and its degrees, passed on to the denoiser (``config`` is ``device_mesh.parallel``).
        self.device_mesh = DeviceMesh.of(mesh)
        self.config = self.device_mesh.parallel
        validate_forward(self.config, num_heads)
        self.mesh = mesh = self.device_mesh.mesh
        self.rules = rules if rules is not None else rules_for(tensor=self.config.tensor)
        if isinstance(model, tuple):
            self.graphdef, self.state = model
        else:
            self.graphdef, self.state = nnx.split(model)
        self.inputs = dict(inputs)
        self.output = output
        self.body = body
        self.kernel = tuple(sorted((kernel or {}).items()))
        self.compiler_options = dict(compiler_options) if compiler_options else None
        specs = partition_specs(self.state, self.rules)
        #: Under fsdp: the stacked weights also split over the fsdp axes, and the scan's gathers.
        self.param_specs, self.gathers = shard_stacks(self.state, specs, self.config)
        self.param_shardings = named_shardings(self.state, self.rules, mesh, self.config)
        self._steps: dict[tuple, Callable] = {}

    # ---------------------------------------------------------------- shapes
    def spec(self, arg: Arg) -> PartitionSpec:
        return logical_to_spec(arg.axes, self.rules)

    def sharding(self, arg: Arg) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(arg))

    def layout(self, shapes: Mapping[str, tuple[int, ...] | None]) -> SequenceLayout:
        """The token layout for inputs of these (unpadded) shapes; checks batch and group lengths."""
        lengths: dict[int, tuple[int, str]] = {}
        batch: tuple[int, str] | None = None
        for name, arg in self.inputs.items():
            shape = shapes.get(name)
            if shape is None:
                continue
            if len(shape) != len(arg.axes):
                raise ValueError(f"{name} has shape {tuple(shape)}; expected {len(arg.axes)} dims {arg.axes}")
            if arg.group is not None:
                n = shape[arg.seq_axis]
                if arg.group in lengths and lengths[arg.group][0] != n:
                    other = lengths[arg.group]
                    raise ValueError(
                        f"{name} has {n} tokens but {other[1]} has {other[0]} (same token group)"
                    )
                lengths.setdefault(arg.group, (n, name))
            if arg.batch_axis is not None:
                b = shape[arg.batch_axis]
                if batch is not None and batch[0] != b:
                    raise ValueError(f"{name} has batch {b} but {batch[1]} has batch {batch[0]}")
                batch = batch or (b, name)
        groups = sorted(lengths)
        if groups != list(range(len(groups))):
            raise ValueError(f"token groups {groups} are not numbered 0..n-1")
        if batch is not None:
            validate_batch(batch[0], self.config)
        return SequenceLayout(tuple(lengths[g][0] for g in groups), self.config.sequence_degree)

    def _padded_shape(self, shape: tuple[int, ...], arg: Arg, layout: SequenceLayout) -> tuple[int, ...]:
        if arg.group is None:
            return tuple(shape)
        out = list(shape)
        out[arg.seq_axis] = layout.padded_lengths[arg.group]
        return tuple(out)

    # ------------------------------------------------------------------ step
    def bind(self, ctx: ShardContext, names: tuple[str, ...], args: tuple) -> tuple[ShardContext, dict]:
        """Inside ``shard_map``: the local inputs ``args`` (named ``names``) -> the context the model sees
        (with the key masks of :attr:`Arg.key_mask` inputs, gathered once) and the model's other inputs."""
        inputs = dict(zip(names, args, strict=True))
        masks = [None] * len(ctx.layout.lengths)
        for name in names:
            arg = self.inputs[name]
            if arg.key_mask:
                masks[arg.group] = inputs.pop(name)
        return ctx.with_key_mask(masks), inputs

    def step(self, layout: SequenceLayout, names: tuple[str, ...]) -> Callable:
        """The compiled step ``fn(state, *padded_inputs)`` for ``layout`` and the inputs ``names`` present.

        Inputs and output are global arrays padded to ``layout`` and sharded as their :class:`Arg`\\ s say.
        """
        key = (layout, names)
        if key not in self._steps:
            ctx = ShardContext(self.config, layout, self.kernel, gathers=self.gathers)
            graphdef, body = self.graphdef, self.body

            def local(state, *args):
                model = nnx.merge(graphdef, state)
                local_ctx, inputs = self.bind(ctx, names, args)
                return body(model, local_ctx, **inputs)

            in_specs = (self.param_specs,) + tuple(self.spec(self.inputs[n]) for n in names)
            sharded = jax.shard_map(
                local, mesh=self.mesh, in_specs=in_specs, out_specs=self.spec(self.output), check_vma=False
            )
            self._steps[key] = jax.jit(
                sharded,
                in_shardings=(self.param_shardings,) + tuple(self.sharding(self.inputs[n]) for n in names),
                out_shardings=self.sharding(self.output),
                compiler_options=self.compiler_options,
            )
        return self._steps[key]

    def carry_step(
        self, layout: SequenceLayout, names: tuple[str, ...], body: Callable[..., Any], carry_specs: Any
    ) -> Callable:
        """:meth:`step` with a state carried in and out: ``fn(state, carry, *padded_inputs) -> (output,
        carry)``, where ``body(model, ctx, carry, **local_inputs) -> (local output, local carry)`` runs
        inside the same ``shard_map`` and ``carry_specs`` (a pytree of PartitionSpecs matching the carry)
        lays the carry out on the mesh. Feature caches (``jaxdit.cache``) keep their state this way.
        Not memoized: the caller's own jitted step holds it.
        """
        ctx = ShardContext(self.config, layout, self.kernel, gathers=self.gathers)
        graphdef = self.graphdef

        def local(state, carry, *args):
            local_ctx, inputs = self.bind(ctx, names, args)
            return body(nnx.merge(graphdef, state), local_ctx, carry, **inputs)

        in_specs = (self.param_specs, carry_specs) + tuple(self.spec(self.inputs[n]) for n in names)
        return jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=in_specs,
            out_specs=(self.spec(self.output), carry_specs),
            check_vma=False,
        )

    def __call__(self, **inputs: Any) -> jax.Array:
        """Global inputs (numpy or jax, unpadded) -> global output (unpadded)."""
        unknown = set(inputs) - set(self.inputs)
        if unknown:
            raise TypeError(f"unexpected inputs {sorted(unknown)}; expected {list(self.inputs)}")
        present = {n: inputs[n] for n in self.inputs if inputs.get(n) is not None}
        layout = self.layout({n: tuple(np.shape(x)) for n, x in present.items()})
        args = []
        for name, x in present.items():
            arg = self.inputs[name]
            if arg.group is not None:
                x = _pad(x, layout, arg.group, arg.seq_axis)
            args.append(jax.device_put(x, self.sharding(arg)))
        out = self.step(layout, tuple(present))(self.state, *args)
        if self.output.group is not None:
            out = layout.unpad(out, self.output.group, axis=self.output.seq_axis)
        return out

    def lower(
        self, *, lowering_platforms: tuple[str, ...] | None = None, **inputs: jax.ShapeDtypeStruct | None
    ) -> jax.stages.Lowered:
        """Lower the step from abstract (unpadded) inputs and this object's (possibly abstract) state;
        ``lowering_platforms`` (e.g. ``("cuda",)``) lowers for another platform than this host's."""
        present = {n: inputs[n] for n in self.inputs if inputs.get(n) is not None}
        layout = self.layout({n: tuple(x.shape) for n, x in present.items()})
        args = [
            jax.ShapeDtypeStruct(
                self._padded_shape(tuple(x.shape), self.inputs[n], layout),
                x.dtype,
                sharding=self.sharding(self.inputs[n]),
            )
            for n, x in present.items()
        ]
        state = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.state, self.param_shardings
        )
        return (
            self.step(layout, tuple(present)).trace(state, *args).lower(lowering_platforms=lowering_platforms)
        )

    # ----------------------------------------------------------------- sizes
    def param_bytes_per_device(self) -> int:
        """Bytes of parameters one device holds under the rule table."""
        total = 0
        for x, s in zip(jax.tree.leaves(self.state), jax.tree.leaves(self.param_shardings), strict=True):
            shard = s.shard_shape(tuple(x.shape))
            total += math.prod(shard) * jnp.dtype(x.dtype).itemsize
        return total


def _staged_body(model: Any, ctx: ShardContext, **inputs: jax.Array) -> jax.Array:
    return staged_forward(model, inputs, ctx)


def sharded_staged(
    model: Any,
    mesh: MeshLike,
    inputs: Mapping[str, Arg],
    output: Arg,
    *,
    rules: Mapping[str, object] | None = None,
    kernel: Mapping[str, int] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> ShardedForward:
    """A staged transformer's whole forward (``jaxdit.models.staged``: embed -> every stack -> output) as
    one :class:`ShardedForward` called with the family's ``inputs`` / ``output`` (diffusers' argument
    names): what every family's ``sharded`` is. ``model`` may be abstract, for :meth:`ShardedForward.lower`."""
    return ShardedForward(
        model,
        mesh,
        inputs=inputs,
        output=output,
        body=_staged_body,
        num_heads=model.config.num_heads,
        rules=rules,
        kernel=kernel,
        compiler_options=compiler_options,
    )
