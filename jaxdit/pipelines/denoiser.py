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

A feature cache (``run(..., cache=FirstBlockCache(...))``, :mod:`jaxdit.cache`) swaps the forward for the
cached one (:meth:`Denoiser.cached_step_fn`): the same step around it, with the cache's state as one more
donated carry that stays on the devices; without a cache the step is exactly the program above.

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
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxdit.cache import CacheReport
from jaxdit.cache.cached_forward import CachedForward, resolve
from jaxdit.cache.hooks import hooks_for
from jaxdit.distributed import fetch
from jaxdit.models.sharded_forward import ShardedForward
from jaxdit.parallel.cfg import combine_branches, replicate_branches
from jaxdit.parallel.cfg import guidance as cfg_guidance
from jaxdit.parallel.layout import SequenceLayout
from jaxdit.pipelines import finite
from jaxdit.samplers.sampler import Sampler
from sharding_rules import logical_to_spec

__all__ = [
    "LATENT_AXES",
    "DenoiseInputs",
    "DenoiseResult",
    "Denoiser",
    "GenerationCancelled",
    "SCHEDULE_ROWS",
    "TokenHooks",
    "abstract_like",
    "pad_schedule",
    "progress_bar",
    "schedule_rows",
]

#: The sampler's tables are padded to a multiple of this many rows (copies of the last row, never read:
#: the step index stays below the step count), so the step count does not change the compiled step's
#: shapes: every count up to 63 runs one program. Without it each new count compiled the step again.
SCHEDULE_ROWS = 64


def schedule_rows(num_steps: int) -> int:
    """The padded length of a schedule for ``num_steps`` steps (its longest table has num_steps + 1 rows)."""
    return -(-(num_steps + 1) // SCHEDULE_ROWS) * SCHEDULE_ROWS


def pad_schedule(schedule: Any, num_steps: int) -> Any:
    """Every table of ``schedule`` (indexed by step along its first axis) padded to :func:`schedule_rows`."""
    rows = schedule_rows(num_steps)

    def pad(table: Any) -> Any:
        table = np.asarray(table)
        return np.pad(table, [(0, rows - table.shape[0])] + [(0, 0)] * (table.ndim - 1), mode="edge")

    return jax.tree.map(pad, schedule)


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
    ``guidance(uncond, cond, scale)``: how the two CFG branches' predictions combine, per token (default:
    plain classifier-free guidance, ``jaxdit.parallel.cfg.guidance``). ``step_inputs``: forward inputs
    computed per step, by name: ``fn(schedule, i)`` -> a scalar given to every batch row as fp32 [B]
    (HunyuanVideo 1.5 MeanFlow's second timestep); default none.
    """

    model_input: Callable[[jax.Array, Mapping[str, jax.Array]], jax.Array] = lambda x, extras: x
    prediction: Callable[[jax.Array], jax.Array] = lambda v: v
    extra_features: int = 0
    guidance: Callable[[jax.Array, jax.Array, jax.Array], jax.Array] = cfg_guidance
    step_inputs: Mapping[str, Callable[[Any, jax.Array], jax.Array]] = dataclasses.field(default_factory=dict)


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
    #: CFG renormalisation (``jaxdit.parallel.cfg.renormalized``): the guided prediction's norm capped at
    #: this x the conditional one's; 0: none. The forward's padded tokens must predict zero.
    renorm: float = 0.0


@dataclasses.dataclass
class DenoiseResult:
    tokens: np.ndarray  # [B, N, K] fp32, unpadded
    seconds: float  # wall time of the loop (compile included on a first call)
    cache: CacheReport | None = None  # what a feature cache did (None without one)


def abstract_like(a: Any) -> Any:
    """A ShapeDtypeStruct with ``a``'s shape, dtype and sharding (to re-lower a step without data)."""
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None))


def progress_bar(iterable, enabled: bool, total: int):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc="denoising", unit="step", leave=False)


