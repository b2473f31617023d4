"""PipeFusion as a pipeline's denoiser: the runner behind the plain loop's interface.

A family's pipeline builds the same :class:`~jaxdit.pipelines.denoiser.DenoiseInputs` whatever the mesh;
on a mesh with ``pipefusion > 1`` its ``denoiser`` is a :class:`PipeFusionDenoiser`, which hands them to
the :class:`~jaxdit.pipelines.pipefusion.runner.PipeFusionRunner` (warm-up steps, then one pipelined call)
with the request's PipeFusion options (``warmup_steps``, ``num_pipeline_patch``, and a family's own, e.g.
Wan's ``patch_by``).

Progress and the step callback: the warm-up steps are separate calls, the pipelined phase is ONE program
(a ``lax.scan`` over ticks in which steps overlap), so ``callback(done, total)`` is called after each
warm-up step and once after each pipelined phase, ``done`` jumping by the phase's steps. A caller that
stops the run (the callback returns False) stops it there: at a warm-up step, or at the end of a phase.
A phase cannot be cut shorter without changing the result: cutting it drains the pipeline, so the next
steps would read other K/V than the uncut phase's.

With a host-planned cache (MagCache, TaylorSeer: ``cache.py``) the skipped steps run inside the programs
of the full steps they follow, so ``done`` after the last warm-up step also counts the skipped steps
right after it, and the pipelined phase (the remaining full steps, each with its skipped steps) ends at
the last step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxdit.pipelines.denoiser import DenoiseInputs, DenoiseResult
from jaxdit.pipelines.pipefusion.runner import PipeFusionRunner, lower
from jaxdit.samplers.sampler import Sampler

__all__ = ["PipeFusionDenoiser"]


class PipeFusionDenoiser:
    """``run(inputs, progress=, callback=, warmup_steps=, num_pipeline_patch=, **family options)``.

    ``experts(index) -> parameters`` on the mesh (in the stage layout of the runner's model), for inputs
    that choose a parameter set per step (Wan 2.2 A14B: ``DenoiseInputs.experts`` / ``scales``); the
    runner cuts the schedule into one PipeFusion run per expert segment.
    """

    def __init__(
        self, runner: PipeFusionRunner, sampler: Sampler, *, experts: Callable[[int], Any] | None = None
    ) -> None:
        self.runner, self.sampler, self.experts = runner, sampler, experts

    @property
    def last_programs(self) -> dict[str, Any]:
        return self.runner.last_programs

    def check(
        self, grid: tuple[int, ...], steps: int, warmup_steps: int | None, patches: int | None, **options
    ):
        """The patch count for a request, checked with the warm-up steps before any work."""
        return self.runner.check(grid, steps, 1 if warmup_steps is None else warmup_steps, patches, **options)

    def lower(
        self,
        inputs: DenoiseInputs,
        *,
        warmup_steps: int | None = None,
        num_pipeline_patch: int | None = None,
        **options: Any,
    ) -> tuple[Any, Any]:
        """The warm-up step and the pipelined phase (None when every step is a warm-up step) for
        ``inputs``, lowered from abstract shapes (the model may be abstract; only shapes are read). With
        two experts the run has one pipelined phase per expert (``segments.py``); this lowers the one
        phase of a single expert, whose programs have the same per-tick collectives."""
        runner, warmup = self.runner, 1 if warmup_steps is None else warmup_steps
        patches = runner.check(inputs.grid, inputs.steps, warmup, num_pipeline_patch, **options)
        context = {**inputs.context, **inputs.extras}
        requests = np.shape(inputs.tokens)[0]
        g = runner.family.geometry(inputs.grid, patches, runner.parallel, requests, context, **options)
        programs = runner.programs_for(g, g.batch == 2 * g.requests, self.sampler)
        return lower(programs, inputs.schedule, steps=inputs.steps, warmup_steps=warmup)

    def run(
        self,
        inputs: DenoiseInputs,
        *,
        progress: bool = True,
        callback: Callable[[int, int], bool | None] | None = None,
        warmup_steps: int | None = None,
        num_pipeline_patch: int | None = None,
        cache: Any = None,
        **options: Any,
    ) -> DenoiseResult:
        """``cache``: a host-planned feature cache (MagCache, TaylorSeer; ``pipefusion/cache.py``)."""
        warmup = 1 if warmup_steps is None else warmup_steps
        start = time.perf_counter()
        tokens = self.runner(
            inputs.tokens,
            {**inputs.context, **inputs.extras},
            sampler=self.sampler,
            schedule=inputs.schedule,
            grid=inputs.grid,
            guidance_scale=inputs.scale,
            num_inference_steps=inputs.steps,
            warmup_steps=warmup,
            num_pipeline_patch=num_pipeline_patch,
            progress=progress,
            experts=inputs.experts,
            scales=inputs.scales,
            params=self.experts,
            callback=callback,
            cache=cache,
            **options,
        )
        report = self.runner.last_cache if cache is not None else None
        return DenoiseResult(tokens, time.perf_counter() - start, report)
