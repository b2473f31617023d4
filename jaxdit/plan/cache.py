"""A feature cache in ``jaxdit plan``: each configuration's generation time when a fraction of the block
evaluations is skipped (``--cache fbcache:0.35``). Approximate by nature.

How many blocks a cache skips depends on the prompt, the seed, the threshold and the schedule; the user
gives the expected fraction (``jaxdit generate`` prints the measured one: "N% of block evaluations
skipped"). For a plain (non-PipeFusion) configuration the model then takes a step as:

    compute of the non-block parts (embedders, head)                       unchanged
    + (1 - skip) x (compute of the blocks + exposed Ulysses/Ring/tensor collectives)   they live in blocks
    + CFG's exchange                                                       once per step, unchanged
    + one all-reduce of the metric's two scalars (latency only)            the mesh-wide decision

The non-block compute is the family's non-block FLOPs (``step_terms``) at the matmul rate; the rest of
the step's compute, attention included, is the blocks'. The cache's own elementwise work (the metric's
sums, adding the stored residual) is left out. MagCache and TaylorSeer plan their steps on the host
(their rules read no data), so they have no decision to all-reduce.

Under PipeFusion only those two run (``jaxdit.pipelines.pipefusion.cache``; on the families whose runner
takes them) and a skipped step takes no tick: the pipelined loop runs the full steps only, so the run is
PipeFusion's own formula (``latency.pipefusion_generation``) over fewer full steps, plus per skipped step
its non-block compute and CFG's exchange. Its warm-up steps (one per expert) always run every block, so
at most the other steps are skipped. The caches that decide from the data get no PipeFusion time.
"""

from __future__ import annotations

from typing import Any

from jaxdit.cache import parse_cache
from jaxdit.pipelines.pipefusion.cache import PIPEFUSION_CACHES as HOST_PLANNED
from jaxdit.plan.cost import shapes
from jaxdit.plan.latency import Hardware, pipefusion_generation, pipefusion_warmup_steps
from jaxdit.plan.search import Plan, PlanReport

__all__ = ["cached_generation", "check_skip", "format_cache", "cache_json"]

#: Collectives that belong to the blocks (and are skipped with them).
BLOCK_STRATEGIES = ("ulysses", "ring", "tensor")


def check_skip(text: str, report: PlanReport) -> tuple[str, float]:
    """``--cache NAME:FRACTION`` -> (name, fraction), checked against the model's blocks."""
    name, skip = parse_cache(text)
    blocks = sum(report.workload.stack_depths)
    most = 1.0 - (1.0 / blocks if name == "fbcache" else 0.0)
    if not 0.0 <= skip <= most or skip == 1.0:
        raise ValueError(
            f"--cache {text}: the skipped fraction of block evaluations must be in [0, {most:.3g}]"
            + (f" (First-Block-Cache always runs 1 of the {blocks} blocks)" if name == "fbcache" else "")
        )
    return name, skip


def cached_generation(plan: Plan, skip: float, hw: Hardware, name: str = "fbcache") -> float | None:
    """Seconds per generation of ``plan`` on ``hw`` when cache ``name`` skips ``skip`` of the block
    evaluations (module docstring); None for PipeFusion with a cache it does not run."""
    c, t = plan.cost, plan.timing
    w = c.workload
    terms = w.family.step_terms(w, c.config, shapes(w, c.config))
    nonblock = terms.nonblock_flops / hw.flops
    if c.config.pipefusion > 1:
        if name not in HOST_PLANNED or name not in w.family.pipefusion_caches:
            return None
        cfg_exchange = t.by_strategy.get("cfg", (0.0, 0.0, False))[1]
        skipped = pipefusion_skipped_steps(plan, skip)
        return pipefusion_generation(
            c, t.compute, t.comm_total, t.comm_exposed, skipped, nonblock + cfg_exchange
        )
    # Attention runs at its kernel's rate, inside the blocks; the rest of the non-block work is matmuls.
    block_compute = t.compute - nonblock
    block_comm = sum(t.by_strategy.get(s, (0.0, 0.0, False))[1] for s in BLOCK_STRATEGIES)
    decision = hw.latency if c.config.num_devices > 1 and name not in HOST_PLANNED else 0.0
    return w.steps * (t.step - skip * (block_compute + block_comm) + decision)


def pipefusion_skipped_steps(plan: Plan, skip: float) -> int:
    """The steps a host-planned cache skipping ``skip`` of the block evaluations leaves out under
    PipeFusion (a skipped step runs no block), at most those after the warm-up steps."""
    steps = plan.cost.workload.steps
    return min(round(skip * steps), steps - pipefusion_warmup_steps(plan.cost))


def _rows(report: PlanReport, name: str, skip: float) -> list[tuple[Plan, float | None]]:
    return [(p, cached_generation(p, skip, report.hardware, name)) for p in report.plans]


def format_cache(report: PlanReport, name: str, skip: float, limit: int = 8) -> str:
    """The fastest configurations with the cache, their time without it beside."""
    rows = _rows(report, name, skip)
    cached = sorted((r for r in rows if r[1] is not None), key=lambda r: r[1])[:limit]
    out = [f"with {name} skipping {skip:.0%} of block evaluations (approximate: see the note):"]
    width = max((len(p.name) for p, _ in cached), default=0)
    for p, seconds in cached:
        before = p.timing.generation
        out.append(
            f"  {p.name:<{width}}  {before:.3g} s -> {seconds:.3g} s per generation ({before / seconds:.2f}x)"
        )
    pipefusion = sum(1 for _, seconds in rows if seconds is None)
    if pipefusion:
        why = (
            "it decides from the data"
            if name not in HOST_PLANNED
            else f"{report.workload.family.display}'s runner"
        )
        out.append(f"  ({pipefusion} PipeFusion configurations take no {name}: {why})")
    decision = (
        "it plans its steps on the host (no decision on the devices)"
        if name in HOST_PLANNED
        else "the decision adds one all-reduce of two scalars per step"
    )
    out.append(
        "note: the skipped fraction is your estimate (jaxdit generate prints the measured one); blocks' "
        "compute and their Ulysses/Ring/tensor collectives shrink by it, embedders, head and CFG's "
        f"exchange do not, and {decision}."
    )
    if name in HOST_PLANNED and pipefusion < sum(1 for p, _ in rows if p.config.pipefusion > 1):
        out.append(
            "PipeFusion: a skipped step takes no tick of the pipeline; its warm-up steps run every block, "
            "so it skips at most the other steps."
        )
    return "\n".join(out)


def cache_json(report: PlanReport, name: str, skip: float) -> dict[str, Any]:
    return {
        "cache": name,
        "skipped_fraction": skip,
        "approximate": True,
        "generation_seconds": {p.name: seconds for p, seconds in _rows(report, name, skip)},
    }
