"""From a step's cost to time: link and compute rates, what overlaps, step and generation latency.

A collective takes ``latency + bytes_sent / bandwidth`` (one link type for every mesh axis, the
bandwidth one device gets in one direction). Whether it costs step time depends on the strategy:

- Ulysses' all-to-alls, tensor parallelism's all-reduces and CFG's exchange are exposed: the next
  operation needs their result (attention needs every token's q/k/v; the residual add needs the sum).
- Ring's K/V permutes are issued before the local block is computed (``parallel/ring.py``), so each
  hop costs only what exceeds one block's attention compute (on GPU this needs XLA's latency-hiding
  scheduler).
- PipeFusion's patch sends overlap the tick's compute. Its M patches flow through V x P virtual stages
  (``parallel/pipefusion.py``'s schedule): the asynchronous steps take ``(steps-1) x max(M, V P) + M - 1
  + V P`` ticks of 1/M of a device's step compute each, so filling and draining the pipeline costs about
  one step per generation; the warm-up steps (xDiT's default: one) run the whole sequence through the
  stages one after another. Wan 2.2 A14B's two experts are two such runs (each expert's steps start with
  their own warm-up step: its K/V is no context for the other expert), so twice the warm-up, fill and drain.

Compute takes ``FLOPs / achieved FLOP/s`` at two rates: attention (``StepCost.attention_flops``: QK^T and
PV of self-attention) at the attention kernel's throughput, everything else at the matmul rate
(``--tflops``: what a device really sustains on these matmuls, not its datasheet peak). On an H100 XLA's
attention runs about 7x slower than the matmuls, a fused kernel faster than them (the
:data:`ATTENTION_TFLOPS` table). Wan's cross-attention to the text (and I2V image) tokens runs through
the same kernel but is priced at the matmul rate: 512/n of the self-attention's FLOPs, 1.6% at 480p and
0.7% at 720p (I2V's 257 image tokens add half as much again).
Ring's hidden hops overlap the local attention, so they are hidden at the attention rate; PipeFusion's
at the step's average rate.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import statistics
from pathlib import Path
from typing import Any

from jaxdit.plan.cost import StepCost

#: link -> (GB/s per device per direction, effective; seconds of latency per collective).
LINKS: dict[str, tuple[float, float]] = {
    # H100/H200 SXM NVLink 4: 450 GB/s per direction nominal; ~300 effective (the seed chapter's figure).
    "nvlink": (300.0, 10e-6),
    # PCIe 4.0 x16: 32 GB/s nominal, ~25 effective (the seed chapter's exercise).
    "pcie": (25.0, 20e-6),
    # One 400 Gb/s InfiniBand NDR port per GPU: 50 GB/s nominal, ~45 effective.
    "ib": (45.0, 25e-6),
}
#: Achieved dense bf16 matmul TFLOP/s of one H100 SXM on FLUX-dev: xDiT measured 4.30 s for 28 steps at
#: 1024px with torch.compile (docs/performance/flux.md), i.e. 153.6 ms for a 74.4 TFLOP step of which
#: 14.9 TFLOP is attention; with that attention at a fused kernel's 680 TFLOP/s (21.9 ms; xDiT uses
#: FlashAttention 3) the other 59.5 TFLOP took 131.7 ms -> ~450 (46% of the 989 peak).
DEFAULT_TFLOPS = 450.0
#: Memory of one device (H100 80 GB).
DEFAULT_MEMORY_GB = 80.0
#: PipeFusion defaults, as xDiT's: synchronous warm-up steps, patches per step = stages.
PIPEFUSION_WARMUP_STEPS = 1


#: Forward attention TFLOP/s of one H100 SXM per kernel (bf16, head_dim 128, non-causal, no mask), from
#: the autotuning timings tokamax publishes (github.com/openxla/tokamax,
#: tokamax/data/autotuning/nvidia_h100_80gb_hbm3/*.json) for q/k/v [4, 4096, 16, 128] (5.50e11 FLOP;
#: [1, 16384, 16, 128] gives the same rates within 6%), with the residuals (log-sum-exp) that jaxdit's
#: kernels return wherever the file has that entry:
#: cudnn: jax_nn_dot_product_attention.json (jax.nn.dot_product_attention's cuDNN call) 0.810 ms -> 679;
#: triton: pallas_triton_flash_attention.json, return_residuals, 1.401 ms -> 392;
#: xla: dot_product_attention.json (plain XLA softmax attention), return_residuals, 8.834 ms -> 62 (90
#: without residuals; its 128 x 128 online-softmax variant, xla_chunked_dot_product_attention.json, 52).
#: jaxdit's own XLA kernel is an online softmax over 1024-key tiles; ``scripts/gpu_check.py`` measures
#: each backend at this project's shapes, and ``--calibration`` / ``--attention_tflops`` use that.
ATTENTION_TFLOPS: dict[str, float] = {"cudnn": 680.0, "triton": 390.0, "xla": 62.0}
#: What ``--attention_backend`` accepts; splash is TPU's kernel: no H100 figure, so it needs a rate.
ATTENTION_BACKENDS = ("auto", "xla", "cudnn", "triton", "splash")


def implemented_backends() -> tuple[str, ...]:
    """The attention kernels this checkout has: all of them once ``jaxdit.parallel.kernels`` exists,
    else the XLA kernel only."""
    try:
        found = importlib.util.find_spec("jaxdit.parallel.kernels") is not None
    except ImportError:
        found = False
    return ("xla", "cudnn", "triton", "splash") if found else ("xla",)


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """The attention kernel a configuration's step runs, and the rate the plan prices it at."""

    backend: str
    tflops: float
    source: str  # where the rate comes from
    why: str  # why this kernel: auto's choice, the request, or the reason the request fell back
    implemented: bool = True  # False: modelled only, this checkout cannot run it

    @property
    def flops(self) -> float:
        return self.tflops * 1e12

    def describe(self) -> str:
        line = f"attention kernel {self.backend} at {self.tflops:g} TFLOP/s ({self.why}; {self.source})"
        if not self.implemented:
            line += (
                "; modelled only: this checkout has only the XLA kernel, which --attention_backend xla models"
            )
        return line


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device and the link between devices.

    ``attention_backend``: the kernel asked for (auto: cuDNN for fp16/bf16, else XLA, as jaxdit picks on
    an NVIDIA GPU); ``attention_tflops``: its measured rate, instead of :data:`ATTENTION_TFLOPS`.
    """

    link: str = "nvlink"
    bandwidth_gbs: float | None = None  # default: LINKS[link]
    latency_s: float | None = None
    tflops: float = DEFAULT_TFLOPS
    memory_gb: float = DEFAULT_MEMORY_GB
    attention_backend: str = "auto"
    attention_tflops: float | None = None
    attention_source: str | None = None  # where attention_tflops came from (default: --attention_tflops)

    def __post_init__(self) -> None:
        if self.link not in LINKS:
            raise ValueError(f"unknown link {self.link!r}; known: {', '.join(LINKS)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention backend {self.attention_backend!r}; known: {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.attention_tflops is not None and not (
            math.isfinite(self.attention_tflops) and self.attention_tflops > 0
        ):
            raise ValueError(f"attention_tflops must be positive, got {self.attention_tflops}")
        if self.attention_backend == "splash" and self.attention_tflops is None:
            raise ValueError(
                "splash is TPU's attention kernel and the plan's defaults are an H100's: give its rate "
                "with --attention_tflops (or --calibration from a gpu_check run on the TPU)"
            )
        values = (1.0 if self.bandwidth_gbs is None else self.bandwidth_gbs, self.tflops, self.memory_gb)
        latency = 0.0 if self.latency_s is None else self.latency_s
        if not all(math.isfinite(v) and v > 0 for v in values) or not (
            math.isfinite(latency) and latency >= 0
        ):
            raise ValueError(
                f"bandwidth ({self.bandwidth_gbs} GB/s), tflops ({self.tflops}) and memory "
                f"({self.memory_gb} GB) must be positive and latency ({self.latency_s} s) not negative"
            )

    @property
    def bandwidth(self) -> float:
        """Bytes per second."""
        return (self.bandwidth_gbs or LINKS[self.link][0]) * 1e9

    @property
    def latency(self) -> float:
        return LINKS[self.link][1] if self.latency_s is None else self.latency_s

    @property
    def flops(self) -> float:
        return self.tflops * 1e12

    def attention_kernel(self, dtype: str, head_dim: int) -> AttentionKernel:
        """The kernel attention of ``dtype`` with ``head_dim`` runs on, as jaxdit picks it on an NVIDIA GPU
        with cuDNN (a TPU for ``splash``), by the library's own choice (``jaxdit.parallel.kernels``:
        ``auto`` is cuDNN for fp16/bf16, XLA for fp32; a kernel that cannot serve the dtype or head
        dimension falls back cudnn -> triton -> xla), and the rate it is priced at."""
        from jaxdit.parallel.kernels import backend_for

        asked = self.attention_backend
        platform = "tpu" if asked == "splash" else "cuda"
        choice = backend_for(platform, dtype, (1, 1, 1, head_dim), requested=asked, assume_present=True)
        backend = choice.backend
        if asked == "auto":
            why = f"auto for {dtype} on an NVIDIA GPU" + (f" ({choice.reason})" if choice.reason else "")
        elif choice.reason:
            why = f"{asked} asked; {choice.reason}: {backend} instead"
        else:
            why = "asked"
        if self.attention_tflops is not None:
            rate, source = self.attention_tflops, self.attention_source or "--attention_tflops"
        else:
            rate, source = ATTENTION_TFLOPS[backend], "tokamax's H100 timings"
        return AttentionKernel(backend, rate, source, why, implemented=backend in implemented_backends())

    def describe(self) -> str:
        return (
            f"{self.link} {self.bandwidth / 1e9:g} GB/s, {self.latency * 1e6:g} us per collective; "
            f"matmuls at {self.tflops:g} TFLOP/s achieved; {self.memory_gb:g} GB per device"
        )


@dataclasses.dataclass(frozen=True)
class Timing:
    """Modelled times of one configuration, in seconds."""

    compute: float  # one step's compute on the busiest device
    comm_total: float  # all collectives of a step, back to back
    comm_exposed: float  # the part not hidden behind compute
    step: float  # steady-state step
    generation: float  # every step of one generation (transformer only: no text encoder, no VAE)
    by_strategy: dict[str, tuple[float, float, bool]]  # strategy -> (total, exposed, overlapped)
    attention: float = 0.0  # the part of ``compute`` spent in the attention kernel
    kernel: AttentionKernel | None = None


def pipefusion_warmup_steps(cost: StepCost) -> int:
    """The synchronous warm-up steps of a PipeFusion run: xDiT's one per expert (Wan 2.2 A14B: one
    PipeFusion run per expert, each with its own warm-up, fill and drain)."""
    return min(PIPEFUSION_WARMUP_STEPS * cost.workload.experts, cost.workload.steps)


def pipefusion_generation(
    cost: StepCost, compute: float, total: float, exposed: float, skipped: int = 0, skipped_step: float = 0.0
) -> float:
    """A PipeFusion run's seconds (module docstring) from one step's ``compute``, its collectives'
    ``total`` and ``exposed`` time. ``skipped``: steps a host-planned cache skips (never a warm-up step),
    each costing ``skipped_step`` and no tick: the pipelined loop runs the full steps only
    (``jaxdit.pipelines.pipefusion.cache``)."""
    p, segments = cost.config.pipefusion, cost.workload.experts
    warmup = pipefusion_warmup_steps(cost)
    full = cost.workload.steps - warmup - skipped
    m, depth = cost.patches, cost.passes * p
    runs = min(segments, full)
    ticks = (full - runs) * max(m, depth) + runs * (m - 1 + depth)
    # Warm-up: the whole sequence passes the stages one after another.
    return warmup * (p * compute + total) + ticks * compute / m + full * exposed + skipped * skipped_step


def timing(cost: StepCost, hw: Hardware) -> Timing:
    """Step and generation latency of ``cost`` on ``hw`` (module docstring)."""
    w = cost.workload
    kernel = hw.attention_kernel(w.dtype, w.head_dim)
    attention = cost.attention_flops / kernel.flops
    compute = (cost.flops - cost.attention_flops) / hw.flops + attention
    per_flop = compute / cost.flops if cost.flops else 1.0 / hw.flops
    by: dict[str, list] = {}
    for c in cost.collectives:
        one = hw.latency + c.sent_bytes() / hw.bandwidth
        # Ring's hop hides behind the attention of the block in hand; other overlap behind the step's mix.
        overlap_rate = 1.0 / kernel.flops if c.strategy == "ring" else per_flop
        hidden = min(one, c.overlap_flops * overlap_rate)
        entry = by.setdefault(c.strategy, [0.0, 0.0, c.overlapped])
        entry[0] += c.count * one
        entry[1] += c.count * (one - hidden)
    total = sum(v[0] for v in by.values())
    exposed = sum(v[1] for v in by.values())
    step = compute + exposed
    steps = cost.workload.steps
    if cost.config.pipefusion > 1:
        generation = pipefusion_generation(cost, compute, total, exposed)
    else:
        generation = steps * step
    return Timing(
        compute=compute,
        comm_total=total,
        comm_exposed=exposed,
        step=step,
        generation=generation,
        by_strategy={k: (v[0], v[1], v[2]) for k, v in by.items()},
        attention=attention,
        kernel=kernel,
    )


def read_calibration(path: str | Path, backend: str) -> dict[str, Any]:
    """Rates measured by ``scripts/gpu_check.py`` (its ``--out`` JSON) for ``backend``: the median
    attention TFLOP/s over the shapes it timed, and, where it timed whole steps with that backend, the
    matmul rate those steps imply (step time less the attention at the measured rate). Returns
    ``{"attention_tflops", "tflops" (or None), "source"}``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--calibration {path}: cannot read it as gpu_check JSON ({e})") from e
    rows = [r for r in data.get("attention", []) if r.get("tflops")]
    mine = [r["tflops"] for r in rows if r.get("backend") == backend]
    if not mine:
        have = sorted({r.get("backend") for r in rows})
        raise ValueError(
            f"--calibration {path} has no attention timing for {backend} (it has: {', '.join(have) or 'none'}); "
            "run gpu_check where that kernel runs, or pick one of these with --attention_backend"
        )
    attention = statistics.median(mine)
    steps = [
        (s["flops"] - s["attention_flops"]) / (s["seconds"] - s["attention_flops"] / (attention * 1e12))
        for s in data.get("steps", [])
        if s.get("backend") == backend
        and s.get("seconds")
        and s["seconds"] > s["attention_flops"] / (attention * 1e12)
    ]
    device = data.get("meta", {}).get("device", "unknown device")
    return {
        "attention_tflops": attention,
        "tflops": statistics.median(steps) / 1e12 if steps else None,
        "source": f"measured by gpu_check on {device} ({path.name})",
    }
