#!/usr/bin/env bash
# Runs NVIDIA compute-sanitizer (memcheck, then racecheck) over the GPU tests of
# jaxrec's own kernels, on a machine where jaxrec is installed with its CUDA library
# (benchmarks/gpu_check.sh builds it). Only kernels whose name matches "jaxrec" are
# instrumented (--kernel-regex kns=jaxrec: every kernel lives in namespace jaxrec), so
# XLA's own kernels run at full speed and are not reported. First, two positive
# controls (control.cu: a kernel of namespace jaxrec with an out-of-bounds write, one
# with a shared-memory race) must each be reported under the same filter: otherwise
# the filter or the tool sees nothing, and the script fails instead of passing.
#
# Logs go to $OUT (default ./sanitize-out): memcheck.log, racecheck.log and summary.txt,
# one "<tool>: ERROR SUMMARY: N errors" line per tool (the sum over the processes).
#   usage: benchmarks/sanitizer/sanitize_gpu.sh [pytest arguments, default: the kernel tests below]
# Takes about 4-6 minutes on one H100 (racecheck is the slow one: it instruments every
# shared-memory access, so it runs the kernels with shared memory, TT, only).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-sanitize-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"

SANITIZER=${SANITIZER:-}
if [[ -z "$SANITIZER" ]]; then
  for candidate in "$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")/compute-sanitizer" \
                   /usr/local/cuda/bin/compute-sanitizer "$(command -v compute-sanitizer)"; do
    if [[ -x "$candidate" ]]; then SANITIZER=$candidate; break; fi
  done
fi
if [[ -z "$SANITIZER" ]]; then
  echo "compute-sanitizer not found: set SANITIZER=/path/to/compute-sanitizer" | tee "$OUT/summary.txt"
  exit 2
fi
if ! $PY -c "import jaxrec, sys; sys.exit(0 if jaxrec.build_info()['cuda'] else 1)"; then
  echo "jaxrec was built without its CUDA library (see jaxrec.build_info())" | tee "$OUT/summary.txt"
  exit 2
fi

# Allocations straight from the CUDA driver (no XLA pool), so memcheck sees each
# buffer's real bounds: an access past a small buffer is not hidden inside the pool.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_PYTHON_CLIENT_ALLOCATOR=platform
export TF_CPP_MIN_LOG_LEVEL=2

MEMCHECK_TESTS=(tests/reliability/test_kernel_bounds.py tests/test_tbe.py tests/test_bounds_check.py
                tests/optim/test_fused_update.py tests/tt/test_tt_embedding.py)
RACECHECK_TESTS=(tests/tt/test_tt_embedding.py tests/reliability/test_kernel_bounds.py
                 tests/test_bounds_check.py)

run() {  # tool, pytest arguments...
  local tool=$1
  shift
  "$SANITIZER" --tool "$tool" --target-processes all --kernel-regex kns=jaxrec \
    --print-limit 100 --error-exitcode 0 \
    $PY -m pytest -q -m gpu -p no:xdist -p no:cacheprovider "$@" >"$OUT/$tool.log" 2>&1
  local errors
  errors=$(grep -o "ERROR SUMMARY: [0-9]* error" "$OUT/$tool.log" | awk '{s += $3} END {print s + 0}')
  local tests
  tests=$(grep -E "[0-9]+ (passed|failed|skipped|error)" "$OUT/$tool.log" | tail -1)
  echo "$tool: ERROR SUMMARY: $errors errors (pytest: ${tests:-no summary, see $tool.log})" |
    tee -a "$OUT/summary.txt"
}

: >"$OUT/summary.txt"
"$SANITIZER" --version | tail -1 | tee -a "$OUT/summary.txt"

# The positive controls: each tool must find the planted bug under the same filter.
nvcc -O1 -arch=sm_90 -o "$OUT/control" benchmarks/sanitizer/control.cu || exit 2
for pair in memcheck:oob racecheck:race; do
  tool=${pair%%:*}
  "$SANITIZER" --tool "$tool" --kernel-regex kns=jaxrec --error-exitcode 0 \
    "$OUT/control" "${pair##*:}" >"$OUT/control_$tool.log" 2>&1
  found=$(grep -o "ERROR SUMMARY: [0-9]* error" "$OUT/control_$tool.log" | awk '{s += $3} END {print s + 0}')
  echo "control ($tool, planted bug): ERROR SUMMARY: $found errors" | tee -a "$OUT/summary.txt"
  if [[ "$found" -eq 0 ]]; then
    echo "the $tool control was not reported: the filter or the tool sees nothing" | tee -a "$OUT/summary.txt"
    exit 2
  fi
done
if [[ $# -gt 0 ]]; then
  run memcheck "$@"
  run racecheck "$@"
else
  run memcheck "${MEMCHECK_TESTS[@]}"
  run racecheck "${RACECHECK_TESTS[@]}"
fi
! grep -v "^control" "$OUT/summary.txt" | grep -q "ERROR SUMMARY: [1-9]"
