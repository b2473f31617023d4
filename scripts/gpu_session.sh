#!/usr/bin/env bash
# The first GPU run: one call of at most 8 minutes on a GPU host, from the root of this checkout:
#
#   OUT=/some/dir bash scripts/gpu_session.sh            # default OUT: ./gpu_session_out
#
# It exports JAX_PLATFORMS=cuda (unless the caller set it) and stops within seconds, with one line, unless jax sees a GPU. Then:
#   1. versions: jax, jaxlib, the CUDA plugin and PJRT, cuDNN's runtime version, flax, numpy, the driver
#      and nvidia-smi (into session.json's meta.versions);
#   2. wheels carried in the git-ignored .whl/ (scripts/gpu_wheels.sh fetches them on a networked host)
#      are installed only where an import is missing or older than WANT_<package> below;
#   3. python -m gpubench (scripts/gpubench/): ceilings, attention kernels judged then timed, the FLUX-dev
#      1024px step per backend (cudnn first), each row written to session.json as it is measured.
# $OUT gets 3 files: session.json (everything, versions and nvidia-smi included), session.log (all
# output) and table.txt (also printed last).
#
# GPU_SESSION_DRY_RUN=1: tiny shapes, whatever platform jax has (a CPU in CI), the same files and table.
# PYTHON=... picks the interpreter (default python3); SESSION_BUDGET (default 400 s) bounds part 3.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$PWD/gpu_session_out}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
cd "$ROOT" || exit 1
PYTHON="${PYTHON:-python3}"
DRY="${GPU_SESSION_DRY_RUN:-0}"
SESSION_BUDGET="${SESSION_BUDGET:-400}"
WANT_flax="${WANT_flax:-0.12.0}"
export GPU_SESSION_DRY_RUN="$DRY"
# A CUDA plugin that fails to start must stop the run, not leave it on the CPU at full-size shapes.
# A caller that forces another platform (JAX_PLATFORMS=cpu) is honoured, and the gate below stops it.
[ "$DRY" = "1" ] || export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"
export PYTHONPATH="$ROOT:$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1
LOG="$OUT/session.log"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
: >"$LOG"
START=$(date +%s)
say() { echo "[gpu_session $(($(date +%s) - START))s] $*" | tee -a "$LOG" >&2; }

# ------------------------------------------------------------------------- the gate: a GPU, or one line
if [ "$DRY" != "1" ]; then
  if ! seen=$(timeout 60 "$PYTHON" -c 'import jax; d = jax.devices(); assert d[0].platform == "gpu", d; print(d[0].device_kind, len(d))' 2>>"$LOG"); then
    echo "gpu_session: no GPU seen by jax (JAX_PLATFORMS=${JAX_PLATFORMS}); stopping (details in $LOG)"
    exit 2
  fi
  say "jax sees: $seen"
fi

# ------------------------------------------------------------------------------- wheels, only if needed
if [ -d "$ROOT/.whl" ]; then
  need=$("$PYTHON" - "$WANT_flax" <<'EOF2'
import importlib.metadata as md, sys
def old(name, want):
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        return True
    num = lambda v: tuple(int(p) for p in v.split(".")[:3] if p.isdigit())
    return num(have) < num(want)
print(" ".join(n for n, w in (("flax", sys.argv[1]),) if old(n, w)))
EOF2
)
  if [ -n "$need" ]; then
    say "installing from .whl/: $need"
    "$PYTHON" -m pip install --no-index --find-links "$ROOT/.whl" $need >>"$LOG" 2>&1 || say "wheel install failed"
  fi
fi

# ------------------------------------------------------------------------------------------- versions
{ command -v nvidia-smi >/dev/null && timeout 20 nvidia-smi || echo "nvidia-smi: not found"; } >"$TMP/nvidia-smi.txt" 2>&1
timeout 60 "$PYTHON" - "$TMP/versions.json" "$TMP/nvidia-smi.txt" <<'EOF2' >>"$LOG" 2>&1
import importlib.metadata as md, json, platform, re, sys
v = {"python": platform.python_version()}
for name in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt",
             "flax", "numpy"):
    try:
        v[name] = md.version(name)
    except md.PackageNotFoundError:
        v[name] = None
smi = open(sys.argv[2]).read()
m = re.search(r"Driver Version:\s*([\d.]+)", smi)
v["driver"] = m.group(1) if m else None
v["nvidia_smi"] = smi
try:
    from jax._src.cudnn import fused_attention_stablehlo as fa
    v["cudnn_runtime"] = fa.check_cudnn_version()
except Exception as e:  # noqa: BLE001
    v["cudnn_runtime"] = f"unavailable ({type(e).__name__}: {e})"
json.dump(v, open(sys.argv[1], "w"), indent=1)
print("versions:", {k: x for k, x in v.items() if k != "nvidia_smi"})
EOF2
say "versions recorded"

# --------------------------------------------------------------------------------------- measurements
timeout $((SESSION_BUDGET + 15)) "$PYTHON" -m gpubench "$OUT" "$TMP/versions.json" "$SESSION_BUDGET" >>"$LOG" 2>&1
rc=$?
say "gpubench: exit $rc"
if [ -f "$OUT/table.txt" ]; then cat "$OUT/table.txt"; else echo "gpu_session: no table (gpubench exit $rc; see $LOG)"; fi
exit $rc
