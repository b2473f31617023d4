"""The denoising loop every family shares: replicate branches -> sharded forward -> CFG -> sampler step.

One denoising step is ONE jitted program on the mesh: the guidance branches are laid out over ``cfg``
without communication (``parallel/cfg.py``), the family's sharded forward runs (``ShardedForward``), the
branches are combined with the step's single exchange of one prediction, and the sampler (the
:class:`~jaxdit.samplers.sampler.Sampler` protocol: Euler for FLUX, UniPC for Wan) updates the latent
tokens. The tokens and the sampler state stay on the devices, padded to the mesh's shard-major token
layout and sharded as ("request", "seq", None), for the whole loop: no step makes a host round trip.

What differs between families is data, not control flow:

- the forward's inputs (``ShardedForward.inputs``: which arrays, which token group the latent tokens
  belong to, which are cast to the model's dtype);
- :class:`TokenHooks`: how latent tokens become the model's ``hidden_states`` (Wan I2V concatenates the
  condition channels, Wan 2.2 TI2V puts its first frame in place) and how its prediction becomes a token
  update (Wan's head writes each token's features in another order than its patch embedding reads them);
- which parameters and guidance scale each step uses (Wan 2.2 A14B's two experts:
  ``DenoiseInputs.experts`` / ``scales``), arguments of the one compiled step.

:class:`DenoiseInputs` is what a pipeline hands over: unpadded host arrays. ``Denoiser.run`` pads and
places them once, runs the steps and returns the final tokens; ``Denoiser.lower`` compiles the same step
from abstract shapes (``jaxdit plan --verify``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxdit.models.sharded_forward import ShardedForward
from jaxdit.parallel.cfg import combine_branches, replicate_branches
from jaxdit.parallel.layout import SequenceLayout
from jaxdit.samplers.sampler import Sampler
from sharding_rules import logical_to_spec

__all__ = [
    "LATENT_AXES",
    "DenoiseInputs",
    "DenoiseResult",
    "Denoiser",
    "GenerationCancelled",
    "TokenHooks",
    "abstract_like",
    "progress_bar",
]

#: Latent tokens and sampler state between steps: requests over data (replicated over cfg), tokens over
#: (ring, ulysses) in the padded shard layout.
LATENT_AXES = ("request", "seq", None)


class GenerationCancelled(RuntimeError):
    """A step callback returned False: the loop stopped before its last step."""


@dataclasses.dataclass(frozen=True)
class TokenHooks:
    """How a family's latent tokens meet its transformer (static: they are traced into the step).

    ``model_input(x, extras)``: the ``hidden_states`` of the forward from the latent tokens ``x`` [B, N, K]
    and the per-token extras (default: ``x`` itself). ``prediction(v)``: the model's output as an update
    of ``x``'s features (default: as is). ``extra_features``: features ``model_input`` adds per token.
    """

    model_input: Callable[[jax.Array, Mapping[str, jax.Array]], jax.Array] = lambda x, extras: x
    prediction: Callable[[jax.Array], jax.Array] = lambda v: v
    extra_features: int = 0


@dataclasses.dataclass(frozen=True)
class DenoiseInputs:
    """One generation's arrays, unpadded, on the host.

    ``tokens`` [B, N, K] fp32: the initial latent tokens of the B requests. ``context``: the forward's
    other inputs by name (batch rows = B, or 2B CFG-interleaved with ``jaxdit.parallel.cfg.
    interleave_branches`` when ``cfg``). ``extras``: per-token arrays [B, N, *] laid out like ``tokens``
    (Wan I2V's condition). ``scale``: the classifier-free guidance scale. ``grid``: the latent token grid
    the tokens flatten (FLUX (rows, cols), Wan (frames, rows, cols)), for loops that split it (PipeFusion).
    ``experts``: the parameter set each step runs, an index for the denoiser's ``experts`` (Wan 2.2's
    high- and low-noise transformers); empty: the forward's own parameters every step. ``scales``: each
    step's guidance scale (each expert has its own); empty: ``scale`` every step.
    """

    tokens: np.ndarray
    context: Mapping[str, np.ndarray]
    schedule: Any
    steps: int
    cfg: bool = False
    scale: float = 1.0
    extras: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    grid: tuple[int, ...] = ()
    experts: tuple[int, ...] = ()
    scales: tuple[float, ...] = ()


@dataclasses.dataclass
class DenoiseResult:
    tokens: np.ndarray  # [B, N, K] fp32, unpadded
    seconds: float  # wall time of the loop (compile included on a first call)


def abstract_like(a: Any) -> Any:
    """A ShapeDtypeStruct with ``a``'s shape, dtype and sharding (to re-lower a step without data)."""
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None))


