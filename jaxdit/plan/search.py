"""Every parallel configuration of a device count for a workload: valid or not (and why), each one's
modelled cost and latency, ranked, with a recommendation first.

A configuration is valid when jaxdit can express it for this workload: cfg=2 needs two guidance
branches, data parallelism needs that many requests (it never shortens one generation), heads must split
over ulysses x tensor, PipeFusion needs at least one block of each stack per stage. A valid
configuration can still be flagged: PipeFusion is modelled but not implemented yet (until
``jaxdit/parallel/pipefusion.py`` lands) and changes the result (stale K/V), and a configuration may
not fit the device's memory. The recommendation is the fastest modelled configuration that runs in
jaxdit today, is exact and fits; within 3% of the fastest it is the one that sends the fewest bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxdit.mesh import MESH_AXES, ParallelConfig
from jaxdit.plan.cost import StepCost, step_cost
from jaxdit.plan.latency import Hardware, Timing, timing
from jaxdit.plan.workload import Workload


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


#: The most devices one plan enumerates: far beyond one generation's mesh, and a bound on the work (a
#: count with many divisors has hundreds of thousands of configurations).
MAX_DEVICES = 4096


def all_configs(devices: int) -> list[ParallelConfig]:
    """Every (data, cfg, pipefusion, ring, ulysses, tensor) with product ``devices`` and cfg <= 2, in the
    order of ``itertools.product`` over each axis's divisors (only products that reach ``devices`` are
    visited, so the work is the number of configurations, not divisors ** axes)."""
    if not 1 <= devices <= MAX_DEVICES:
        raise ValueError(f"devices must be in 1..{MAX_DEVICES}, got {devices}")
    out = []

    def extend(chosen: tuple[int, ...], left: int) -> None:
        axis = len(chosen)
        if axis == len(MESH_AXES):
            if left == 1:
                out.append(ParallelConfig(**dict(zip(MESH_AXES, chosen, strict=True))))
            return
        for d in _divisors(left):
            if MESH_AXES[axis] != "cfg" or d <= 2:
                extend((*chosen, d), left // d)

    extend((), devices)
    return out


def invalid_reasons(w: Workload, c: ParallelConfig) -> list[str]:
    """Why ``c`` cannot run ``w`` (empty when it can)."""
    reasons = []
    if c.cfg == 2 and w.branches == 1:
        why = f" ({w.family.cfg_note})" if w.family.cfg_note else ""
        reasons.append(
            f"cfg=2 needs two guidance branches; {w.name} runs one per step{why}; --cfg for true CFG"
        )
    if c.data > 1 and w.requests % c.data:
        reasons.append(
            f"data={c.data} splits requests, not one generation, and there are {w.requests} (--requests)"
        )
    heads = w.num_heads
    if heads % (c.ulysses * c.tensor):
        reasons.append(f"{heads} heads cannot be split over ulysses={c.ulysses} x tensor={c.tensor}")
    stages = w.family.pipefusion_max_stages(w)
    if c.pipefusion > stages:
        reasons.append(f"pipefusion={c.pipefusion} stages for a stack of {stages} blocks")
    if w.fp8 and c.pipefusion > 1:
        reasons.append("FP8 weights run on meshes without PipeFusion (not supported yet)")
    if c.sequence_degree > min(w.tokens):
        reasons.append(f"ring x ulysses = {c.sequence_degree} shards for a token group of {min(w.tokens)}")
    return reasons


@dataclasses.dataclass(frozen=True)
class Plan:
    """One configuration's verdict, cost and modelled times."""

    config: ParallelConfig
    reasons: tuple[str, ...]  # why it is invalid; empty when valid
    cost: StepCost | None = None
    timing: Timing | None = None
    notes: tuple[str, ...] = ()
    runnable: bool = True  # jaxdit can run it today
    exact: bool = True  # same result as one device
    fits: bool = True

    @property
    def valid(self) -> bool:
        return not self.reasons

    @property
    def name(self) -> str:
        return self.config.describe()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"config": self.name, "degrees": self.config.degrees, "valid": self.valid}
        if not self.valid:
            out["reasons"] = list(self.reasons)
            return out
        c, t = self.cost, self.timing
        out.update(
            runnable=self.runnable,
            exact=self.exact,
            fits=self.fits,
            notes=list(self.notes),
            bytes_sent_per_device_per_step=c.bytes_sent(),
            bytes_sent_by_strategy={s: c.bytes_sent(strategy=s) for s in t.by_strategy},
            collectives=[
                {
                    "strategy": k.strategy,
                    "kind": k.kind,
                    "what": k.what,
                    "count": k.count,
                    "operand_bytes": k.operand_bytes(),
                    "bytes_sent": k.total_sent(),
                    "dtype": k.dtype,
                    "group": k.group,
                    "overlapped": k.overlapped,
                }
                for k in c.collectives
            ],
            comm_seconds_per_step={"total": t.comm_total, "exposed": t.comm_exposed},
            comm_by_strategy={
                s: {"total": v[0], "exposed": v[1], "overlapped": v[2]} for s, v in t.by_strategy.items()
            },
            param_bytes_per_device=c.resident_param_bytes,
            step_param_bytes_per_device=c.param_bytes,
            activation_bytes_per_device=c.activation_bytes,
            kv_cache_bytes_per_device=c.kv_cache_bytes,
            memory_bytes_per_device=c.memory_bytes,
            flops_per_device_per_step=c.flops,
            summed_flops_over_one_device=1 + c.duplicated_flops,
            compute_seconds_per_step=t.compute,
            step_seconds=t.step,
            generation_seconds=t.generation,
        )
        return out