class StepCounter:
    """A progress bar advanced by hand, by one step or by a pipelined phase's steps at once (no-op when
    disabled); use as a context manager."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.bar = progress_bar(None, enabled, total)  # None when disabled

    def update(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def __enter__(self) -> StepCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


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
      high_precision: ``(forward, k)``: an FP8 model's original-weight forward and the number of steps it
        runs at each end of the loop (``jaxdit.models.quantize.FP8.skip_steps``): steps ``0..k-1`` and
        the last ``k`` run it, the others ``forward``. One compiled step per precision, each reused.
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
        high_precision: tuple[ShardedForward, int] | None = None,
    ) -> None:
        self.forward = forward
        self.experts = experts
        self.sampler = sampler
        self.hooks = hooks or TokenHooks()
        self.dtype = jnp.dtype(dtype)
        self.compiler_options = dict(compiler_options) if compiler_options else None
        #: The forward's mesh and degrees (one object: CFG's branch helpers read the degrees from it).
        self.device_mesh = forward.device_mesh
        self.mesh = forward.mesh
        self.latent_sharding = NamedSharding(self.mesh, logical_to_spec(LATENT_AXES, forward.rules))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.group = forward.inputs["hidden_states"].group
        self._steps: dict[tuple, Callable] = {}
        # Jitted once: a jit made per call would compile again on every call (a service counts those).
        self._init_state = jax.jit(sampler.init_state, out_shardings=self.latent_sharding)
        #: The last step function and its abstract arguments, to inspect the compiled program.
        self.last_step: tuple[Callable, tuple] | None = None
        #: FP8's skipped steps: the loop over the original weights (same mesh, sampler and hooks), and k.
        self.high_precision: Denoiser | None = None
        self.high_precision_steps = 0
        if high_precision is not None:
            original, self.high_precision_steps = high_precision
            self.high_precision = Denoiser(
                original, sampler, hooks, dtype=dtype, compiler_options=compiler_options
            )

    # ------------------------------------------------------------------ layout
    def layout(self, inputs: DenoiseInputs) -> tuple[SequenceLayout, tuple[str, ...]]:
        """The token layout and the forward's input names for ``inputs``; checks batch, heads, lengths."""
        b, n, k = np.shape(inputs.tokens)
        rows = b * (2 if inputs.cfg else 1)
        shapes = {name: tuple(np.shape(v)) for name, v in inputs.context.items()}
        shapes["hidden_states"] = (rows, n, k + self.hooks.extra_features)
        shapes["timestep"] = (rows,)
        for name in self.hooks.step_inputs:
            shapes[name] = (rows,)
        layout = self.forward.layout(shapes)
        return layout, tuple(name for name in self.forward.inputs if name in shapes)

    # ------------------------------------------------------------------ step
    def _step_parts(
        self, names: tuple[str, ...], cfg: bool, renorm: float = 0.0
    ) -> tuple[Callable, Callable]:
        """The two halves of a step around the forward: its inputs from the latent tokens, and the update
        of the tokens from its prediction (CFG combine, then the sampler) with the step's finiteness flags."""
        mesh, sampler, hooks, dtype = self.mesh, self.sampler, self.hooks, self.dtype
        where = self.device_mesh

        def forward_inputs(x, i, schedule, context, extras):
            tokens = hooks.model_input(x, extras)
            model_x = replicate_branches(tokens, where, seq_sharded=True) if cfg else tokens
            t = sampler.model_time(schedule, i)
            inputs = dict(
                context,
                hidden_states=model_x.astype(dtype),
                timestep=jnp.full((model_x.shape[0],), t, jnp.float32),
            )
            for name, fn in hooks.step_inputs.items():
                inputs[name] = jnp.full((model_x.shape[0],), fn(schedule, i), jnp.float32)
            return tuple(inputs[n] for n in names)

        prediction_spec = self.forward.spec(self.forward.output)

        def update(v, x, state, i, schedule, scale):
            prediction = v
            if cfg:
                v = combine_branches(v, scale, where, seq_sharded=True, rule=hooks.guidance, renorm=renorm)
            x, state = sampler.step(schedule, i, state, x, hooks.prediction(v))
            # Per device: are its shards of the prediction and of the update finite (no collective).
            seen = finite.shard_flags(mesh, [(prediction, prediction_spec), (x, self.latent_sharding.spec)])
            return x, state, seen

        return forward_inputs, update

    def step_fn(
        self, layout: SequenceLayout, names: tuple[str, ...], cfg: bool, renorm: float = 0.0
    ) -> Callable:
        """``step(params, x, state, i, schedule, context, extras, scale) -> (x, state, i + 1, finite)``,
        jitted; ``x`` and the sampler state are donated (updated in place). ``finite``: per device, whether
        its shards of the prediction and of the update are finite (``finite.shard_flags``)."""
        key = (layout, names, cfg, renorm)
        if key in self._steps:
            return self._steps[key]
        forward = self.forward.step(layout, names)
        forward_inputs, update = self._step_parts(names, cfg, renorm)

        def step(params, x, state, i, schedule, context, extras, scale):
            v = forward(params, *forward_inputs(x, i, schedule, context, extras))
            x, state, seen = update(v, x, state, i, schedule, scale)
            return x, state, i + 1, seen

        self._steps[key] = jax.jit(
            step,
            out_shardings=(
                self.latent_sharding,
                self.latent_sharding,
                self.replicated,
                finite.flags_sharding(self.mesh),
            ),
            donate_argnums=(1, 2),
            compiler_options=self.compiler_options,
        )
        return self._steps[key]

    def cached_step_fn(
        self,
        layout: SequenceLayout,
        names: tuple[str, ...],
        cfg: bool,
        cached: CachedForward,
        shapes: Mapping[str, Any],
        renorm: float = 0.0,
    ) -> Callable:
        """:meth:`step_fn` with a feature cache: ``step(params, x, state, cache, i, schedule, context,
        extras, scale) -> (x, state, cache, i + 1, finite)``, jitted; the cache state is donated too and stays
        on the devices from step to step."""
        # A host-planned cache (MagCache, TaylorSeer) shares one program over its thresholds.
        key = (layout, names, cfg, cached.policy.program_key, renorm)
        if key in self._steps:
            return self._steps[key]
        forward = cached.step(layout, names, shapes)
        forward_inputs, update = self._step_parts(names, cfg, renorm)

        def step(params, x, state, cache, i, schedule, context, extras, scale):
            v, cache = forward(params, cache, *forward_inputs(x, i, schedule, context, extras))
            x, state, seen = update(v, x, state, i, schedule, scale)
            return x, state, cache, i + 1, seen

        self._steps[key] = jax.jit(
            step,
            out_shardings=(
                self.latent_sharding,
                self.latent_sharding,
                cached.shardings(shapes),
                self.replicated,
                finite.flags_sharding(self.mesh),
            ),
            donate_argnums=(1, 2, 3),
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
        state = self._init_state(x)
        schedule = jax.device_put(pad_schedule(inputs.schedule, inputs.steps), self.replicated)
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
        cache: Any = None,
    ) -> DenoiseResult:
        """All ``inputs.steps`` steps; returns the final latent tokens (unpadded, on the host).

        ``params``: the transformer's parameters (default: the expert ``inputs.experts`` names for each
        step, through ``experts``, else the forward's own); a callable ``params(i)`` picks them per step
        (Wan 2.2's two experts share one compiled step). ``inputs.scales`` gives each step its guidance
        scale, a traced argument like the parameters: the switch recompiles nothing.
        ``callback(i, total)`` runs on the host after step i has finished on the devices (so progress,
        cancellation and timeouts are real, not just dispatched); False stops the loop.
        ``cache``: a ``jaxdit.cache.FirstBlockCache`` / ``TeaCache`` (see :meth:`run_cached`).
        """
        if cache is not None:
            if self.high_precision_steps:
                raise ValueError("FP8's skipped steps (skip_steps) do not run with a feature cache yet")
            return self.run_cached(inputs, cache, progress=progress, callback=callback, params=params)
        layout, names = self.layout(inputs)
        step = self.step_fn(layout, names, inputs.cfg, inputs.renorm)
        x, state, i, *rest, scale = self.place(inputs, layout)
        pick, scale_of = self._per_step(inputs, params, scale)
        self.last_step = (step, jax.tree.map(abstract_like, (pick(0), x, state, i, *rest, scale)))
        carry = (x, state, i)
        precise = self._high_precision_steps(inputs, params)
        if precise:
            high = self.high_precision
            high_step = high.step_fn(layout, names, inputs.cfg, inputs.renorm)

        def advance(n: int) -> tuple[jax.Array, Any]:
            nonlocal carry
            if n in precise:
                *carry, seen = high_step(high.forward.state, *carry, *rest, scale_of(n))
            else:
                *carry, seen = step(pick(n), *carry, *rest, scale_of(n))
            return carry[0], seen

        start = time.perf_counter()
        tokens = self._loop(inputs.steps, x, advance, progress, callback)
        seconds = time.perf_counter() - start
        return DenoiseResult(layout.unpad(tokens, self.group, axis=1), seconds)

    def _loop(
        self,
        steps: int,
        x: jax.Array,
        advance: Callable[[int], tuple[jax.Array, Any]],
        progress: bool,
        callback: Callable[[int, int], bool | None] | None,
    ) -> np.ndarray:
        """The loop :meth:`run` and :meth:`run_cached` share: ``advance(n)`` dispatches step n and returns
        its latents and per-device finite flags; progress, the callback (after the step has finished on
        the devices, so progress, cancellation and timeouts are real) and the finite check are here.
        ``x``: the latents before the first step. Returns the final latents on the host (across processes
        too)."""
        watch = finite.StepWatch(self.mesh, steps)
        for n in progress_bar(range(steps), progress, steps):
            x, seen = advance(n)
            watch.add(n, seen)
            if callback is not None:
                x.block_until_ready()
                if callback(n + 1, steps) is False:
                    raise GenerationCancelled(f"stopped after step {n + 1} of {steps}")
        watch.finish()
        return fetch(x)

    def _high_precision_steps(self, inputs: DenoiseInputs, params: Any) -> frozenset[int]:
        """The steps that run on the original weights (FP8's skipped steps): the first and last k."""
        k = self.high_precision_steps
        if not k:
            return frozenset()
        if params is not None or inputs.experts:
            raise ValueError("FP8's skipped steps run the loaded model's own weights: no per-step params")
        if 2 * k > inputs.steps:
            raise ValueError(
                f"fp8 skip_steps={k} runs the first and last {k} steps in high precision, {2 * k} steps, "
                f"but this call has {inputs.steps}: use at most {inputs.steps // 2}"
            )
        return frozenset(range(k)) | frozenset(range(inputs.steps - k, inputs.steps))

    def _per_step(self, inputs: DenoiseInputs, params: Any, scale: jax.Array) -> tuple[Callable, Callable]:
        """(``pick(n)``: step n's parameters, ``scale_of(n)``: its guidance scale, placed) for :meth:`run`."""
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
        return pick, scale_of

    def run_cached(
        self,
        inputs: DenoiseInputs,
        cache: Any,
        *,
        progress: bool = True,
        callback: Callable[[int, int], bool | None] | None = None,
        params: Any = None,
    ) -> DenoiseResult:
        """:meth:`run` with a feature cache (``jaxdit.cache``): the host plans the steps the policy forces
        (or, for a metric of the schedule alone, every step), then each step decides on the devices, the
        same everywhere, inside one compiled program. The result carries the cache's report."""
        layout, names = self.layout(inputs)
        x, state, i, schedule, context, extras, scale = self.place(inputs, layout)
        pick, scale_of = self._per_step(inputs, params, scale)
        steps = inputs.steps
        model = nnx.merge(self.forward.graphdef, self.forward.state)
        cached = CachedForward(self.forward, resolve(cache, model, inputs.grid))
        b, n, k = np.shape(inputs.tokens)
        rows = b * (2 if inputs.cfg else 1)
        abstract = dict(jax.tree.map(abstract_like, context))
        abstract["hidden_states"] = jax.ShapeDtypeStruct(
            (rows, layout.padded_lengths[self.group], k + self.hooks.extra_features), self.dtype
        )
        abstract["timestep"] = jax.ShapeDtypeStruct((rows,), jnp.float32)
        for name in self.hooks.step_inputs:
            abstract[name] = jax.ShapeDtypeStruct((rows,), jnp.float32)
        shapes = cached.state_shapes(layout, names, [abstract[name] for name in names], steps)
        # Where the parameters change (Wan 2.2's experts) a stored residual belongs to the other model:
        # those steps run in full. ``params(i)`` returns the same object for the same weights.
        switches = [s for s in range(1, steps) if pick(s) is not pick(s - 1)]
        schedule_inputs = branch_rows = None
        if cached.policy.metric == "schedule":
            schedule_inputs = self._timestep_inputs(pick, schedule, rows, steps)
            branch_rows = self._branch_rows(b, inputs.cfg)
        plan = cached.plan(steps, switches, schedule_inputs, branch_rows or ())
        cache_state = cached.init_state(shapes, plan)
        step = self.cached_step_fn(layout, names, inputs.cfg, cached, shapes, inputs.renorm)
        rest = (schedule, context, extras)
        self.last_step = (
            step,
            jax.tree.map(abstract_like, (pick(0), x, state, cache_state, i, *rest, scale)),
        )
        carry = (x, state, cache_state, i)

        def advance(n: int) -> tuple[jax.Array, Any]:
            nonlocal carry
            *carry, seen = step(pick(n), *carry, *rest, scale_of(n))
            return carry[0], seen

        start = time.perf_counter()
        tokens = self._loop(steps, x, advance, progress, callback)
        seconds = time.perf_counter() - start
        report = cached.report(carry[2], shapes)
        return DenoiseResult(layout.unpad(tokens, self.group, axis=1), seconds, report)

    def _timestep_inputs(self, pick: Callable, schedule: Any, rows: int, steps: int) -> np.ndarray:
        """[steps, rows, ...]: a schedule-only metric's input at every step (TeaCache on Wan)."""
        graphdef, sampler = self.forward.graphdef, self.sampler

        @jax.jit
        def metric_input(params, schedule, i):
            t = jnp.full((rows,), sampler.model_time(schedule, i), jnp.float32)
            model = nnx.merge(graphdef, params)
            return hooks_for(model, "teacache").teacache_timestep_input(t)

        return np.stack(
            [np.asarray(jax.device_get(metric_input(pick(s), schedule, np.int32(s)))) for s in range(steps)]
        )

    def _branch_rows(self, batch: int, cfg: bool) -> list[np.ndarray] | None:
        """The model batch's rows of each guidance branch (``interleave_branches``' order)."""
        if not cfg:
            return None
        data = self.device_mesh.parallel.data
        per = batch // data
        rows = np.arange(2 * batch).reshape(data, 2, per)
        return [rows[:, branch].reshape(-1) for branch in range(2)]

    def lower(self, inputs: DenoiseInputs) -> jax.stages.Lowered:
        """The step for ``inputs`` lowered from abstract shapes: ``inputs`` may hold ShapeDtypeStructs
        (unpadded shapes; no data is read) and the forward's state may be abstract."""
        layout, names = self.layout(inputs)
        step = self.step_fn(layout, names, inputs.cfg, inputs.renorm)

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
        rows = schedule_rows(inputs.steps)  # as pad_schedule lays the tables out
        schedule = jax.tree.map(
            lambda a: sds((rows, *np.shape(a)[1:]), a.dtype, self.replicated), inputs.schedule
        )
        params = jax.tree.map(
            lambda a, s: sds(a.shape, a.dtype, s), self.forward.state, self.forward.param_shardings
        )
        i = sds((), jnp.int32, self.replicated)
        scale = sds((), jnp.float32, self.replicated)
        return step.lower(params, x, state, i, schedule, context, extras, scale)