def progress_bar(iterable, enabled: bool, total: int):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc="denoising", unit="step", leave=False)


class Denoiser:
    """The plain (non-pipelined) denoising loop of one model on its mesh.

    Args:
      forward: the family's sharded forward (its parameters are ``forward.state``).
      sampler: the sampler protocol (``schedule`` / ``init_state`` / ``model_time`` / ``step``).
      hooks: the family's :class:`TokenHooks`.
      dtype: the model's dtype (``hidden_states`` and the embedded context are cast to it).
      compiler_options: XLA options for the step (the outermost jit; jax rejects them on nested ones).
      experts: ``experts(index) -> parameters`` on the mesh, for inputs that choose a parameter set per
        step (:attr:`DenoiseInputs.experts`); they must share the forward's shapes and shardings (one
        compiled step serves them all).
    """

    def __init__(
        self,
        forward: ShardedForward,
        sampler: Sampler,
        hooks: TokenHooks | None = None,
        *,
        dtype: Any,
        compiler_options: Mapping[str, Any] | None = None,
        experts: Callable[[int], Any] | None = None,
    ) -> None:
        self.forward = forward
        self.experts = experts
        self.sampler = sampler
        self.hooks = hooks or TokenHooks()
        self.dtype = jnp.dtype(dtype)
        self.compiler_options = dict(compiler_options) if compiler_options else None
        self.mesh = forward.mesh
        self.latent_sharding = NamedSharding(self.mesh, logical_to_spec(LATENT_AXES, forward.rules))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.group = forward.inputs["hidden_states"].group
        self._steps: dict[tuple, Callable] = {}
        #: The last step function and its abstract arguments, to inspect the compiled program.
        self.last_step: tuple[Callable, tuple] | None = None

    # ------------------------------------------------------------------ layout
    def layout(self, inputs: DenoiseInputs) -> tuple[SequenceLayout, tuple[str, ...]]:
        """The token layout and the forward's input names for ``inputs``; checks batch, heads, lengths."""
        b, n, k = np.shape(inputs.tokens)
        rows = b * (2 if inputs.cfg else 1)
        shapes = {name: tuple(np.shape(v)) for name, v in inputs.context.items()}
        shapes["hidden_states"] = (rows, n, k + self.hooks.extra_features)
        shapes["timestep"] = (rows,)
        layout = self.forward.layout(shapes)
        return layout, tuple(name for name in self.forward.inputs if name in shapes)

    # ------------------------------------------------------------------ step
    def step_fn(self, layout: SequenceLayout, names: tuple[str, ...], cfg: bool) -> Callable:
        """``step(params, x, state, i, schedule, context, extras, scale) -> (x, state, i + 1)``, jitted;
        ``x`` and the sampler state are donated (updated in place)."""
        key = (layout, names, cfg)
        if key in self._steps:
            return self._steps[key]
        forward = self.forward.step(layout, names)
        mesh, sampler, hooks, dtype = self.mesh, self.sampler, self.hooks, self.dtype

        def step(params, x, state, i, schedule, context, extras, scale):
            tokens = hooks.model_input(x, extras)
            model_x = replicate_branches(tokens, mesh, seq_sharded=True) if cfg else tokens
            t = sampler.model_time(schedule, i)
            inputs = dict(
                context,
                hidden_states=model_x.astype(dtype),
                timestep=jnp.full((model_x.shape[0],), t, jnp.float32),
            )
            v = forward(params, *(inputs[n] for n in names))
            if cfg:
                v = combine_branches(v, scale, mesh, seq_sharded=True)
            x, state = sampler.step(schedule, i, state, x, hooks.prediction(v))
            return x, state, i + 1

        self._steps[key] = jax.jit(
            step,
            out_shardings=(self.latent_sharding, self.latent_sharding, self.replicated),
            donate_argnums=(1, 2),
            compiler_options=self.compiler_options,
        )
        return self._steps[key]

    # ------------------------------------------------------------------ placement
    def place(self, inputs: DenoiseInputs, layout: SequenceLayout) -> tuple:
        """(x, state, i, schedule, context, extras, scale) on the mesh, padded to ``layout``."""
        placed = {}
        for name, value in inputs.context.items():
            arg = self.forward.inputs[name]
            value = np.asarray(value)
            if arg.group is not None:
                value = layout.pad(value, arg.group, axis=arg.seq_axis)
            array = jax.device_put(value, self.forward.sharding(arg))
            placed[name] = array.astype(self.dtype) if arg.model_dtype else array
        pad = lambda a: jax.device_put(
            layout.pad(np.asarray(a, np.float32), self.group, axis=1), self.latent_sharding
        )
        x = pad(inputs.tokens)
        extras = {name: pad(value) for name, value in inputs.extras.items()}
        state = jax.jit(self.sampler.init_state, out_shardings=self.latent_sharding)(x)
        schedule = jax.device_put(inputs.schedule, self.replicated)
        i = jax.device_put(np.int32(0), self.replicated)
        scale = jax.device_put(np.float32(inputs.scale), self.replicated)
        return x, state, i, schedule, placed, extras, scale

    # ------------------------------------------------------------------ run
    def run(
        self,
        inputs: DenoiseInputs,
        *,
        progress: bool = True,
        callback: Callable[[int, int], bool | None] | None = None,
        params: Any = None,
    ) -> DenoiseResult:
        """All ``inputs.steps`` steps; returns the final latent tokens (unpadded, on the host).

        ``params``: the transformer's parameters (default: the expert ``inputs.experts`` names for each
        step, through ``experts``, else the forward's own); a callable ``params(i)`` picks them per step
        (Wan 2.2's two experts share one compiled step). ``inputs.scales`` gives each step its guidance
        scale, a traced argument like the parameters: the switch recompiles nothing.
        ``callback(i, total)`` runs on the host after step i is dispatched; False stops the loop.
        """
        layout, names = self.layout(inputs)
        step = self.step_fn(layout, names, inputs.cfg)
        x, state, i, *rest, scale = self.place(inputs, layout)
        for name, per_step in (("experts", inputs.experts), ("scales", inputs.scales)):
            if per_step and len(per_step) != inputs.steps:
                raise ValueError(f"{len(per_step)} {name} for {inputs.steps} steps")
        if params is None and inputs.experts:
            if self.experts is None:
                raise ValueError("these inputs choose an expert per step, but this denoiser has no experts")
            params = lambda n: self.experts(inputs.experts[n])
        pick = (
            params if callable(params) else (lambda _: params if params is not None else self.forward.state)
        )
        # Each step's guidance scale, placed once per distinct value (a traced argument: no recompilation).
        placed = {s: jax.device_put(np.float32(s), self.replicated) for s in set(inputs.scales)}
        scale_of = (lambda n: placed[inputs.scales[n]]) if inputs.scales else (lambda _: scale)
        self.last_step = (step, jax.tree.map(abstract_like, (pick(0), x, state, i, *rest, scale)))
        start = time.perf_counter()
        for n in progress_bar(range(inputs.steps), progress, inputs.steps):
            x, state, i = step(pick(n), x, state, i, *rest, scale_of(n))
            if callback is not None and callback(n + 1, inputs.steps) is False:
                raise GenerationCancelled(f"stopped after step {n + 1} of {inputs.steps}")
        tokens = np.asarray(jax.device_get(x))
        seconds = time.perf_counter() - start
        return DenoiseResult(layout.unpad(tokens, self.group, axis=1), seconds)

    def lower(self, inputs: DenoiseInputs) -> jax.stages.Lowered:
        """The step for ``inputs`` lowered from abstract shapes: ``inputs`` may hold ShapeDtypeStructs
        (unpadded shapes; no data is read) and the forward's state may be abstract."""
        layout, names = self.layout(inputs)
        step = self.step_fn(layout, names, inputs.cfg)

        def sds(shape, dtype, sharding):
            return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)

        def padded(shape, group, axis):
            shape = list(shape)
            shape[axis] = layout.padded_lengths[group]
            return shape

        b, n, k = np.shape(inputs.tokens)
        x = sds(padded((b, n, k), self.group, 1), jnp.float32, self.latent_sharding)
        state = jax.eval_shape(self.sampler.init_state, x)
        state = jax.tree.map(lambda s: sds(s.shape, s.dtype, self.latent_sharding), state)
        context = {}
        for name, value in inputs.context.items():
            arg = self.forward.inputs[name]
            shape = np.shape(value)
            if arg.group is not None:
                shape = padded(shape, arg.group, arg.seq_axis)
            dtype = self.dtype if arg.model_dtype else value.dtype
            context[name] = sds(shape, dtype, self.forward.sharding(arg))
        extras = {
            name: sds(padded(np.shape(v), self.group, 1), jnp.float32, self.latent_sharding)
            for name, v in inputs.extras.items()
        }
        schedule = jax.tree.map(lambda a: sds(np.shape(a), a.dtype, self.replicated), inputs.schedule)
        params = jax.tree.map(
            lambda a, s: sds(a.shape, a.dtype, s), self.forward.state, self.forward.param_shardings
        )
        i = sds((), jnp.int32, self.replicated)
        scale = sds((), jnp.float32, self.replicated)
        return step.lower(params, x, state, i, schedule, context, extras, scale)
