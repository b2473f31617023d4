"""The GPU session's measurements in one process: ceilings, attention kernels, the FLUX step, then the
table. ``python -m gpubench OUT_DIR VERSIONS_JSON BUDGET_SECONDS`` with scripts/ on sys.path.

GPU_SESSION_DRY_RUN=1: tiny shapes on whatever platform jax has (CPU included), the same files and table.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import jax

from gpubench import attention, ceilings, report, step

#: The kernels' share of the session: a case not started by then is recorded as skipped.
ATTENTION_SECONDS = 150.0


def _targets(rows: list[dict]) -> list[str]:
    hits = [r for r in rows if r.get("target_tflops")]
    if not hits:
        return ["cuDNN >= 500 TFLOP/s at the chip-filling shape: not measured (no correct timed cudnn row)"]
    r = hits[0]
    verdict = "met" if r["meets_target"] else "NOT met"
    return [f"cuDNN >= {r['target_tflops']:.0f} TFLOP/s at '{r['case']}': {verdict} ({r['tflops']:.1f})"]


def main(argv: list[str]) -> int:
    out_dir, versions, budget = Path(argv[0]), json.loads(Path(argv[1]).read_text()), float(argv[2])
    deadline = time.monotonic() + budget
    dry = os.environ.get("GPU_SESSION_DRY_RUN") == "1"
    device = jax.devices()[0]
    platform = "cuda" if device.platform == "gpu" else device.platform
    data = {
        "meta": {"device": device.device_kind, "platform": platform, "dry_run": dry, "versions": versions},
        "ceilings": None,
        "rows": [],
        "targets": [],
    }

    def emit(row: dict) -> None:
        data["rows"].append(row)
        report.write(out_dir, data)
        print(json.dumps(row, default=str), flush=True)

    data["ceilings"] = ceilings.measure(dry)
    report.write(out_dir, data)
    ceiling = data["ceilings"]["matmul_tflops"]
    kernels_end = min(time.monotonic() + ATTENTION_SECONDS, deadline - (10 if dry else 200))
    for case in attention.DRY_CASES if dry else attention.CASES:
        if time.monotonic() > kernels_end:
            emit({"part": "attention", "case": case.name, "backend": "-", "status": "skipped (time)"})
            continue
        attention.run_case(case, platform, ceiling, dry, emit)
    s = None
    for backend in step.ORDER:
        row = {"part": "step", "model": step.MODEL, "backend": backend}
        if (
            backend != "xla"
            and attention.kernels.backend_for(platform, "bfloat16", (1, 1, 1, 128), requested=backend).backend
            != backend
        ):
            emit({**row, "status": "unavailable"})
            continue
        if time.monotonic() > deadline - (5 if dry else 90):
            emit({**row, "status": "skipped (time)"})
            continue
        try:
            s = s or step.setup(dry, device)
            emit({**row, **step.run(s, backend, dry, device, ceiling)})
        except Exception as e:  # noqa: BLE001 - one backend's failure leaves the others to run
            emit({**row, "status": "failed", "error": f"{type(e).__name__}: {str(e)[:400]}"})
    ok = [r for r in data["rows"] if r["part"] == "step" and r["status"] == "ok"]
    row = {"part": "step", "model": step.MODEL, "backend": f"{ok[0]['backend']}+fp8" if ok else "fp8"}
    if not ok:
        emit({**row, "status": "skipped (no bf16 step to compare)"})
    elif time.monotonic() > deadline - (5 if dry else 90):
        emit({**row, "status": "skipped (time)"})
    else:
        try:
            emit({**row, **step.run_fp8(s, ok[0]["backend"], dry, device, ceiling, ok[0]["seconds"])})
        except Exception as e:  # noqa: BLE001 - the table still prints
            emit({**row, "status": "failed", "error": f"{type(e).__name__}: {str(e)[:400]}"})
    data["targets"] = _targets(data["rows"])
    report.write(out_dir, data)
    text = report.table(data)
    (out_dir / "table.txt").write_text(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
