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
  stages one after another.

Compute takes ``FLOPs / achieved FLOP/s``; ``--tflops`` is what a device really sustains on these
matmuls, not its datasheet peak.
"""

from __future__ import annotations

import dataclasses

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
#: Achieved dense bf16 TFLOP/s of one H100 SXM on FLUX-dev: xDiT measured 4.30 s for 28 steps at
#: 1024px with torch.compile (docs/performance/flux.md), 74.4 TFLOP a step -> ~480 (49% of 989 peak).
DEFAULT_TFLOPS = 480.0
#: Memory of one device (H100 80 GB).
DEFAULT_MEMORY_GB = 80.0
#: PipeFusion defaults, as xDiT's: synchronous warm-up steps, patches per step = stages.
PIPEFUSION_WARMUP_STEPS = 1


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device and the link between devices."""

    link: str = "nvlink"
    bandwidth_gbs: float | None = None  # default: LINKS[link]
    latency_s: float | None = None
    tflops: float = DEFAULT_TFLOPS
    memory_gb: float = DEFAULT_MEMORY_GB

    def __post_init__(self) -> None:
        if self.link not in LINKS:
            raise ValueError(f"unknown link {self.link!r}; known: {', '.join(LINKS)}")
        values = (1.0 if self.bandwidth_gbs is None else self.bandwidth_gbs, self.tflops, self.memory_gb)
        if min(values) <= 0 or (self.latency_s is not None and self.latency_s < 0):
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

    def describe(self) -> str:
        return (
            f"{self.link} {self.bandwidth / 1e9:g} GB/s, {self.latency * 1e6:g} us per collective; "
            f"{self.tflops:g} TFLOP/s achieved; {self.memory_gb:g} GB per device"
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


def timing(cost: StepCost, hw: Hardware) -> Timing:
    """Step and generation latency of ``cost`` on ``hw`` (module docstring)."""
    compute = cost.flops / hw.flops
    by: dict[str, list] = {}
    for c in cost.collectives:
        one = hw.latency + c.sent_bytes() / hw.bandwidth
        hidden = min(one, c.overlap_flops / hw.flops)
        entry = by.setdefault(c.strategy, [0.0, 0.0, c.overlapped])
        entry[0] += c.count * one
        entry[1] += c.count * (one - hidden)
    total = sum(v[0] for v in by.values())
    exposed = sum(v[1] for v in by.values())
    step = compute + exposed
    steps = cost.workload.steps
    p = cost.config.pipefusion
    if p > 1:
        warmup = min(PIPEFUSION_WARMUP_STEPS, steps)
        async_steps = steps - warmup
        m, depth = cost.patches, cost.passes * p
        ticks = (async_steps - 1) * max(m, depth) + m - 1 + depth if async_steps else 0
        # Warm-up: the whole sequence passes the stages one after another.
        generation = warmup * (p * compute + total) + ticks * compute / m + async_steps * exposed
    else:
        generation = steps * step
    return Timing(
        compute=compute,
        comm_total=total,
        comm_exposed=exposed,
        step=step,
        generation=generation,
        by_strategy={k: (v[0], v[1], v[2]) for k, v in by.items()},
    )
