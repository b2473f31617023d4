#!/usr/bin/env bash
# One GPU session, run once by whoever has the GPU: everything the GPU issues ask to be measured there.
#
#   OUT=/some/dir bash scripts/gpu_session.sh          # default OUT: ./gpu_session_out
#
# Installs nothing and reaches no network: it runs this checkout (PYTHONPATH) with the Python that has
# jax (0.11 with its CUDA plugin on the GPU host), flax and jaxdit's other dependencies installed
# already; PYTHON=... picks another interpreter. It stops itself within SESSION_BUDGET seconds (default
# 540: under the 10 minutes one command may take), in this order:
#
#   1. env.txt: the GPU (nvidia-smi), Python, jax, jaxlib, the devices jax sees, the backends it would use.
#   2. generate/: `jaxdit generate` on the bundled tiny-digits model on the GPU, each run in its own
#      process (each at most 90 s; the phase at most GENERATE_BUDGET, default 150 s):
#        fp32 default (auto)  vs  fp32 --attention_backend xla    -> bit for bit (auto is XLA for fp32)
#        fp32 --attention_backend cudnn (cuDNN takes no fp32)     -> exactly one fallback warning
#        bf16 --attention_backend xla  vs  bf16 default (auto: cuDNN), triton -> max |difference|
#      generate/summary.json holds the verdicts; each run's stderr is kept beside its latents.
#   3. gpu_check.json (written after every row) and gpu_check.log: scripts/gpu_check.py with the time
#      left, less a margin (at most 450 s).
#
# GPU_CHECK_ARGS adds flags to gpu_check (GPU_CHECK_ARGS=--tiny: a dry run of this script on a CPU,
# JAX_PLATFORMS=cpu); GPU_SESSION_TORCH=1 lets gpu_check time diffusers too where torch is installed.
# Send back the whole OUT folder.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$PWD/gpu_session_out}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
# From the checkout: `python -m` puts the working directory first on sys.path, so run anywhere else a
# jaxdit found there (another checkout, an install) would be the one measured.
cd "$ROOT" || exit 1
PYTHON="${PYTHON:-python3}"
SESSION_BUDGET="${SESSION_BUDGET:-540}"
GENERATE_BUDGET="${GENERATE_BUDGET:-150}"
MARGIN=25
START=$(date +%s)
mkdir -p "$OUT/generate"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# No network: nothing below needs it, and a lookup must fail at once rather than hang.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PIP_NO_INDEX=1
# Compiled programs of this session only (gpu_check reruns would read them); never the user's cache.
export JAXDIT_COMPILATION_CACHE="${JAXDIT_COMPILATION_CACHE:-${TMPDIR:-/tmp}/jaxdit-gpu-session-cache}"

elapsed() { echo $(($(date +%s) - START)); }
say() { echo "[gpu_session $(elapsed)s] $*" | tee -a "$OUT/session.log" >&2; }

# ------------------------------------------------------------------------------------------------ 1. env
{
  echo "date: $(date -u +%FT%TZ)"
  echo "checkout: $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout'))"
  command -v nvidia-smi >/dev/null && timeout 30 nvidia-smi || echo "nvidia-smi: not found"
  timeout 120 "$PYTHON" - <<'EOF'
import importlib.metadata as md, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "flax", "numpy"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
try:
    import jax, jax.numpy as jnp
    print("devices", jax.devices())
    from jaxdit.parallel import kernels
    for dtype in (jnp.bfloat16, jnp.float32):
        for asked in kernels.CHOICES:
            c = kernels.backend_for(None, dtype, (1, 4608, 3, 128), requested=asked)
            print(f"attention {jnp.dtype(dtype).name} {asked}: {c.backend}" + (f" ({c.reason})" if c.reason else ""))
except Exception as e:  # noqa: BLE001
    print("jax/jaxdit failed:", type(e).__name__, e)
EOF
} >"$OUT/env.txt" 2>&1
say "env: $(grep -E '^(python|jax |devices)' "$OUT/env.txt" | tr '\n' ' ')"

