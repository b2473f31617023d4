"""scripts/gpu_check.py: its attention cases are the layouts the library pads, it runs end to end on a CPU
with --tiny, and its JSON feeds ``jaxdit plan --calibration``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import tolerance as tol

from jaxdit.cli import main
from jaxdit.parallel.layout import SequenceLayout

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _script():
    if "gpu_check" not in sys.modules:  # registered first: its dataclasses resolve their module by name
        spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
        sys.modules["gpu_check"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["gpu_check"]


def test_cases_are_the_shapes_a_device_sees_after_ulysses():
    gc = _script()
    for case in (*gc.CASES, *gc.TINY_CASES):
        layout = SequenceLayout(case.lengths, case.degree)
        expected = np.concatenate([np.asarray(layout.key_valid(s)) for s in range(case.degree)])
        np.testing.assert_array_equal(case.key_valid(), expected)
    flux, wan13, wan14 = gc.CASES
    valid = flux.key_valid()
    assert (len(valid), int(valid.sum()), flux.heads) == (4614, 4608, 24 // 6)
    assert not valid[: np.flatnonzero(valid)[-1]].all()  # padding keys inside the sequence, not at its end
    assert (len(wan13.key_valid()), wan13.heads) == (32_760, 12 // 4)
    assert (len(wan14.key_valid()), wan14.heads) == (75_600, 40 // 8)
    assert flux.flops() == 4 * 4 * 4614**2 * 128
    assert gc.available_backends("cpu")[0] == "xla"


def test_report_puts_diffusers_beside_jaxdit():
    gc = _script()
    step = {"model": "flux-dev", "backend": "xla", "compile_seconds": 30.0, "seconds": 0.3, "flops": 74.4e12}
    step.update(tflops=248.0, mfu=0.25)
    torch_row = {"model": "flux-dev", "mode": "eager", "first_call_seconds": 5.0, "median_seconds": 0.2}
    meta = dict(date="d", device="H200", platform="gpu", jax="j", jaxlib="l", backends=["xla"], tiny=False)
    data = dict(meta=dict(meta, notes=[]), attention=[], steps=[step], diffusers=[torch_row], targets=["t"])
    lines = gc.format_report(data).splitlines()
    assert any(line.split()[:3] == ["flux-dev", "jaxdit", "xla"] and "25.0%" in line for line in lines)
    row = next(line for line in lines if "diffusers eager" in line)
    assert "200.0ms" in row and " 372 " in row  # the same FLOPs over diffusers' time


def test_tiny_run_end_to_end_and_calibrates_the_plan(tmp_path, capsys):
    out = tmp_path / "check.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user's run
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--no-torch", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "attention case" in proc.stdout and "jaxdit xla" in proc.stdout
    data = json.loads(out.read_text())
    gc = _script()
    backends = data["meta"]["backends"]
    assert data["meta"]["tiny"] and backends[0] == "xla" and data["targets"] == ["not judged at tiny sizes"]
    assert [(r["case"], r["backend"]) for r in data["attention"]] == [
        (c.name, b) for c in gc.TINY_CASES for b in backends
    ]
    for r in data["attention"]:
        assert r["tflops"] > 0 and r["shape"]["tokens"] >= r["shape"]["valid_tokens"]
        if r["backend"] == "xla":
            assert r["err_out_vs_xla"] == 0 and r["err_lse_vs_xla"] == 0
        # bf16 inputs: the probabilities and the output rounded to bf16 (KERNEL_BF16); the fp32 LSE agrees
        # far closer (KERNEL).
        what = f"gpu_check {r['case']} {r['backend']} vs the fp32 reference"
        assert r["err_out_vs_fp32"] > 0
        tol.check_error(r["err_out_vs_fp32"], tol.KERNEL_BF16, r["out_scale"], f"{what}: out")
        tol.check_error(r["err_lse_vs_fp32"], tol.KERNEL, r["lse_scale"], f"{what}: lse")
    assert [(r["model"], r["backend"]) for r in data["steps"]] == [
        (m, b) for m in ("flux-dev", "wan2.1-t2v-1.3b") for b in backends
    ]
    for r in data["steps"]:
        assert r["seconds"] > 0 and r["flops"] > r["attention_flops"] > 0 and r["mfu"] is None

    argv = ["plan", "--model", "flux-dev", "--devices", "2", "--attention_backend", "xla"]
    assert main([*argv, "--calibration", str(out)]) == 0
    assert "measured by gpu_check on cpu (check.json)" in capsys.readouterr().out
