"""PipeFusion's denoising loop (arXiv 2405.14430) for any model family: warm-up steps, then one pipelined call
(per expert segment of the schedule).

A pipeline hands the runner what its plain denoising loop would take, and gets the final latents back::

    runner = PipeFusionRunner(FluxPatches(model.config), model)  # model: a PipeFusionFlux (stages.py)
    tokens = runner(
        latents,          # [B, N, K] fp32 initial latent tokens, one row per request (CFG not doubled),
                          # numpy or placed; N in the family's token order (FLUX: packed 2x2 patches,
                          # row-major; Wan: patchify order), unpadded
        context,          # the family's forward context by diffusers' names, CFG rows interleaved
                          # (``jaxdit.parallel.cfg.interleave_branches``), unpadded: FLUX
                          # encoder_hidden_states, pooled_projections, txt_ids, img_ids, guidance (dev);
                          # Wan encoder_hidden_states, positions, for I2V condition (the mask +
                          # first-frame tokens [B, N, K'] beside the noise; Wan 2.1 also
                          # encoder_hidden_states_image), for TI2V with an image timestep_mask [N],
                          # first_frame [B, N, K] and in_first_frame [B, N, 1]
        sampler=sampler,  # a jaxdit.samplers.sampler.Sampler (EulerSampler, UniPCSampler, ...)
        schedule=sched,   # sampler.schedule(num_inference_steps, ...), on the host
        grid=grid,        # the token grid of the latents: FLUX (rows, cols), Wan (F', H', W')
        guidance_scale=s, # classifier-free guidance scale (used when the context has both branches)
        num_inference_steps=n, warmup_steps=1, num_pipeline_patch=None,  # None: the family's default
        experts=(), params=None,  # Wan 2.2 A14B: each step's expert, params(expert) -> its parameters
        scales=(),        # each step's guidance scale (each expert has its own); empty: guidance_scale
        callback=None,    # callback(done, total) after each warm-up step and each pipelined phase;
                          # False stops the run there (GenerationCancelled)
        **options,        # the family's: Wan's patch_by="rows" | "frames"
    )                     # -> np.ndarray [B, N, K] fp32, the final latent tokens

Two experts. K/V buffered by one expert is no context for the other's layers, so the schedule is cut
into expert segments (``segments.py``), each a PipeFusion run of its own with its expert's parameters and
guidance scale: warm-up step(s) that refill the K/V buffers, then one pipelined call; the latents and the
sampler state carry over. Cost: one more synchronous step per switch (``warmup_steps`` more in general)
and one more pipelined launch; the warm-up program is shared, a pipelined program is compiled per
(length, first step).

A host-planned feature cache (``cache=MagCache(...)`` or ``TaylorSeer(...)``; ``cache.py``): the host
plans which steps run every block; the warm-up programs and ONE pipelined program (its scan over the full
steps) also run the skipped steps, each right after the full step it follows, with no block and no K/V
write; ``last_cache`` reports the plan. With two experts each segment's warm-up steps are forced full
(the plan's runs of skipped steps end at a switch) and each segment launches the same pipelined program
on its own full steps.

Guidance runs when the context's batch is twice the latents' (both branches, interleaved). The request
is checked before anything compiles (patches against the grid and the sequence degree, warm-up steps
against the steps); ``runner.check(grid, steps, warmup_steps, num_pipeline_patch)`` runs the same checks
alone, for a pipeline to call before it encodes prompts. The model is a :class:`StagedModel` of the family: its block stacks laid out in stage
slots on the mesh it was built for. The programs (``programs.py``) are compiled once per geometry and
kept; ``last_programs`` holds the last call's programs with abstract arguments, for reading their
collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdit.cache.report import CacheReport
from jaxdit.parallel.pipefusion import validate_pipefusion
from jaxdit.pipelines import finite
from jaxdit.pipelines.denoiser import GenerationCancelled, StepCounter, abstract_like
from jaxdit.pipelines.pipefusion import cache as pipefusion_cache
from jaxdit.pipelines.pipefusion.family import PatchFamily
from jaxdit.pipelines.pipefusion.geometry import PatchGeometry
from jaxdit.pipelines.pipefusion.programs import PipeFusionPrograms
from jaxdit.pipelines.pipefusion.segments import Segment, expert_segments
from jaxdit.pipelines.pipefusion.stages import StagedModel
from jaxdit.samplers.sampler import Sampler

__all__ = ["RunnerPrograms", "PipeFusionRunner", "lower"]


class PipeFusionRunner:
    """A family's model laid out in stages, and the compiled programs of the geometries it has run.

    See the module docstring for the call. ``kernel``: attention tile sizes; ``compiler_options``: XLA
    options of the compiled programs; ``guidance(uncond, cond, scale)``: the family's per-token CFG
    combination (None: plain CFG).
    """

    def __init__(
        self,
        family: PatchFamily,
        model: StagedModel,
        *,
        kernel: Mapping[str, int] | None = None,
        compiler_options: Mapping[str, Any] | None = None,
        guidance: Callable | None = None,
    ) -> None:
        self.family, self.model, self.parallel = family, model, model.parallel
        self.kernel, self.compiler_options, self.guidance = kernel, compiler_options, guidance
        #: (geometry, guided) -> its programs.
        self.programs: dict[tuple[PatchGeometry, bool], PipeFusionPrograms] = {}
        #: (geometry, guided, Taylor order) -> the programs of a host-planned cache (``cache.py``).
        self.cached_programs: dict[tuple[PatchGeometry, bool, int], PipeFusionPrograms] = {}
        #: After a cached call: what the cache did (``jaxdit.cache.CacheReport``); None without one.
        self.last_cache: CacheReport | None = None
        #: After a cached call: its host plan (``cache.Plan``).
        self.last_plan: pipefusion_cache.Plan | None = None
        #: After a call: (warm-up fn, its abstract args) and (pipelined fn, its abstract args) or None
        #: (with two experts, the last segment's).
        self.last_programs: dict[str, tuple[Callable, tuple] | None] = {}
        #: After a call: the schedule's expert segments as they ran (``segments.Segment``).
        self.last_segments: tuple[Segment, ...] = ()

    def programs_for(
        self, g: PatchGeometry, guided: bool, sampler: Sampler, cache_order: int | None = None
    ) -> PipeFusionPrograms:
        """The programs of ``g``, built once (per sampler kind: a sampler's settings live in its schedule);
        ``cache_order``: a host-planned cache's (``cache.py``; kept apart from the uncached programs)."""
        table = self.programs if cache_order is None else self.cached_programs
        key = (g, guided) if cache_order is None else (g, guided, cache_order)
        programs = table.get(key)
        if programs is None or type(programs.sampler) is not type(sampler):
            programs = PipeFusionPrograms(
                self.family,
                self.model,
                g,
                guided,
                sampler,
                self.kernel,
                self.compiler_options,
                self.guidance,
                cache_order=cache_order,
            )
            table[key] = programs
        return programs

    def cache_policy(self, cache: Any, grid: tuple[int, ...]) -> Any:
        """A cache config resolved for this model (``jaxdit.cache.resolve``), or ValueError in one line for a
        cache PipeFusion cannot run (``cache.py``: only the host-planned ones)."""
        from jaxdit.cache.resolve import resolve

        reason = pipefusion_cache.refusal(
            getattr(cache, "name", type(cache).__name__), getattr(self.family, "caches", ())
        )
        if reason is not None:
            raise ValueError(reason)
        # Resolved against the unpadded model: its published / shipped numbers are keyed by its config.
        real = type(self.model).abstract_model(self.model.config, self.model.dtype)
        policy = resolve(cache, real, grid)
        if policy.metric != "host":
            raise ValueError(pipefusion_cache.refusal(policy.name))
        return policy

    def check(
        self,
        grid: tuple[int, ...],
        num_inference_steps: int,
        warmup_steps: int,
        num_pipeline_patch: int | None = None,
        **options: Any,
    ) -> int:
        """The patch count for a request (the family's default when None), checked with the warm-up
        steps before any work: raises ValueError naming the numbers."""
        pc = self.parallel
        if num_pipeline_patch is None:
            patches = self.family.default_patches(grid, pc, **options)
        else:  # given: checked as given (0 is no request for the default)
            patches = num_pipeline_patch
        validate_pipefusion(pc.pipefusion, patches, warmup_steps, num_inference_steps)
        self.family.validate_patches(grid, patches, pc, **options)
        return patches

    def __call__(
        self,
        latents: Any,
        context: Mapping[str, Any],
        *,
        sampler: Sampler,
        schedule: Any,
        grid: tuple[int, ...],
        guidance_scale: float,
        num_inference_steps: int,
        warmup_steps: int = 1,
        num_pipeline_patch: int | None = None,
        progress: bool = False,
        experts: Sequence[int] = (),
        scales: Sequence[float] = (),
        params: Callable[[int], Any] | None = None,
        callback: Callable[[int, int], bool | None] | None = None,
        cache: Any = None,
        **options: Any,
    ) -> np.ndarray:
        """The final latent tokens [B, N, K] (see the module docstring); ``options`` are the family's
        (Wan: ``patch_by``). ``experts``: the parameter set of each step (Wan 2.2 A14B), ``params(expert)``
        its parameters on the mesh (same shapes and shardings as ``model.state``); ``scales``: each step's
        guidance scale (default ``guidance_scale``). ``callback(done, total)`` runs on the host after each
        warm-up step and after each pipelined phase (``done`` jumps by the phase's steps: they end
        together), once the devices have finished it; False stops the run (:class:`GenerationCancelled`).
        ``cache``: a host-planned feature cache (``jaxdit.cache.MagCache`` / ``TaylorSeer``; ``cache.py``),
        its report then in ``last_cache``."""
        pc, family = self.parallel, self.family
        x = np.asarray(jax.device_get(latents), np.float32)
        patches = self.check(grid, num_inference_steps, warmup_steps, num_pipeline_patch, **options)
        segments = expert_segments(experts, num_inference_steps, warmup_steps)
        if scales and len(scales) != num_inference_steps:
            raise ValueError(f"{len(scales)} guidance scales for {num_inference_steps} steps")
        if experts and params is None:
            raise ValueError("these inputs choose an expert per step, but no expert parameters were given")
        g = family.geometry(grid, patches, pc, x.shape[0], context, **options)
        if g.batch not in (g.requests, 2 * g.requests):
            raise ValueError(
                f"the context has {g.batch} rows for {g.requests} latents: one per request, or two with "
                "classifier-free guidance (both branches, interleaved)"
            )
        if g.requests % pc.data:
            raise ValueError(f"{g.requests} requests cannot be split over data={pc.data}")
        policy = plan = None
        self.last_cache = self.last_plan = None
        if cache is not None:
            policy = self.cache_policy(cache, grid)
            plan = pipefusion_cache.Plan.build(policy, num_inference_steps, warmup_steps, segments)
        order = None if policy is None else policy.taylor_order
        programs = self.programs_for(g, g.batch == 2 * g.requests, sampler, order)
        sh = programs.shardings

        tokens = g.to_patches(x, 1)  # [B, M, N/M, K]: every stage keeps its own copy
        lat = jax.device_put(np.broadcast_to(tokens[None], (pc.pipefusion, *tokens.shape)), sh["latents"])
        state = programs.init_state(lat)
        placed = {
            name: None if entry is None else jax.device_put(entry[0], sh[name]).astype(entry[1])
            for name, entry in family.program_context(context, g, self.model.dtype).items()
        }
        sched = jax.device_put(schedule, sh["scalar"])

        kv = programs.zero_buffers()
        warm = programs.warmup()
        if plan is not None:
            residual = programs.zero_residual()
            tables = tuple(jax.device_put(t, sh["scalar"]) for t in plan.tables())
        self.last_programs = {"warmup": None, "pipelined": None}
        self.last_segments = segments
        # Non-finite values: the K/V buffers (the transformer's) and the latents after each warm-up step.
        stages = (finite.KV_STAGE,) * len(jax.tree.leaves(kv)) + ("denoising step",)
        # The copy of the stage where a patch's step ends holds the result (the others: what they computed).
        last_stage = programs.schedule(1).last_stage

        def reached(done: int, x: jax.Array) -> None:
            if callback is not None:
                x.block_until_ready()  # the callback sees finished steps, not dispatched ones
                if callback(done, num_inference_steps) is False:
                    raise GenerationCancelled(f"stopped after step {done} of {num_inference_steps}")

        with StepCounter(progress, num_inference_steps) as counter:
            for segment in segments:
                weights = self.model.state if segment.expert is None else params(segment.expert)
                scale = jnp.float32(scales[segment.first] if scales else guidance_scale)  # one per expert
                # The segment's warm-up refills every layer's K/V buffer with its own expert's K/V.
                watch = finite.StepWatch(self.model.mesh, num_inference_steps, stages)
                for i in range(segment.first, segment.first + segment.warmup):
                    if plan is None:
                        args = (weights, lat, state, kv, placed, sched, jnp.int32(i), scale)
                        self.last_programs["warmup"] = (warm, jax.tree.map(abstract_like, args))
                        lat, state, kv = warm(*args)
                        done = i + 1
                    else:  # the warm-up step, then the skipped steps that follow it (cache.py)
                        args = (
                            weights,
                            lat,
                            state,
                            kv,
                            residual,
                            placed,
                            sched,
                            jnp.int32(i),
                            scale,
                            *tables,
                        )
                        self.last_programs["warmup"] = (warm, jax.tree.map(abstract_like, args))
                        lat, state, kv, residual = warm(*args)
                        done = i + 1 + int(plan.follow[i])
                    watch.add(i, finite.array_flags(self.model.mesh, [*jax.tree.leaves(kv), lat]))
                    counter.update(done - i)
                    reached(done, lat)
                watch.finish()
                end = segment.first + segment.steps
                if plan is not None:
                    index, count = plan.pipelined(segment.first, end)  # this segment's full steps
                    if count:
                        run = programs.asynchronous_cached(num_inference_steps)
                        full = tuple(jax.device_put(t, sh["scalar"]) for t in (index, count))
                        args = (weights, lat, state, kv, residual, placed, sched, scale, *tables, *full)
                        self.last_programs["pipelined"] = (run, jax.tree.map(abstract_like, args))
                        lat, state, residual = run(*args)
                        phase = f"the latents after the pipelined steps {int(index[0]) + 1}-{end}"
                        finite.check_arrays("denoising step", {phase: jax.device_get(lat[last_stage])})
                        counter.update(end - done)
                        reached(end, lat)
                elif segment.pipelined:
                    first = segment.first + segment.warmup
                    run = programs.asynchronous(segment.pipelined, first)
                    args = (weights, lat, state, kv, placed, sched, scale)
                    self.last_programs["pipelined"] = (run, jax.tree.map(abstract_like, args))
                    lat, state = run(*args)
                    phase = f"the latents after the pipelined steps {first + 1}-{end}"
                    finite.check_arrays("denoising step", {phase: jax.device_get(lat[last_stage])})
                    counter.update(segment.pipelined)  # one program: its steps end together
                    reached(end, lat)
        out = np.asarray(jax.device_get(lat[last_stage]))
        if plan is not None:
            self.last_plan = plan
            self.last_cache = self._report(policy, plan, programs)
        return g.from_patches(out, 1)

    def _report(self, policy: Any, plan: pipefusion_cache.Plan, programs: PipeFusionPrograms) -> CacheReport:
        """What a host-planned cache did: its plan (every device follows it, so they agree)."""
        devices = self.model.mesh.devices.size
        blocks = sum(int(np.sum(order >= 0)) for order in self.model.orders.values())
        return CacheReport(
            title=policy.title,
            threshold=policy.threshold,
            ran=plan.ran.copy(),
            ratios=np.full(len(plan.ran), np.nan, np.float32),
            devices=devices,
            devices_agree=True,
            blocks_per_step=blocks,
            always_run=0,
            bytes_per_device=programs.residual_bytes_per_device(),
            per_device=np.tile(plan.ran.astype(np.int32), (devices, 1)),
            setting=policy.describe() + " under PipeFusion (host plan)",
        )


class RunnerPrograms:
    """A pipeline over a :class:`PipeFusionRunner` (``self.runner``): its programs, to inspect them."""

    runner: PipeFusionRunner

    @property
    def _programs(self) -> dict[tuple[PatchGeometry, bool], PipeFusionPrograms]:
        """(geometry, guided) -> the programs compiled for it."""
        return self.runner.programs

    @property
    def last_programs(self) -> dict[str, tuple[Callable, tuple] | None]:
        """After a call: (warm-up fn, its abstract args) and (pipelined fn, its abstract args) or None."""
        return self.runner.last_programs


def lower(
    programs: PipeFusionPrograms, schedule: Any, *, steps: int, warmup_steps: int = 1
) -> tuple[jax.stages.Lowered, jax.stages.Lowered | None]:
    """``programs``' warm-up step and pipelined phase (None when ``warmup_steps == steps``) lowered from
    abstract shapes, with the sampler's host ``schedule`` of ``steps`` steps: full-size compiles,
    collectives and memory without weights."""
    warm = programs.warmup().lower(*programs.abstract_args(None, schedule))
    rest = steps - warmup_steps
    run = None
    if rest:
        run = programs.asynchronous(rest, warmup_steps).lower(*programs.abstract_args(rest, schedule))
    return warm, run
