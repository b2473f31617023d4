#!/usr/bin/env bash
# On a networked host: fetch the wheels the GPU host (Python 3.12, manylinux x86_64, no network) may lack
# into the git-ignored .whl/, which travels with the working tree. gpu_session.sh installs from it only
# where an import is missing or too old. Kept under 64 MiB (checked below).
set -eu
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$ROOT/.whl"
for spec in "flax==${FLAX_VERSION:-0.12.0}" treescope; do
  python3 -m pip download --python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all: \
    --no-deps "$spec" -d "$ROOT/.whl"
done
size=$(du -sm "$ROOT/.whl" | cut -f1)
[ "$size" -le 64 ] || { echo "gpu_wheels: .whl/ is ${size} MiB, over the 64 MiB that travels" >&2; exit 1; }
echo "gpu_wheels: .whl/ ${size} MiB"
