"""The session's one JSON (rewritten after every row, so a run cut short keeps what it measured) and its
table (printed last)."""

from __future__ import annotations

import json
from pathlib import Path


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(data: dict) -> str:
    c = data.get("ceilings") or {}
    lines = [
        f"device: {data['meta'].get('device')}  dry_run: {data['meta'].get('dry_run')}",
        f"ceilings: bf16 matmul {_f(c.get('matmul_tflops'), '.1f')} TFLOP/s, copy {_f(c.get('copy_gbps'), '.0f')} GB/s",
        f"{'attention case':44} {'backend':7} {'status':11} {'TFLOP/s':>8} {'%ceil':>6} {'lse_err':>8} {'rel_l2':>8}",
    ]
    for r in data["rows"]:
        if r["part"] != "attention":
            continue
        lines.append(
            f"{r['case'][:44]:44} {r['backend']:7} {r['status']:11} {_f(r.get('tflops'), '8.1f'):>8} "
            f"{_f(r.get('pct_of_matmul_ceiling'), '6.1f'):>6} {_f(r.get('lse_err'), '8.1e'):>8} "
            f"{_f(r.get('rel_l2'), '8.1e'):>8}"
        )
    lines.append(
        f"{'step':44} {'backend':10} {'status':11} {'compile':>8} {'median':>8} {'MFU':>6} {'MFU/ceil':>8} "
        f"{'params':>7} {'vs bf16':>7}"
    )
    for r in data["rows"]:
        if r["part"] != "step":
            continue
        lines.append(
            f"{r['model']:44} {r['backend']:10} {r['status']:11} {_f(r.get('compile_seconds'), '7.1f'):>7}s "
            f"{_f(r.get('seconds'), '7.3f'):>7}s {_f(r.get('mfu_vs_peak'), '6.1%'):>6} "
            f"{_f(r.get('mfu_vs_ceiling'), '8.1%'):>8} {_f(r.get('param_gb'), '6.1f'):>6}G "
            f"{_f(r.get('speedup_vs_bf16'), '6.2f'):>6}x"
        )
    lines += [f"target: {t}" for t in data.get("targets", [])]
    return "\n".join(lines)


def write(out_dir: Path, data: dict) -> None:
    (out_dir / "session.json").write_text(json.dumps(data, indent=1, default=str))
