"""TBE lookup on the GPU, side by side with plain XLA, PyTorch and the copy ceiling.

    python benchmarks/tbe_gpu.py --out benchmarks/results/tbe_gpu_<device>.json [--quick] [--only CASE ...]

The benchmark lives in jaxrec.benchmark (also `jaxrec bench`); this is its command line.
"""

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # PyTorch shares the GPU

# benchmarks/fused_gpu.py imports these from here.
from jaxrec.benchmark import NUM_ID_SETS as SETS  # noqa: E402, F401
from jaxrec.benchmark import (
    tbe_gpu_script,  # noqa: E402
    )

if __name__ == "__main__":
    sys.exit(tbe_gpu_script())
