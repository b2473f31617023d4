"""Hold the cost model against compiled programs: compile one denoising step per configuration on
emulated CPU devices from abstract shapes (no weights allocated) and measure it with ``jaxdit.hlo_stats``.

The step compiled is the pipelines' own (``jaxdit.pipelines.denoiser``): the family's pipeline on the
abstract model, prepared from a request of the workload's shape with zero embeddings
(``ModelFamily.example_request``): the two-branch batch built without communication
(``cfg.replicate_branches``), the sharded transformer forward, CFG's exchange (``cfg.combine_branches``)
and the family's sampler update (elementwise), latents kept in the padded token layout. Parameters are
``jax.ShapeDtypeStruct``s in the workload's dtype (bf16 as served); no weight is read.

PipeFusion is compiled separately (:func:`verify_pipefusion`), through the same pipelines on the abstract
stage layout: the runner's warm-up step and its pipelined phase (the remaining steps as one scan,
fill/drain bubbles included), each program's collective bytes against ``cost.pipefusion_programs``
evaluated for that same program.

What is compared:

- Collective bytes sent per device, loop trip counts included, against the model priced as the CPU
  backend sends them (bf16 collectives widened to f32; the fp32 all-reduces and Wan's fp32 prediction
  unchanged). The model's GPU bytes are printed beside them.
- Matmul FLOPs per device (``hlo_stats.flops_per_device``), and their sum over devices against a
  one-device compile of the same step: the duplicated work.
- Memory per device: the parameters the step takes (``ShardedForward.param_bytes_per_device``) against
  the model's; activations as the CPU reports them. The CPU backend keeps fp32 copies of bf16 weights
  in ``temp``, so for bf16 the activation figure is ``temp - 2 x bf16 weight bytes`` (an estimate).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxdit.families import for_config
from jaxdit.mesh import ParallelConfig
from jaxdit.plan.cost import StepCost, step_cost
from jaxdit.plan.workload import Workload

#: XLA options for quick CPU compiles: the LLVM optimisation level only; the HLO is the same.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def ensure_cpu_devices(count: int) -> None:
    """Emulate at least ``count`` CPU devices if jax has not started yet (never fewer than ``XLA_FLAGS``
    asks for: the rest of the process may want them); raise if fewer are available."""
    import jax

    asked = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", max(count, int(asked.group(1)) if asked else 1))
    except RuntimeError:
        pass  # the backend is up already (e.g. under tests/conftest.py); use what it has
    have = len(jax.devices())
    if have < count:
        raise ValueError(
            f"--verify needs {count} devices but jax has {have}; run it in a fresh process (jaxdit plan "
            "--verify emulates CPU devices itself) or set XLA_FLAGS=--xla_force_host_platform_device_count"
        )


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What one compiled step does, per device."""

    config: ParallelConfig
    bytes_sent: float  # collective bytes leaving one device per step (CPU dtypes)
    by_kind: dict[str, dict[str, float]]
    flops: int
    param_bytes: int
    argument_bytes: int
    temp_bytes: int
    activation_bytes: int  # temp minus the CPU's fp32 copies of bf16 weights
    compile_seconds: float


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A configuration's measurement beside its model."""

    model: StepCost
    measured: Measurement
    single_device_flops: int  # measured, one device, same step

    @property
    def bytes_ratio(self) -> float:
        modelled = self.model.bytes_sent(cpu=True)
        if modelled == 0:
            return 1.0 if self.measured.bytes_sent == 0 else math.inf
        return self.measured.bytes_sent / modelled

    @property
    def flops_ratio(self) -> float:
        return self.measured.flops / self.model.flops

    @property
    def summed_flops_ratio(self) -> float:
        """Sum over devices of the measured per-device FLOPs / the measured one-device FLOPs."""
        return self.measured.flops * self.model.config.num_devices / self.single_device_flops

    @property
    def unexpected_kinds(self) -> list[str]:
        """Collective kinds in the program that the model does not have."""
        modelled = self.model.by_kind(cpu=True)
        return sorted(k for k, v in self.measured.by_kind.items() if v["count"] and k not in modelled)

    def to_json(self) -> dict[str, Any]:
        m = self.measured
        return {
            "config": self.model.config.describe(),
            "bytes_sent_measured_cpu": m.bytes_sent,
            "bytes_sent_modelled_cpu": self.model.bytes_sent(cpu=True),
            "bytes_sent_modelled_gpu": self.model.bytes_sent(),
            "bytes_ratio": self.bytes_ratio,
            "collectives_measured": {k: v for k, v in m.by_kind.items() if v["count"]},
            "flops_measured": m.flops,
            "flops_modelled": self.model.flops,
            "flops_ratio": self.flops_ratio,
            "summed_over_single_measured": self.summed_flops_ratio,
            "summed_over_single_modelled": 1 + self.model.duplicated_flops,
            "param_bytes_measured": m.param_bytes,
            "param_bytes_modelled": self.model.param_bytes,
            "activation_bytes_measured_cpu": m.activation_bytes,
            "activation_bytes_modelled": self.model.activation_bytes,
            "temp_bytes_cpu": m.temp_bytes,
            "unexpected_collectives": self.unexpected_kinds,
            "compile_seconds": m.compile_seconds,
        }


