"""Text tables for ``jaxdit plan``: the ranked configurations, and the --verify comparison."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxdit.plan.latency import AttentionKernel
from jaxdit.plan.search import Plan, PlanReport
from jaxdit.plan.verify import Comparison, PipeFusionComparison

MIB, GB = 2**20, 1e9


def _bytes(b: float) -> str:
    if b == 0:
        return "0"
    if b >= 2**30:
        return f"{b / 2**30:.2f} GiB"
    if b >= MIB:
        return f"{b / MIB:.1f} MiB"
    return f"{b / 1024:.1f} KiB"


def _seconds(s: float) -> str:
    if s >= 100:
        return f"{s:.0f} s"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(r):
        cells = [
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return [line(header), line(["-" * w for w in widths]), *map(line, rows)]


def _overlap(p: Plan) -> str:
    parts = [f"{s}{'~' if ov else ''}" for s, (_, _, ov) in p.timing.by_strategy.items()]
    return ",".join(parts) or "-"


def format_plan(report: PlanReport) -> str:
    """The ranked table (recommended first), the baseline, and the invalid configurations."""
    w, hw, single = report.workload, report.hardware, report.single
    base = single.timing.generation
    kernel = single.timing.kernel
    out = [
        f"jaxdit plan: {w.describe()}",
        f"hardware: {report.devices} devices; {hw.describe()}",
        f"{kernel.describe()}",
        f"one device: {single.cost.flops / 1e12:.1f} TFLOP and {_seconds(single.timing.step)} per step "
        f"(attention {single.cost.attention_flops / single.cost.flops:.0%} of the FLOPs, "
        f"{single.timing.attention / single.timing.compute:.0%} of the compute time), "
        f"{_seconds(base)} per generation, {single.cost.memory_bytes / GB:.1f} GB",
    ]
    rec = report.recommended
    if rec is not None:
        out.append(
            f"recommended: {rec.name} ({_seconds(rec.timing.generation)} per generation, "
            f"{base / rec.timing.generation:.2f}x one device)"
        )
    else:
        out.append("recommended: none (no exact, implemented configuration fits)")
    fastest = min(report.plans, key=lambda p: p.timing.generation, default=None)
    if fastest is not None and fastest is not rec:
        notes = "".join(f"; {n}" for n in fastest.notes)
        out.append(f"fastest modelled: {fastest.name} ({_seconds(fastest.timing.generation)}{notes})")
    out.append("")
    header = [
        "#",
        "configuration",
        "sent/dev/step",
        "comm total",
        "exposed",
        "comm (~ overlapped)",
        "params",
        "activ.",
        "TFLOP/dev",
        "kernel",
        "attention",
        "step",
        "generation",
        "speedup",
        "notes",
    ]
    rows = []
    for i, p in enumerate(report.plans, 1):
        c, t = p.cost, p.timing
        rows.append(
            [
                f"{i}{'*' if p is rec else ''}",
                p.name,
                _bytes(c.bytes_sent()),
                _seconds(t.comm_total) if t.comm_total else "0",
                _seconds(t.comm_exposed) if t.comm_exposed else "0",
                _overlap(p),
                f"{c.resident_param_bytes / GB:.1f} GB",
                f"{(c.activation_bytes + c.kv_cache_bytes) / GB:.2f} GB",
                f"{c.flops / 1e12:.2f}",
                t.kernel.backend,
                _seconds(t.attention),
                _seconds(t.step),
                _seconds(t.generation),
                f"{base / t.generation:.2f}x",
                "; ".join(p.notes),
            ]
        )
    out += _table(header, rows, right={0, 2, 3, 4, 6, 7, 8, 10, 11, 12, 13})
    modelled_only = [p for p in report.plans if not p.runnable]
    if modelled_only:
        out.append(
            f"{len(modelled_only)} configuration(s) marked 'modelled only' are ranked after every one "
            f"{w.name} can run here, however fast they are modelled to be"
        )
    if report.invalid:
        out += ["", f"invalid ({len(report.invalid)}):"]
        by_reason: dict[str, list[str]] = {}
        for p in report.invalid:
            for reason in p.reasons:
                by_reason.setdefault(reason, []).append(p.name)
        for reason, names in by_reason.items():
            out.append(f"  {reason}:")
            out.append(f"    {', '.join(names)}")
    out += [
        "",
        "sent/dev/step: bytes one device sends per denoising step (bf16 as served; tensor all-reduces in "
        "fp32). exposed: communication not hidden behind compute. activ.: live activations of one block "
        "(+ PipeFusion's stale K/V). kernel / attention: the attention kernel and its share of the step's "
        "compute. Transformer only: text encoders and VAE are not modelled.",
    ]
    return "\n".join(out)


def _kernel_json(kernel: AttentionKernel) -> dict[str, Any]:
    return {
        "backend": kernel.backend,
        "tflops": kernel.tflops,
        "source": kernel.source,
        "why": kernel.why,
        "implemented": kernel.implemented,
    }


def add_attention_json(data: dict[str, Any], report: PlanReport) -> None:
    """Add to :meth:`PlanReport.to_json`'s output the attention kernel and its time, per configuration."""
    data["attention"] = _kernel_json(report.single.timing.kernel)
    entries = [data["single_device"], *data["configurations"]]
    for entry, p in zip(entries, (report.single, *report.plans), strict=True):
        entry["attention_kernel"] = p.timing.kernel.backend
        entry["attention_flops_per_device_per_step"] = p.cost.attention_flops
        entry["attention_seconds_per_step"] = p.timing.attention


