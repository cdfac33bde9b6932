#!/usr/bin/env bash
# Runs NVIDIA compute-sanitizer (memcheck, then racecheck) over the GPU tests of
# jaxrec's own kernels, on a machine where jaxrec is installed with its CUDA library
# (benchmarks/gpu_check.sh builds it). Only kernels whose name matches "jaxrec" are
# instrumented (--kernel-name kns=jaxrec: every kernel lives in namespace jaxrec), so
# XLA's own kernels run at full speed and are not reported. First, two positive
# controls (control.cu: a kernel of namespace jaxrec with an out-of-bounds write, one
# with a shared-memory race) must each be reported under the same filter: otherwise
# the filter or the tool sees nothing, and the script fails instead of passing.
#
# Logs go to $OUT (default ./sanitize-out): memcheck.log, racecheck.log and summary.txt,
# one "<tool>: ERROR SUMMARY: N errors" line per tool (the sum over the processes).
#   usage: benchmarks/sanitizer/sanitize_gpu.sh [test files, default: the kernel tests below]
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
# Plain kernel launches, no CUDA graphs (XLA's command buffers): the sanitizer then sees
# each launch of jaxrec's kernels on its own.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="

# Tests whose name says "reference" run jnp references through XLA's own GPU kernels;
# with compute-sanitizer 2025.3 and JAX 0.11 on an H100 the sanitized process segfaulted
# or hung at the first of them, so they are deselected (DESELECT= runs them). Some files
# still end in a segfault without a reported error: the summary marks such a run FAILED
# (docs/reliability.md lists which).
DESELECT=${DESELECT:-not reference}
MEMCHECK_TESTS=(tests/reliability/test_kernel_bounds.py tests/test_tbe.py tests/test_bounds_check.py
                tests/optim/test_fused_update.py tests/tt/test_tt_embedding.py)
RACECHECK_TESTS=(tests/tt/test_tt_embedding.py tests/reliability/test_kernel_bounds.py
                 tests/test_bounds_check.py)

count_errors() {  # a log's reported errors: memcheck's ERROR SUMMARY, racecheck's hazards
  { sed -nE 's/.*ERROR SUMMARY: ([0-9]+) error.*/\1/p' "$1"
    sed -nE 's/.*RACECHECK SUMMARY: .*\(([0-9]+) errors?, ([0-9]+) warnings?\).*/\1 \2/p' "$1"
  } | awk '{for (i = 1; i <= NF; i++) s += $i} END {print s + 0}'
}

run() {  # tool, test files...: one sanitized pytest process per file
  local tool=$1 failed=0 file errors tests
  shift
  : >"$OUT/$tool.log"
  for file in "$@"; do
    echo "### $file" >>"$OUT/$tool.log"
    "$SANITIZER" --tool "$tool" --target-processes all --kernel-name kns=jaxrec \
      --print-limit 100 --error-exitcode 0 \
      $PY -m pytest -v -m gpu -k "$DESELECT" -p no:xdist -p no:cacheprovider "$file" >"$OUT/part.log" 2>&1
    local rc=$?
    cat "$OUT/part.log" >>"$OUT/$tool.log"
    tests=$(grep -E "[0-9]+ (passed|failed)" "$OUT/part.log" | tail -1)
    errors=$(count_errors "$OUT/part.log")
    # A run that crashed or ended without pytest's summary checked nothing: a failure.
    if [[ $rc -ne 0 || -z "$tests" || "$tests" == *failed* ]]; then
      failed=1
      echo "$tool $file: FAILED RUN (exit $rc, pytest: ${tests:-no summary})" | tee -a "$OUT/summary.txt"
    fi
    echo "$tool $file: ERROR SUMMARY: $errors errors (pytest: ${tests:-none})" | tee -a "$OUT/summary.txt"
  done
  rm -f "$OUT/part.log"
  return $failed
}

: >"$OUT/summary.txt"
"$SANITIZER" --version | tail -1 | tee -a "$OUT/summary.txt"

# The positive controls: each tool must find the planted bug under the same filter.
control=$(mktemp -d)/control
nvcc -O1 -arch=sm_90 -o "$control" benchmarks/sanitizer/control.cu || exit 2
for pair in memcheck:oob racecheck:race; do
  tool=${pair%%:*}
  "$SANITIZER" --tool "$tool" --kernel-name kns=jaxrec --error-exitcode 0 \
    "$control" "${pair##*:}" >"$OUT/control_$tool.log" 2>&1
  found=$(count_errors "$OUT/control_$tool.log")
  echo "control ($tool, planted bug): ERROR SUMMARY: $found errors" | tee -a "$OUT/summary.txt"
  if [[ "$found" -eq 0 ]]; then
    echo "the $tool control was not reported: the filter or the tool sees nothing" | tee -a "$OUT/summary.txt"
    exit 2
  fi
done
status=0
if [[ $# -gt 0 ]]; then
  run memcheck "$@" || status=1
  run racecheck "$@" || status=1
else
  run memcheck "${MEMCHECK_TESTS[@]}" || status=1
  run racecheck "${RACECHECK_TESTS[@]}" || status=1
fi
grep -v "^control" "$OUT/summary.txt" | grep -q "ERROR SUMMARY: [1-9]" && status=1
exit $status