# ----------------------------------------------------------------------------------------------------
# Building the step


@functools.cache
def _abstract_model(config: Any, dtype: str) -> Any:
    import jax.numpy as jnp

    return for_config(config).checkpoints.abstract_model(config, jnp.dtype(dtype))


def lower_step(w: Workload, config: ParallelConfig, devices: Sequence[Any] | None = None):
    """Lower one denoising step of ``w`` on ``config`` from abstract shapes; returns (lowered, forward).

    The step is the pipelines' own (``jaxdit.pipelines.denoiser``), prepared from a request of ``w``'s
    shape with zero embeddings (``ModelFamily.example_request``) and the abstract model: no weight is
    read, nothing runs."""
    import jax
    import jax.numpy as jnp

    if config.pipefusion > 1:
        raise ValueError(f"{config.describe()}: PipeFusion has its own programs; use verify_pipefusion")
    devices = list(jax.devices() if devices is None else devices)[: config.num_devices]
    where = config.device_mesh(devices)
    if w.fp8:  # a fresh model: quantizing changes it in place, and _abstract_model's are shared
        from jaxdit.models.quantize import quantize_model

        model = w.family.checkpoints.abstract_model(w.model, jnp.dtype(w.dtype))
        quantize_model(model, "weight")
    else:
        model = _abstract_model(w.model, w.dtype)
    pipe = w.family.bare_pipeline(model, where, compiler_options=FAST_COMPILE)
    inputs = pipe.prepare(w.family.example_request(w)).inputs
    return pipe.denoiser.lower(inputs), pipe.forward


def _widened_weight_bytes(forward) -> int:
    """Bytes of the fp32 copies a CPU program makes of the weights stored narrower (bf16, FP8)."""
    import jax
    import jax.numpy as jnp

    total = 0
    for x, s in zip(jax.tree.leaves(forward.state), jax.tree.leaves(forward.param_shardings), strict=True):
        if jnp.dtype(x.dtype).itemsize < 4:
            total += math.prod(s.shard_shape(tuple(x.shape))) * 4
    return total


def measure(lowered, forward, config: ParallelConfig, seconds: float = 0.0) -> tuple[Measurement, Any]:
    """Compile ``lowered`` and read collectives, FLOPs and memory per device from the program."""
    from jaxdit import hlo_stats

    start = time.perf_counter()
    compiled = lowered.compile()
    seconds += time.perf_counter() - start
    summary = hlo_stats.summarize(compiled)
    mem = hlo_stats.memory_per_device(compiled)
    copies = _widened_weight_bytes(forward)  # the CPU's fp32 copies of bf16 / FP8 weights
    return (
        Measurement(
            config=config,
            bytes_sent=summary["total"]["bytes_sent"],
            by_kind={k: v for k, v in summary.items() if k != "total"},
            flops=hlo_stats.flops_per_device(compiled),
            param_bytes=forward.param_bytes_per_device(),
            argument_bytes=mem["argument"],
            temp_bytes=mem["temp"],
            activation_bytes=max(mem["temp"] - copies, 0),
            compile_seconds=seconds,
        ),
        compiled,
    )