def format_verify(workload_line: str, comparisons: Sequence[Comparison]) -> str:
    """Measured beside modelled, per configuration."""
    header = [
        "configuration",
        "sent/dev (CPU HLO)",
        "model (CPU)",
        "ratio",
        "model (GPU)",
        "TFLOP/dev",
        "model",
        "ratio",
        "sum/one dev",
        "model",
        "params/dev",
        "model",
        "activ. (CPU)",
        "model",
        "compile",
    ]
    rows = []
    for cmp in comparisons:
        m, model = cmp.measured, cmp.model
        rows.append(
            [
                model.config.describe(),
                _bytes(m.bytes_sent),
                _bytes(model.bytes_sent(cpu=True)),
                f"{cmp.bytes_ratio:.4f}",
                _bytes(model.bytes_sent()),
                f"{m.flops / 1e12:.3f}",
                f"{model.flops / 1e12:.3f}",
                f"{cmp.flops_ratio:.4f}",
                f"{cmp.summed_flops_ratio:.4f}",
                f"{1 + model.duplicated_flops:.4f}",
                f"{m.param_bytes / GB:.2f} GB",
                f"{model.param_bytes / GB:.2f} GB",
                f"{m.activation_bytes / GB:.2f} GB",
                f"{model.activation_bytes / GB:.2f} GB",
                f"{m.compile_seconds:.0f} s",
            ]
        )
    out = [f"verify: {workload_line}", ""]
    out += _table(header, rows, right=set(range(1, 15)))
    unexpected = [(c.model.config.describe(), c.unexpected_kinds) for c in comparisons if c.unexpected_kinds]
    out.append("")
    if unexpected:
        out += [f"UNEXPECTED collectives in {name}: {', '.join(kinds)}" for name, kinds in unexpected]
    else:
        out.append("no collective outside the model in any compiled step")
    out.append(
        "sent/dev: collective bytes leaving one device per step, loop trip counts included, as the CPU "
        "program sends them (bf16 widened to f32; fp32 all-reduces and predictions unchanged); model (GPU) "
        "is what a GPU moves. sum/one dev: per-device FLOPs summed over devices / the one-device step's. "
        "activ. (CPU): temp minus the CPU's fp32 copies of bf16 weights (an estimate)."
    )
    return "\n".join(out)


def format_verify_pipefusion(comparisons: Sequence[PipeFusionComparison]) -> str:
    """PipeFusion (FLUX or Wan): each compiled program's collective bytes per device beside the model's."""
    header = [
        "configuration",
        "M",
        "warm-up step (CPU HLO)",
        "model",
        "ratio",
        "ticks",
        "pipelined phase (CPU HLO)",
        "model",
        "ratio",
        "steady step (model)",
        "compile",
    ]
    rows = []
    for c in comparisons:
        m = c.modelled
        rows.append(
            [
                c.model.config.describe(),
                str(m["patches"]),
                _bytes(c.warmup_measured),
                _bytes(m["warmup"]),
                f"{c.warmup_ratio:.4f}",
                str(m["ticks"]),
                _bytes(c.pipelined_measured),
                _bytes(m["pipelined"]),
                f"{c.pipelined_ratio:.4f}",
                _bytes(m["steady_step"]),
                f"{c.compile_seconds:.0f} s",
            ]
        )
    out = ["PipeFusion (the runner's two programs compiled)", ""]
    out += _table(header, rows, right=set(range(1, 11)))
    out.append("")
    unexpected = [(c.model.config.describe(), c.unexpected_kinds) for c in comparisons if c.unexpected_kinds]
    out += [f"UNEXPECTED collectives in {name}: {', '.join(kinds)}" for name, kinds in unexpected]
    steps = comparisons[0].warmup_steps
    out.append(
        f"warm-up step: one of the {steps} synchronous step(s) (full sequence through all P stages: sequence "
        "collectives P times, 2(P-1) activation hops, CFG once). pipelined phase: the remaining steps as one "
        "scan of `ticks` ticks, fill and drain bubbles included, against the model's per-tick bytes x the same "
        "ticks (steady step = M ticks, what the plan ranks by). Bytes per device, CPU dtypes."
    )
    return "\n".join(out)