def evaluate(w: Workload, c: ParallelConfig, hw: Hardware) -> Plan:
    """The verdict, cost and timing of one configuration."""
    reasons = invalid_reasons(w, c)
    if reasons:
        return Plan(c, tuple(reasons))
    cost = step_cost(w, c)
    t = timing(cost, hw)
    notes, runnable, exact = [], True, True
    if c.pipefusion > 1:
        exact = False
        notes.append("stale K/V from the previous step (approximate)")
        if getattr(w.family, "staged_model", None) is None:
            runnable = False
            notes.append(f"modelled only: no PipeFusion stage layout for {w.family.display} yet")
        elif (why := w.family.pipefusion_unsupported(w)) is not None:
            runnable = False
            notes.append(f"modelled only: {why}")
    fits = cost.memory_bytes <= hw.memory_gb * 1e9
    if not fits:
        notes.append(f"needs {cost.memory_bytes / 1e9:.1f} GB > {hw.memory_gb:g} GB per device")
        offloaded = cost.memory_bytes - cost.idle_expert_bytes
        if cost.idle_expert_bytes and offloaded <= hw.memory_gb * 1e9:
            notes.append(f"fits with --offload-idle-expert ({offloaded / 1e9:.1f} GB)")
    if w.offload_idle_expert:
        notes.append(f"each expert switch copies {cost.param_bytes / 1e9:.1f} GB per device from host memory")
    return Plan(c, (), cost, t, tuple(notes), runnable, exact, fits)


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """Every configuration of ``devices`` for ``workload``: valid ones ranked, then invalid ones."""

    workload: Workload
    hardware: Hardware
    devices: int
    single: Plan  # one device, the baseline
    plans: tuple[Plan, ...]  # valid: the recommended one first, then by modelled latency (modelled-only last)
    invalid: tuple[Plan, ...]
    recommended: Plan | None

    def find(self, config: ParallelConfig) -> Plan:
        for p in (*self.plans, *self.invalid):
            if p.config == config:
                return p
        raise KeyError(config.describe())

    def to_json(self) -> dict[str, Any]:
        w, hw = self.workload, self.hardware
        rec = self.recommended
        return {
            "workload": {
                "model": w.name,
                "height": w.size[0],
                "width": w.size[1],
                "frames": w.size[2],
                "tokens": list(w.tokens),
                "context_tokens": list(w.context),
                "branches": w.branches,
                "requests": w.requests,
                "steps": w.steps,
                "dtype": w.dtype,
            },
            "hardware": {
                "link": hw.link,
                "bandwidth_bytes_per_s": hw.bandwidth,
                "latency_s": hw.latency,
                "tflops": hw.tflops,
                "memory_gb": hw.memory_gb,
            },
            "devices": self.devices,
            "single_device": self.single.to_json(),
            "recommended": rec.name if rec else None,
            "configurations": [p.to_json() for p in self.plans],
            "invalid": [p.to_json() for p in self.invalid],
        }


#: Modelled latencies this close to the best are ties: the model ignores kernel efficiency and assumes
#: overlap happens, so among near-ties the configuration that sends the fewest bytes is recommended.
TIE_TOLERANCE = 0.03


def _rank(p: Plan) -> tuple:
    """Configurations jaxdit can run before those it only models (a family without a PipeFusion stage
    layout cannot run a PipeFusion configuration however fast it is modelled to be); within each, fitting
    ones by modelled latency, then by bytes; those that do not fit last."""
    return (not p.runnable, not p.fits, p.timing.generation, p.cost.bytes_sent())


def recommend(plans: list[Plan], tolerance: float = TIE_TOLERANCE) -> Plan | None:
    """The exact, runnable, fitting configuration to use: among those within ``tolerance`` of the
    fastest, the one that sends the fewest bytes (it depends least on the link and on overlap)."""
    eligible = [p for p in plans if p.runnable and p.exact and p.fits]
    if not eligible:
        return None
    best = min(p.timing.generation for p in eligible)
    near = [p for p in eligible if p.timing.generation <= best * (1 + tolerance)]
    return min(near, key=lambda p: (p.cost.bytes_sent(), p.timing.generation))


def plan(w: Workload, devices: int, hw: Hardware | None = None, fsdp: bool = False) -> PlanReport:
    """Evaluate every configuration of ``devices`` for ``w``: the recommended one first, then the other
    valid ones that run by modelled latency, then the modelled-only ones, then the invalid ones with their
    reasons. ``fsdp``: every configuration with ``ParallelConfig.fsdp=True`` (``jaxdit plan --fsdp``)."""
    hw = hw or Hardware()
    configs = all_configs(devices)
    if fsdp:
        configs = [dataclasses.replace(c, fsdp=True) for c in configs]
    evaluated = [evaluate(w, c, hw) for c in configs]
    valid = sorted((p for p in evaluated if p.valid), key=_rank)
    rec = recommend(valid)
    if rec is not None:
        valid = [rec] + [p for p in valid if p is not rec]
    invalid = tuple(p for p in evaluated if not p.valid)
    return PlanReport(w, hw, devices, evaluate(w, ParallelConfig(), hw), tuple(valid), invalid, rec)
