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


def _run_script(args, out, **env_extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env_extra)
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user's run
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--no-torch", "--out", str(out), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)


def _check_attention_rows(rows):
    for r in rows:
        assert r["tflops"] > 0 and r["shape"]["tokens"] >= r["shape"]["valid_tokens"]
        assert r["interpret"] == (r["backend"] != "xla")  # the Pallas kernels in Pallas' interpreter
        if r["backend"] == "xla":
            assert r["err_out_vs_xla"] == 0 and r["err_lse_vs_xla"] == 0
        # bf16 inputs: the probabilities and the output rounded to bf16 (KERNEL_BF16); the fp32 LSE agrees
        # far closer (KERNEL). Against the xla backend (itself bf16) the same bounds hold.
        assert r["err_out_vs_fp32"] > 0
        for ref in ("fp32", "xla"):
            what = f"gpu_check {r['case']} {r['backend']} vs {ref}"
            tol.check_error(r[f"err_out_vs_{ref}"], tol.KERNEL_BF16, r["out_scale"], f"{what}: out")
            tol.check_error(r[f"err_lse_vs_{ref}"], tol.KERNEL, r["lse_scale"], f"{what}: lse")


def test_tiny_run_end_to_end_and_calibrates_the_plan(tmp_path, capsys):
    # In one process (what --tiny does), with one row made to fail: it is recorded, the run goes on.
    out = tmp_path / "check.json"
    proc = _run_script([], out, GPU_CHECK_FAIL="wan-tiny, ulysses2|splash")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "attention case" in proc.stdout and "jaxdit xla" in proc.stdout
    assert "error: RuntimeError: injected failure" in proc.stdout
    data = json.loads(out.read_text())
    gc = _script()
    backends = data["meta"]["backends"]
    assert data["complete"] and data["meta"]["tiny"] and data["targets"] == ["not judged at tiny sizes"]
    assert backends == ["xla", "triton", "splash"]  # on a CPU, the Pallas kernels interpreted
    assert [(r["case"], r["backend"]) for r in data["attention"]] == [
        (c.name, b) for c in gc.TINY_CASES for b in backends
    ]
    (failed,) = data["errors"]
    assert failed["key"] == "attention|wan-tiny, ulysses2|splash" and "injected" in failed["error"]
    _check_attention_rows([r for r in data["attention"] if "error" not in r])
    assert [(r["model"], r["backend"]) for r in data["steps"]] == [(m, "xla") for m in gc.MODELS]
    for r in data["steps"]:
        assert r["seconds"] > 0 and r["flops"] > r["attention_flops"] > 0 and r["mfu"] is None

    argv = ["plan", "--model", "flux-dev", "--devices", "2", "--attention_backend", "xla"]
    assert main([*argv, "--calibration", str(out)]) == 0
    assert "measured by gpu_check on cpu (check.json)" in capsys.readouterr().out


def test_worker_processes_survive_a_crashing_row(tmp_path):
    # As a GPU run: the attention part in a worker process. One row ends the process (as a crash inside
    # XLA would), another raises: both are recorded, the worker is restarted after the crash, every other
    # row is measured, and the JSON on disk is complete.
    out = tmp_path / "check.json"
    crash, fail = "attention|flux-tiny, ulysses3|triton", "attention|wan-tiny, ulysses4|splash"
    proc = _run_script(["--workers", "--models", "none"], out, GPU_CHECK_CRASH=crash, GPU_CHECK_FAIL=fail)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restarting it after " + crash in proc.stderr
    data = json.loads(out.read_text())
    assert data["complete"] and data["steps"] == []
    errors = {r["key"]: r["error"] for r in data["errors"]}
    assert errors == {
        crash: "worker exited with code 70 while running this row",
        fail: "RuntimeError: injected failure (GPU_CHECK_FAIL)",
    }
    rows = [r for r in data["attention"] if "error" not in r]
    assert len(rows) == 3 * 3 - 2
    _check_attention_rows(rows)


FAKE_WORKER = """
import json, os, sys, time
skip = sys.argv[1:]
rows = ["attention|a|xla", "attention|b|xla", "attention|c|xla", "attention|d|xla"]
print("RESULT " + json.dumps({"part": "device", "device": "fake", "platform": "cpu", "backends": ["xla"]}))
for key in rows:
    if key in skip:
        continue
    print("BEGIN " + key, flush=True)
    if key.endswith("|b|xla"):
        time.sleep(60)  # hangs
    if key.endswith("|c|xla"):
        os._exit(9)  # dies
    print("RESULT " + json.dumps({"part": "attention", "case": key.split("|")[1], "backend": "xla",
                                  "key": key, "tflops": 1.0}), flush=True)
"""


def test_run_part_stops_a_hung_row_restarts_after_a_dead_one_and_writes_as_it_goes(tmp_path):
    gc = _script()
    worker = tmp_path / "worker.py"
    worker.write_text(FAKE_WORKER)
    out = tmp_path / "partial.json"
    results = gc.Results(str(out), tiny=True)
    launches = []

    def command(skip):
        launches.append(list(skip))
        return [sys.executable, str(worker), *skip]

    gc.run_part(command, "attention", deadline=gc.time.monotonic() + 60, results=results, row_limit=3.0)
    data = json.loads(out.read_text())
    assert not data["complete"]  # written as it went; the caller marks it complete at the end
    by_key = {r["key"]: r for r in data["attention"]}
    assert list(by_key) == ["attention|a|xla", "attention|b|xla", "attention|c|xla", "attention|d|xla"]
    assert by_key["attention|b|xla"]["error"] == "stopped at its 3 s row limit while running this row"
    assert by_key["attention|c|xla"]["error"] == "worker exited with code 9 while running this row"
    assert "error" not in by_key["attention|a|xla"] and "error" not in by_key["attention|d|xla"]
    assert launches == [[], ["attention|a|xla", "attention|b|xla"], sorted(by_key)[:3]]
    assert len(results.part("device")) == 1

    # Out of budget: what was done stays, the rest is said to be missing.
    results = gc.Results(str(out), tiny=True)
    gc.run_part(command, "attention", deadline=gc.time.monotonic() + 2, results=results, row_limit=30.0)
    data = json.loads(out.read_text())
    assert [r["key"] for r in data["attention"]] == ["attention|a|xla", "attention|b|xla"]
    assert "stopped at the time budget" in data["attention"][1]["error"]
    assert any("out of its share of the budget" in n for n in data["meta"]["notes"])
