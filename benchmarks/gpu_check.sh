#!/usr/bin/env bash
# Builds jaxrec on a GPU machine that has no network, against the jax/jaxlib
# installed there (so the FFI headers match the runtime), then runs the tests,
# the GPU-marked ones included. Logs go to $OUT (default ./gpu_check_out).
#   usage: benchmarks/gpu_check.sh [pytest arguments, default: tests]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -1
  $PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.txt"

if ! JAXREC_CUDA=ON $PY -m pip install --no-build-isolation --no-deps -v . >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  exit 1
fi
$PY -c "import jaxrec; print(jaxrec.build_info())" 2>&1 | tee -a "$OUT/env.txt"
$PY -m pytest -q -rs -p no:cacheprovider "${@:-tests}" 2>&1 | tee "$OUT/pytest.log"
exit "${PIPESTATUS[0]}"