def verify_many(
    jobs: Sequence[tuple[Workload, Sequence[ParallelConfig]]],
    *,
    threads: int = 2,
    progress: Callable[[str], None] | None = None,
) -> list[list[Comparison]]:
    """:func:`verify` for several workloads, all compiles sharing one pool."""
    jobs = [(w, list(configs)) for w, configs in jobs]
    ensure_cpu_devices(max([c.num_devices for _, cs in jobs for c in cs] + [1]))
    say = progress or (lambda s: None)

    def compile_one(low, fwd, c, seconds):
        result, _ = measure(low, fwd, c, seconds)
        say(f"compiled {c.describe()} in {result.compile_seconds:.1f} s")
        return result

    # Lowering (tracing) holds the GIL; XLA's compile releases it. Each step is handed to the pool as
    # soon as it is lowered, so tracing the next one overlaps the compiles.
    futures = []
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for w, configs in jobs:
            row = []
            for c in [ParallelConfig(), *configs]:
                start = time.perf_counter()
                low, fwd = lower_step(w, c)
                say(f"lowered {w.name} {c.describe()}")
                row.append(pool.submit(compile_one, low, fwd, c, time.perf_counter() - start))
                del low, fwd
            futures.append(row)
        results = [[f.result() for f in row] for row in futures]
    out = []
    for (w, configs), (single, *rest) in zip(jobs, results, strict=True):
        out.append([Comparison(step_cost(w, c), r, single.flops) for c, r in zip(configs, rest, strict=True)])
    return out


def verify(
    w: Workload,
    configs: Iterable[ParallelConfig],
    *,
    threads: int = 2,
    progress: Callable[[str], None] | None = None,
) -> list[Comparison]:
    """Compile ``w``'s step on every config (and on one device) and compare each with the model.

    Compiles run ``threads`` at a time (XLA's CPU compile is mostly single-threaded and releases the
    GIL). PipeFusion configurations are not compiled here: they go through :func:`verify_pipefusion`
    (the runners' own warm-up and pipelined programs).
    """
    return verify_many([(w, list(configs))], threads=threads, progress=progress)[0]


# ----------------------------------------------------------------------------------------------------
# PipeFusion: the runner's two programs against the model evaluated the same way


@dataclasses.dataclass(frozen=True)
class PipeFusionComparison:
    """A PipeFusion configuration: collective bytes sent per device by each compiled program of
    the PipeFusion runner (``jaxdit.pipelines.pipefusion``, the family's adapter) beside
    :func:`jaxdit.plan.cost.pipefusion_programs` (CPU dtypes).

    ``warmup``: one synchronous warm-up step. ``pipelined``: the asynchronous phase, the S-W remaining
    steps as one scan of ``ticks`` ticks, pipeline fill and drain (bubbles) included, against the model's
    per-tick bytes times the same ticks -- not against S-W steady-state steps."""

    model: StepCost
    modelled: dict[str, float]  # pipefusion_programs(cpu=True)
    warmup_measured: float
    pipelined_measured: float
    by_kind: dict[str, dict[str, float]]  # both programs, per kind
    warmup_steps: int
    compile_seconds: float

    @staticmethod
    def _ratio(measured: float, modelled: float) -> float:
        if modelled == 0:
            return 1.0 if measured == 0 else math.inf
        return measured / modelled

    @property
    def warmup_ratio(self) -> float:
        return self._ratio(self.warmup_measured, self.modelled["warmup"])

    @property
    def pipelined_ratio(self) -> float:
        return self._ratio(self.pipelined_measured, self.modelled["pipelined"])

    @property
    def unexpected_kinds(self) -> list[str]:
        modelled = self.model.by_kind(cpu=True)
        return sorted(k for k, v in self.by_kind.items() if v["count"] and k not in modelled)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.model.config.describe(),
            "warmup_steps": self.warmup_steps,
            "patches": self.modelled["patches"],
            "ticks": self.modelled["ticks"],
            "warmup_step_bytes_measured_cpu": self.warmup_measured,
            "warmup_step_bytes_modelled_cpu": self.modelled["warmup"],
            "warmup_ratio": self.warmup_ratio,
            "pipelined_bytes_measured_cpu": self.pipelined_measured,
            "pipelined_bytes_modelled_cpu": self.modelled["pipelined"],
            "pipelined_ratio": self.pipelined_ratio,
            "steady_step_bytes_modelled_cpu": self.modelled["steady_step"],
            "collectives_measured": {k: v for k, v in self.by_kind.items() if v["count"]},
            "unexpected_collectives": self.unexpected_kinds,
            "compile_seconds": self.compile_seconds,
        }


