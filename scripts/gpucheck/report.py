"""gpu_check's table and its verdicts on the targets."""

from __future__ import annotations

TARGET_CUDNN_TFLOPS = 500.0
TARGET_FLUX_MFU = 0.50


def _fmt(value, spec: str, width: int) -> str:
    return f"{value:>{width}{spec}}" if isinstance(value, int | float) else f"{'n/a':>{width}}"


def format_report(data: dict) -> str:
    meta = data["meta"]
    lines = [
        f"gpu_check {meta['date']}: {meta['device']} ({meta['platform']}); jax {meta['jax']}, "
        f"jaxlib {meta['jaxlib']}; backends: {', '.join(meta['backends'])}"
        + (" [tiny]" if meta["tiny"] else "")
        + ("" if data.get("complete", True) else " [INCOMPLETE]")
    ]
    head = f"{'attention case':<40} {'backend':<8} {'tokens':>7} {'TFLOP/s':>8} {'out-xla':>9} {'lse-xla':>9} {'out-fp32':>9} {'lse-fp32':>9}"
    lines += ["", head, "-" * len(head)]
    for r in data["attention"]:
        name = r["backend"] + ("*" if r.get("interpret") else "")
        if "error" in r:
            lines.append(f"{r['case']:<40} {name:<8} error: {r['error'][:200]}")
            continue
        errors = (r["err_out_vs_xla"], r["err_lse_vs_xla"], r["err_out_vs_fp32"], r["err_lse_vs_fp32"])
        lines.append(
            f"{r['case']:<40} {name:<8} {r['shape']['tokens']:>7} {r['tflops']:>8.3g} "
            + " ".join(_fmt(e, ".2e", 9) for e in errors)
        )
    head = f"{'step':<18} {'runs':<24} {'compile':>9} {'median step':>12} {'TFLOP/s':>8} {'MFU':>7}"
    lines += ["", head, "-" * len(head)]
    for r in data["steps"]:
        if "error" in r:
            lines.append(f"{r['model']:<18} {'jaxdit ' + r['backend']:<24} error: {r['error'][:200]}")
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "n/a"
        lines.append(
            f"{r['model']:<18} {'jaxdit ' + r['backend']:<24} {r['compile_seconds']:>8.1f}s "
            f"{r['seconds'] * 1e3:>10.1f}ms {r['tflops']:>8.3g} {mfu:>7}"
        )
    for r in data["diffusers"]:
        step = next((s for s in data["steps"] if s["model"] == r["model"] and "flops" in s), None)
        rate = step["flops"] / r["median_seconds"] / 1e12 if step else float("nan")
        lines.append(
            f"{r['model']:<18} {'diffusers ' + r['mode']:<24} {r['first_call_seconds']:>8.1f}s "
            f"{r['median_seconds'] * 1e3:>10.1f}ms {rate:>8.3g} {'':>7}"
        )
    lines += ["", *(f"target: {t}" for t in data["targets"]), *(f"note: {n}" for n in meta["notes"])]
    lines.append(
        "out/lse-xla: max |error| against the xla backend on the same bf16 inputs; -fp32: against the XLA "
        "kernel on those inputs in fp32 (real query rows only); *: in Pallas' interpreter. TFLOP/s: 4 B H "
        "T^2 D over the padded length (attention), the cost model's FLOPs (steps; diffusers: the same FLOPs "
        "over its time). compile: jaxdit's lower + compile, diffusers' first call."
    )
    return "\n".join(lines)


def _targets(attention: list[dict], steps: list[dict], tiny: bool) -> list[str]:
    if tiny:
        return ["not judged at tiny sizes"]
    out = []
    flux_att = [
        r for r in attention if r["backend"] == "cudnn" and r["case"].startswith("flux") and r.get("tflops")
    ]
    out.append(
        f"cuDNN attention >= {TARGET_CUDNN_TFLOPS:.0f} TFLOP/s at FLUX's shape: "
        + (f"{flux_att[0]['tflops']:.0f}" if flux_att else "cudnn did not run")
    )
    flux_steps = [r for r in steps if r["model"] == "flux-dev" and r.get("mfu")]
    best = max(flux_steps, key=lambda r: r["mfu"], default=None)
    out.append(
        f"FLUX-dev step MFU >= {TARGET_FLUX_MFU:.0%}: "
        + (f"{best['mfu']:.1%} ({best['backend']})" if best else "no FLUX step with a known peak")
    )
    return out
