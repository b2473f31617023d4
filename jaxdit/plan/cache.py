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
sums, adding the stored residual) is left out. PipeFusion takes only the host-planned caches (MagCache,
TaylorSeer: ``jaxdit.pipelines.pipefusion.cache``), whose skipped steps also leave the pipeline's ticks
out; that is not priced here yet, so PipeFusion configurations get no cached time.
"""

from __future__ import annotations

from typing import Any

from jaxdit.cache import parse_cache
from jaxdit.plan.cost import shapes
from jaxdit.plan.latency import Hardware
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


def cached_generation(plan: Plan, skip: float, hw: Hardware) -> float | None:
    """Seconds per generation of ``plan`` on ``hw`` when ``skip`` of the block evaluations are skipped
    (module docstring); None for PipeFusion."""
    c, t = plan.cost, plan.timing
    if c.config.pipefusion > 1:
        return None
    w = c.workload
    terms = w.family.step_terms(w, c.config, shapes(w, c.config))
    # Attention runs at its kernel's rate, inside the blocks; the rest of the non-block work is matmuls.
    block_compute = t.compute - terms.nonblock_flops / hw.flops
    block_comm = sum(t.by_strategy.get(s, (0.0, 0.0, False))[1] for s in BLOCK_STRATEGIES)
    decision = hw.latency if c.config.num_devices > 1 else 0.0
    return w.steps * (t.step - skip * (block_compute + block_comm) + decision)


def _rows(report: PlanReport, skip: float) -> list[tuple[Plan, float | None]]:
    return [(p, cached_generation(p, skip, report.hardware)) for p in report.plans]


def format_cache(report: PlanReport, name: str, skip: float, limit: int = 8) -> str:
    """The fastest configurations with the cache, their time without it beside."""
    rows = _rows(report, skip)
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
        out.append(f"  ({pipefusion} PipeFusion configurations take no cache)")
    out.append(
        "note: the skipped fraction is your estimate (jaxdit generate prints the measured one); blocks' "
        "compute and their Ulysses/Ring/tensor collectives shrink by it, embedders, head and CFG's "
        "exchange do not, and the decision adds one all-reduce of two scalars per step."
    )
    return "\n".join(out)


def cache_json(report: PlanReport, name: str, skip: float) -> dict[str, Any]:
    return {
        "cache": name,
        "skipped_fraction": skip,
        "approximate": True,
        "generation_seconds": {p.name: seconds for p, seconds in _rows(report, skip)},
    }
