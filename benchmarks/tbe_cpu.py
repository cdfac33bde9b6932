"""CPU TBE side by side: jaxrec's C++ handlers, plain XLA on the CPU, FBGEMM's CPU TBE.

    python benchmarks/tbe_cpu.py [--configs 8,32] [--iters 30] [--no-fbgemm] [--quick] [--out FILE.json]

The benchmark lives in jaxrec.benchmark (also `jaxrec bench --platform cpu`); this is its
command line. Without --out the JSON goes to benchmarks/results/tbe_cpu_<date>.json.
"""

import sys
from pathlib import Path

# benchmarks/fused_cpu.py imports these from here.
from jaxrec.benchmark import NUM_ID_SETS, interleaved_medians, machine_info, tbe_cpu_script  # noqa: F401

if __name__ == "__main__":
    sys.exit(tbe_cpu_script(results_dir=Path(__file__).parent / "results"))
