"""scripts/gpu_session.sh and scripts/gpubench: the dry run end to end on a CPU, the gate that stops a
run jax cannot put on a GPU, correctness judged before timing, and batched timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_session.sh"
sys.path.insert(0, str(ROOT / "scripts"))  # gpubench's modules import one another as gpubench.<module>

from gpubench import attention, timing  # noqa: E402

from jaxdit.parallel.local_attention import local_attention  # noqa: E402


def _session(out: Path, **env_extra) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(PYTHON=sys.executable, OUT=str(out), **env_extra)
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


def test_dry_run_writes_three_files_judges_rows_and_prints_the_table_last(tmp_path):
    done = _session(tmp_path, GPU_SESSION_DRY_RUN="1", JAX_PLATFORMS="cpu")
    assert done.returncode == 0, done.stderr + (tmp_path / "session.log").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["session.json", "session.log", "table.txt"]
    table = (tmp_path / "table.txt").read_text()
    assert done.stdout.rstrip().endswith(table.rstrip())  # the table is printed last
    data = json.loads((tmp_path / "session.json").read_text())
    assert data["meta"]["dry_run"] and data["meta"]["versions"]["jax"] == jax.__version__
    assert data["ceilings"]["matmul_tflops"] > 0 and data["ceilings"]["copy_gbps"] > 0
    rows = {(r["part"], r.get("case", r.get("model")), r["backend"]): r for r in data["rows"]}
    for case in attention.DRY_CASES:
        for backend in ("xla", "triton"):  # triton in Pallas' interpreter on a CPU
            r = rows[("attention", case.name, backend)]
            assert r["status"] == "ok" and r["correct"] and r["tflops"] > 0
            assert r["lse_err"] <= attention.LSE_BOUND and r["rel_l2"] <= attention.REL_L2_BOUND
        assert rows[("attention", case.name, "cudnn")]["status"] == "unavailable"
    step = rows[("step", "flux-dev", "xla")]
    assert step["status"] == "ok" and step["compile_seconds"] > 0 and step["seconds"] > 0
    # The FP8 step follows the first bf16 one that ran, on the same backend (weight-only on a CPU).
    fp8 = rows[("step", "flux-dev", "xla+fp8")]
    assert fp8["status"] == "ok" and fp8["fp8_mode"] == "weight" and fp8["speedup_vs_bf16"] > 0
    assert fp8["param_gb"] < step["param_gb"]
    assert "cuDNN >= 500" in data["targets"][0]


def test_forcing_the_cpu_stops_the_real_session_in_seconds_with_one_line(tmp_path):
    start = time.monotonic()
    done = _session(tmp_path, JAX_PLATFORMS="cpu")
    assert time.monotonic() - start < 10
    assert done.returncode == 2
    assert done.stdout.splitlines() == [done.stdout.strip()] and "no GPU seen by jax" in done.stdout
    assert not (tmp_path / "session.json").exists()  # nothing measured on the CPU


@pytest.fixture(scope="module")
def padded_case():
    case = attention.DRY_CASES[0]  # padding keys inside the sequence
    q, k, v, mask = attention.inputs(case)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    ref = [np.asarray(x) for x in local_attention(*f32, mask, backend="xla")]
    return (q, k, v, mask), ref


def test_judge_passes_the_kernel_and_fails_an_ignored_mask_or_a_nan(padded_case):
    (q, k, v, mask), ref = padded_case
    assert not mask.all()
    assert attention.judge(*local_attention(q, k, v, mask, backend="xla"), *ref)["correct"]
    ignored = attention.judge(*local_attention(q, k, v, None, backend="xla"), *ref)
    assert not ignored["correct"] and ignored["lse_err"] > attention.LSE_BOUND
    out, lse = local_attention(q, k, v, mask, backend="xla")
    poisoned = attention.judge(out.at[0, 0, 0, 0].set(jnp.nan), lse, *ref)
    assert poisoned == {**poisoned, "finite": False, "correct": False}


def test_batched_median_blocks_once_per_batch_of_back_to_back_calls(monkeypatch):
    calls, blocks = [], []
    monkeypatch.setattr(timing.jax, "block_until_ready", lambda x: blocks.append(x) or x)
    seconds = timing.batched_median(lambda: calls.append(1) or len(calls), (), warmups=2, batch=20, batches=7)
    assert len(calls) == 2 + 20 * 7 and len(blocks) == 2 + 7 and seconds >= 0
    assert blocks[2:] == [2 + 20 * (i + 1) for i in range(7)]  # each batch's last call is the one waited on
