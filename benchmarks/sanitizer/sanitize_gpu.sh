#!/usr/bin/env bash
# Runs NVIDIA compute-sanitizer (memcheck and racecheck) over the GPU tests of
# jaxrec's own kernels, on a machine where jaxrec is installed with its CUDA library
# (benchmarks/gpu_check.sh builds it). Only kernels whose name matches "jaxrec" are
# instrumented (--kernel-name kns=jaxrec: every kernel lives in namespace jaxrec), so
# XLA's own kernels run at full speed and are not reported. First, two positive
# controls (control.cu: a kernel of namespace jaxrec with an out-of-bounds write, one
# with a shared-memory race) must each be reported under the same filter: otherwise
# the filter or the tool sees nothing, and the script fails instead of passing.
#
# Logs go to $OUT (default ./sanitize-out): one <tool>.<test file>.log per run, and
# summary.txt with one "ERROR SUMMARY" line per run (memcheck's errors, racecheck's
# hazards) and its pytest summary. Fails on any error and on any run that crashed or
# ended without a pytest summary.
#   usage: benchmarks/sanitizer/sanitize_gpu.sh [test files, default: the kernel tests below]
# Takes about 3 minutes on one H100 host (the runs go in parallel; the fused-update
# tests under memcheck are the longest).
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

# Every GPU test of these files, the jnp references run through XLA's own kernels
# included (they are not instrumented, see --kernel-name). Only the pytest process is
# tracked (--target-processes application-only): tracking every child as well ("all")
# made the sanitizer itself segfault midway while the tests went on.
DESELECT=${DESELECT:-}
MEMCHECK_TESTS=(tests/reliability/test_kernel_bounds.py tests/test_tbe.py tests/test_bounds_check.py
                tests/optim/test_fused_update.py tests/tt/test_tt_embedding.py)
RACECHECK_TESTS=(tests/tt/test_tt_embedding.py tests/reliability/test_kernel_bounds.py
                 tests/test_bounds_check.py)

count_errors() {  # a log's reported errors: memcheck's ERROR SUMMARY, racecheck's hazards
  { sed -nE 's/.*ERROR SUMMARY: ([0-9]+) error.*/\1/p' "$1"
    sed -nE 's/.*RACECHECK SUMMARY: .*\(([0-9]+) errors?, ([0-9]+) warnings?\).*/\1 \2/p' "$1"
  } | awk '{for (i = 1; i <= NF; i++) s += $i} END {print s + 0}'
}

sanitize() {  # tool, test file: one sanitized pytest process, its log and exit status
  local log="$OUT/$1.$(echo "$2" | tr / _).log"
  "$SANITIZER" --tool "$1" --target-processes application-only --kernel-name kns=jaxrec \
    --print-limit 100 --error-exitcode 0 \
    $PY -m pytest -v -m gpu ${DESELECT:+-k "$DESELECT"} -p no:xdist -p no:cacheprovider "$2" >"$log" 2>&1
  echo $? >"$log.rc"
}

summarize() {  # tool, test file: its summary line; fails on errors or a run that checked nothing
  local log="$OUT/$1.$(echo "$2" | tr / _).log" rc tests errors
  rc=$(cat "$log.rc")
  rm -f "$log.rc"
  tests=$(grep -E "[0-9]+ (passed|failed)" "$log" | tail -1 | tr -d =)
  errors=$(count_errors "$log")
  echo "$1 $2: ERROR SUMMARY: $errors errors (pytest:${tests:- none}, exit $rc)" | tee -a "$OUT/summary.txt"
  # A run that crashed or ended without pytest's summary checked nothing: a failure.
  [[ $rc -eq 0 && -n "$tests" && "$tests" != *failed* && $errors -eq 0 ]]
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
# The runs are independent processes: all at once (about 5 minutes on an H100 host).
memcheck_tests=("${MEMCHECK_TESTS[@]}")
racecheck_tests=("${RACECHECK_TESTS[@]}")
if [[ $# -gt 0 ]]; then memcheck_tests=("$@"); racecheck_tests=("$@"); fi
for file in "${memcheck_tests[@]}"; do sanitize memcheck "$file" & done
for file in "${racecheck_tests[@]}"; do sanitize racecheck "$file" & done
wait
status=0
for file in "${memcheck_tests[@]}"; do summarize memcheck "$file" || status=1; done
for file in "${racecheck_tests[@]}"; do summarize racecheck "$file" || status=1; done
exit $status
