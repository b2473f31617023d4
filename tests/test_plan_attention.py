"""jaxdit plan prices attention at the kernel's throughput (not the matmul rate), says which kernel each
configuration runs, and takes measured rates: --attention_tflops, or --calibration from a gpu_check run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxdit.cli import main
from jaxdit.mesh import ParallelConfig as P
from jaxdit.plan.cost import step_cost
from jaxdit.plan.latency import ATTENTION_TFLOPS, DEFAULT_TFLOPS, Hardware, read_calibration, timing
from jaxdit.plan.workload import Workload


def test_kernel_choice_follows_dtype_and_head_dim():
    hw = Hardware()
    auto = hw.attention_kernel("bfloat16", 128)
    assert (auto.backend, auto.tflops, auto.why) == ("cudnn", 680.0, "auto for bfloat16 on an NVIDIA GPU")
    assert hw.attention_kernel("float32", 128).backend == "xla"  # auto: cuDNN for fp16/bf16 only
    # The library's own fallbacks (cudnn -> triton -> xla), not a copy of them: head_dim 100 is no
    # multiple of 8 for cuDNN but the Triton kernel pads it; 264 is past both kernels' 256.
    not_eight = hw.attention_kernel("float16", 100)
    assert not_eight.backend == "triton" and "multiple of 8 up to 256, not 100" in not_eight.why
    assert hw.attention_kernel("float16", 264).backend == "xla"
    assert Hardware(attention_backend="triton").attention_kernel("bfloat16", 264).backend == "xla"
    asked = Hardware(attention_backend="cudnn").attention_kernel("float32", 128)
    # fp32 asked of cuDNN is fp32 XLA, not the Triton kernel's TF32 matmuls.
    assert asked.backend == "xla" and "takes float16/bfloat16, not float32" in asked.why
    assert asked.why.startswith("cudnn asked;") and asked.why.endswith(": xla instead")
    assert Hardware(attention_backend="triton").attention_kernel("bfloat16", 128).tflops == 390.0
    measured = Hardware(attention_backend="xla", attention_tflops=75.0).attention_kernel("bfloat16", 128)
    assert (measured.tflops, measured.source) == (75.0, "--attention_tflops")
    with pytest.raises(ValueError, match="splash is TPU's attention kernel"):
        Hardware(attention_backend="splash")
    assert (
        Hardware(attention_backend="splash", attention_tflops=300).attention_kernel("bfloat16", 128).tflops
        == 300
    )
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        Hardware(attention_backend="flash")
    with pytest.raises(ValueError, match="attention_tflops must be positive"):
        Hardware(attention_tflops=0.0)


def test_planning_does_not_start_jax():
    """The plan picks kernels without asking jax for its devices: ``--verify`` sets the emulated device
    count after planning, which jax fixes when its backend first starts (a fresh process, as a user's)."""
    code = (
        "from jaxdit.plan.latency import Hardware; from jaxdit.plan.search import plan; "
        "from jaxdit.plan.workload import Workload; from jax._src import xla_bridge; "
        "plan(Workload.create('flux-dev'), 8, Hardware()); "
        "plan(Workload.create('wan-14b'), 8, Hardware(attention_backend='cudnn')); "
        "print(xla_bridge.backends_are_initialized())"
    )
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False"]


def test_attention_runs_at_the_kernel_rate_and_the_rest_at_the_matmul_rate():
    w = Workload.create("flux-dev")
    cost = step_cost(w, P(ulysses=8))
    for backend, rate in ATTENTION_TFLOPS.items():
        t = timing(cost, Hardware(attention_backend=backend))
        assert t.kernel.backend == backend
        assert t.attention == pytest.approx(cost.attention_flops / (rate * 1e12))
        assert t.compute == pytest.approx(
            (cost.flops - cost.attention_flops) / (DEFAULT_TFLOPS * 1e12) + t.attention
        )
    # One rate for both: the old model (every FLOP at --tflops).
    same = timing(cost, Hardware(tflops=300, attention_tflops=300))
    assert same.compute == pytest.approx(cost.flops / 300e12)
    # FLUX-dev 1024px on one H100: 20% of the FLOPs are attention; with cuDNN the step is xDiT's measured
    # 4.30 s / 28 steps (the matmul default is derived from it), with XLA's kernel 2.4x that.
    one = step_cost(w, P())
    assert one.attention_flops / one.flops == pytest.approx(0.20, abs=0.005)
    cudnn = timing(one, Hardware(attention_backend="cudnn"))
    assert cudnn.step == pytest.approx(4.30 / 28, rel=0.01)
    assert timing(one, Hardware(attention_backend="xla")).step / cudnn.step == pytest.approx(2.42, abs=0.02)


def test_ring_hops_hide_behind_attention_at_the_kernel_rate():
    """Ring's overlap FLOPs are the local block's attention: a slower kernel hides more of each hop."""
    w = Workload.create("wan-14b")
    cost = step_cost(w, P(ring=8))
    link = dict(link="pcie", bandwidth_gbs=2.0)
    for backend in ("xla", "cudnn"):
        hw = Hardware(attention_backend=backend, **link)
        t = timing(cost, hw)
        ring = [c for c in cost.collectives if c.strategy == "ring"]
        one = [hw.latency + c.sent_bytes() / hw.bandwidth for c in ring]
        hidden = [
            min(o, c.overlap_flops / (ATTENTION_TFLOPS[backend] * 1e12))
            for o, c in zip(one, ring, strict=True)
        ]
        exposed = sum(c.count * (o - h) for c, o, h in zip(ring, one, hidden, strict=True))
        assert t.by_strategy["ring"][1] == pytest.approx(exposed)
    slow, fast = (timing(cost, Hardware(attention_backend=b, **link)) for b in ("xla", "cudnn"))
    assert slow.by_strategy["ring"][1] < fast.by_strategy["ring"][1]


def test_cli_names_the_kernel_and_takes_a_measured_rate(capsys):
    argv = ["plan", "--model", "wan-14b", "--devices", "8", "--attention_backend", "xla"]
    assert main([*argv, "--attention_tflops", "80"]) == 0
    text = capsys.readouterr().out
    assert "attention kernel xla at 80 TFLOP/s (asked; --attention_tflops)" in text
    header = next(line for line in text.splitlines() if "configuration" in line)
    assert "kernel" in header.split() and "attention" in header.split()
    assert "matmuls at 450 TFLOP/s" in text
    assert main(["plan", "--model", "flux-dev", "--devices", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["attention"]["backend"] == "cudnn" and data["attention"]["tflops"] == 680.0
    for entry in [data["single_device"], *data["configurations"]]:
        assert entry["attention_kernel"] == "cudnn"
        assert 0 < entry["attention_seconds_per_step"] < entry["compute_seconds_per_step"]
    assert main(["plan", "--model", "flux-dev", "--devices", "2", "--attention_backend", "splash"]) == 2
    assert "--attention_tflops" in capsys.readouterr().err


def _gpu_check_json(tmp_path, attention, steps):
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps({"meta": {"device": "NVIDIA H200"}, "attention": attention, "steps": steps}))
    return path


def test_calibration_from_a_gpu_check_run(tmp_path, capsys):
    attention = [
        {"backend": "xla", "tflops": 50.0},
        {"backend": "xla", "tflops": 90.0},
        {"backend": "xla", "tflops": 70.0},
        {"backend": "cudnn", "tflops": 600.0},
    ]
    # A step of 100 TFLOP, 20 of them attention: at 70 TFLOP/s that is 0.2857 s of a 0.4857 s step,
    # so the other 80 TFLOP ran at 400 TFLOP/s.
    step = {"backend": "xla", "flops": 100e12, "attention_flops": 20e12, "seconds": 0.2 + 20 / 70}
    path = _gpu_check_json(tmp_path, attention, [step, dict(step, backend="cudnn", seconds=1.0)])
    measured = read_calibration(path, "xla")
    assert measured["attention_tflops"] == 70.0 and measured["tflops"] == pytest.approx(400.0)
    assert measured["source"] == "measured by gpu_check on NVIDIA H200 (gpu_check.json)"

    argv = ["plan", "--model", "flux-dev", "--devices", "8", "--attention_backend", "xla"]
    assert main([*argv, "--calibration", str(path)]) == 0
    text = capsys.readouterr().out
    assert "attention kernel xla at 70 TFLOP/s (asked; measured by gpu_check on NVIDIA H200" in text
    assert "matmuls at 400 TFLOP/s" in text
    assert main([*argv, "--calibration", str(path), "--tflops", "420", "--attention_tflops", "65"]) == 0
    text = capsys.readouterr().out  # flags given explicitly win over the file
    assert "xla at 65 TFLOP/s (asked; --attention_tflops)" in text and "matmuls at 420 TFLOP/s" in text

    with pytest.raises(ValueError, match=r"no attention timing for triton \(it has: cudnn, xla\)"):
        read_calibration(path, "triton")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main([*argv, "--calibration", str(bad)]) == 2
    assert "cannot read it as gpu_check JSON" in capsys.readouterr().err