# ------------------------------------------------------------------------------------------- 2. generate
GEN="$OUT/generate"
gen_start=$(date +%s)
run_generate() { # name, then generate's flags
  local name="$1"
  shift
  local left=$((GENERATE_BUDGET - ($(date +%s) - gen_start)))
  if [ "$left" -lt 20 ]; then
    say "generate $name: skipped (generate phase out of time)"
    return
  fi
  local limit=$((left < 90 ? left : 90))
  timeout "$limit" "$PYTHON" -m jaxdit.cli generate --prompt 0123456789 --seed 0 --no_compilation_cache \
    --output "$GEN/$name.npy" "$@" >"$GEN/$name.out" 2>"$GEN/$name.err"
  local rc=$?
  echo "$rc" >"$GEN/$name.rc"
  say "generate $name ($*): exit $rc"
}
# Most telling first: a phase that runs out of time drops the last (triton is in gpu_check as well).
run_generate fp32_default
run_generate fp32_xla --attention_backend xla
run_generate fp32_cudnn --attention_backend cudnn
run_generate bf16_default --dtype bfloat16
run_generate bf16_xla --dtype bfloat16 --attention_backend xla
run_generate bf16_triton --dtype bfloat16 --attention_backend triton

timeout 60 "$PYTHON" - "$GEN" <<'EOF' 2>&1 | tee -a "$OUT/session.log"
import json, sys
from pathlib import Path
import numpy as np

gen = Path(sys.argv[1])
def run(name):
    rc = gen / f"{name}.rc"
    err = gen / f"{name}.err"
    text = err.read_text(errors="replace") if err.exists() else ""
    return {
        "exit": int(rc.read_text()) if rc.exists() else None,
        "latents": str(gen / f"{name}.npy") if (gen / f"{name}.npy").exists() else None,
        "fallback_warnings": [l for l in text.splitlines() if "KernelFallbackWarning" in l],
    }
def load(name):
    p = gen / f"{name}.npy"
    return np.load(p) if p.exists() else None
def compare(a, b):
    x, y = load(a), load(b)
    if x is None or y is None:
        return {"pair": [a, b], "verdict": "missing output"}
    same = x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes()
    diff = float(np.abs(x.astype(np.float64) - y.astype(np.float64)).max()) if x.shape == y.shape else None
    return {"pair": [a, b], "bit_identical": same, "max_abs_diff": diff, "scale": float(np.abs(y).max())}
names = ["fp32_default", "fp32_xla", "bf16_xla", "bf16_default", "bf16_triton", "fp32_cudnn"]
summary = {
    "runs": {n: run(n) for n in names},
    "fp32 default == xla (bit for bit expected)": compare("fp32_default", "fp32_xla"),
    "bf16 default (cuDNN) vs xla": compare("bf16_default", "bf16_xla"),
    "bf16 triton vs xla": compare("bf16_triton", "bf16_xla"),
    "fp32 cudnn request vs xla": compare("fp32_cudnn", "fp32_xla"),
}
cudnn = summary["runs"]["fp32_cudnn"]
summary["cudnn fp32 request: exactly one fallback warning"] = (
    len(cudnn["fallback_warnings"]) == 1 if cudnn["exit"] is not None else "not run"
)
for n in ("fp32_default", "fp32_xla", "bf16_xla", "bf16_default"):
    if summary["runs"][n]["fallback_warnings"]:
        summary.setdefault("unexpected warnings", {})[n] = summary["runs"][n]["fallback_warnings"]
(gen / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
EOF

# ------------------------------------------------------------------------------------------ 3. gpu_check
left=$((SESSION_BUDGET - $(elapsed) - MARGIN))
budget=$((left < 450 ? left : 450))
if [ "$budget" -lt 60 ]; then
  say "gpu_check: skipped, only ${left}s left"
else
  TORCH_FLAG="--no-torch"
  [ "${GPU_SESSION_TORCH:-0}" = "1" ] && TORCH_FLAG=""
  say "gpu_check: budget ${budget}s"
  timeout $((budget + 20)) "$PYTHON" "$ROOT/scripts/gpu_check.py" --out "$OUT/gpu_check.json" \
    --budget "$budget" $TORCH_FLAG ${GPU_CHECK_ARGS:-} >"$OUT/gpu_check.log" 2>&1
  say "gpu_check: exit $? (table in gpu_check.log, every row in gpu_check.json)"
  tail -n 40 "$OUT/gpu_check.log" >&2
fi
say "done; results in $OUT"