def lower_pipefusion(w: Workload, config: ParallelConfig, warmup_steps: int = 1, devices=None):
    """PipeFusion's warm-up step and pipelined phase lowered from abstract shapes, with the plan's patch
    count (``cost.pipeline_shape``: M = V x P, a pass per block stack, unless the family says), as the
    pipelines run them: the family's pipeline on the abstract stage layout, prepared from a request of
    ``w``'s shape (``ModelFamily.example_request``)."""
    import jax
    import jax.numpy as jnp

    from jaxdit.plan.cost import pipeline_shape

    if not 1 <= warmup_steps <= w.steps:
        raise ValueError(f"warmup_steps={warmup_steps} for {w.steps} steps")
    devices = list(jax.devices() if devices is None else devices)[: config.num_devices]
    where = config.device_mesh(devices)
    model = w.family.staged_model.abstract(w.model, where, jnp.dtype(w.dtype))
    pipe = w.family.bare_pipeline(model, where, compiler_options=FAST_COMPILE)
    inputs = pipe.prepare(w.family.example_request(w)).inputs
    _, patches = pipeline_shape(w, config)
    return pipe.denoiser.lower(inputs, warmup_steps=warmup_steps, num_pipeline_patch=patches)


def pipefusion_not_compilable(w: Workload, config: ParallelConfig) -> str | None:
    """Why :func:`lower_pipefusion` cannot compile ``config`` with the plan's patch count, or None.

    The plan models a full pipeline (M = V x P patches); a family's patches may be whole latent rows
    (Wan), so when P does not divide the rows (Wan at 720p: 45) the runner would need a larger M that the
    model does not price, and the comparison would not be like for like."""
    if getattr(w.family, "staged_model", None) is None:  # as the plan's row says: nothing to compile
        return f"no PipeFusion stage layout for {w.family.display} yet"
    unsupported = w.family.pipefusion_unsupported(w)
    if unsupported is not None:
        return unsupported
    import jax
    import jax.numpy as jnp

    from jaxdit.plan.cost import pipeline_shape

    where = config.device_mesh(jax.devices()[: config.num_devices])
    model = w.family.staged_model.abstract(w.model, where, jnp.dtype(w.dtype))
    pipe = w.family.bare_pipeline(model, where, compiler_options=FAST_COMPILE)
    inputs = pipe.prepare(w.family.example_request(w)).inputs
    _, patches = pipeline_shape(w, config)
    try:
        pipe.denoiser.check(inputs.grid, w.steps, 1, patches)
    except ValueError as e:
        return str(e)
    return None


def verify_pipefusion(
    w: Workload,
    configs: Iterable[ParallelConfig],
    *,
    warmup_steps: int = 1,
    threads: int = 2,
    progress: Callable[[str], None] | None = None,
) -> list[PipeFusionComparison]:
    """Compile PipeFusion's two programs (FLUX or Wan) per config and compare their collective bytes per device
    with :func:`jaxdit.plan.cost.pipefusion_programs` (see :class:`PipeFusionComparison`)."""
    from jaxdit import hlo_stats
    from jaxdit.plan.cost import pipefusion_programs

    configs = list(configs)
    ensure_cpu_devices(max([c.num_devices for c in configs] + [1]))
    say = progress or (lambda s: None)

    def compile_one(lowered, seconds):
        start = time.perf_counter()
        summary = hlo_stats.summarize(lowered.compile()) if lowered is not None else {}
        return summary, seconds + time.perf_counter() - start

    out = []
    with ThreadPoolExecutor(max(1, threads)) as pool:
        pending = []
        for c in configs:
            start = time.perf_counter()
            warm, run = lower_pipefusion(w, c, warmup_steps)
            say(f"lowered {w.name} {c.describe()} (warm-up step and pipelined phase)")
            seconds = (time.perf_counter() - start) / 2
            pending.append(
                (c, pool.submit(compile_one, warm, seconds), pool.submit(compile_one, run, seconds))
            )
            del warm, run
        for c, fw, fr in pending:
            (sw, tw), (sr, tr) = fw.result(), fr.result()
            kinds = sorted((set(sw) | set(sr)) - {"total"})
            zero = {"count": 0, "bytes_sent": 0.0}
            by_kind = {
                k: {f: sw.get(k, zero)[f] + sr.get(k, zero)[f] for f in ("count", "bytes_sent")}
                for k in kinds
            }
            result = PipeFusionComparison(
                model=step_cost(w, c),
                modelled=pipefusion_programs(w, c, warmup_steps, cpu=True),
                warmup_measured=sw.get("total", zero)["bytes_sent"],
                pipelined_measured=sr.get("total", zero)["bytes_sent"],
                by_kind=by_kind,
                warmup_steps=warmup_steps,
                compile_seconds=tw + tr,
            )
            say(f"compiled {c.describe()} in {result.compile_seconds:.1f} s")
            out.append(result)
    return out
