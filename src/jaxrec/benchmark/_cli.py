"""``jaxrec bench``: the TBE lookup benchmark of the platform at hand.

    jaxrec bench [--quick] [--out FILE] [--platform auto|gpu|cpu]

auto picks the GPU benchmark where JAX sees a CUDA GPU and jaxrec's CUDA library
was built (``jaxrec.build_info()["cuda"]``), the CPU benchmark elsewhere. The table
goes to stdout, progress to stderr, the JSON to --out.
"""

from __future__ import annotations

import argparse
import sys

import jax

import jaxrec
from jaxrec.benchmark._environment import share_gpu_with_torch
from jaxrec.benchmark._report import table, write_json
from jaxrec.benchmark._tbe_cpu import QUICK_CONFIG, QUICK_ITERS, cpu_config, tbe_cpu
from jaxrec.benchmark._tbe_gpu import tbe_gpu


def gpu_ready() -> bool:
    """Whether JAX sees a CUDA GPU and jaxrec's CUDA library was built."""
    try:
        has_gpu = bool(jax.devices("cuda"))
    except RuntimeError:  # no CUDA backend in this jaxlib, or no GPU
        return False
    return has_gpu and bool(jaxrec.build_info()["cuda"])


def main(argv: list[str] | None = None) -> int:
    """Runs ``jaxrec bench`` with the arguments `argv` (default: sys.argv[1:]); returns 0.

    Invalid arguments exit with status 2, as argparse does.
    """
    parser = argparse.ArgumentParser(
        prog="jaxrec bench",
        description="TBE lookup: jaxrec side by side with plain XLA and, where they import, "
                    "PyTorch (GPU) or FBGEMM's CPU TBE (CPU).")
    parser.add_argument("--quick", action="store_true",
                        help="small shapes and few iterations: a smoke test (CPU: a few seconds)")
    parser.add_argument("--out", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--platform", choices=["auto", "gpu", "cpu"], default="auto",
                        help="auto: gpu where JAX sees a CUDA GPU and jaxrec's CUDA library was built")
    args = parser.parse_args(argv)

    share_gpu_with_torch()  # before JAX starts its GPU backend, which gpu_ready() does
    platform = args.platform
    if platform == "auto":
        platform = "gpu" if gpu_ready() else "cpu"
    elif platform == "gpu" and not gpu_ready():
        parser.error("--platform gpu needs a CUDA GPU visible to JAX and jaxrec's CUDA library "
                     f"(jaxrec.build_info()['cuda'] is {jaxrec.build_info()['cuda']}); "
                     "run `jaxrec bench --platform cpu`, or install jax[cuda12] and rebuild jaxrec "
                     "with JAXREC_CUDA=ON")

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if platform == "gpu":
        result = tbe_gpu(quick=args.quick, out=args.out, log=progress)
    elif args.quick:
        result = tbe_cpu(configs=[cpu_config(**QUICK_CONFIG)], iters=QUICK_ITERS, log=progress)
    else:
        result = tbe_cpu(log=progress)
    if args.out:
        write_json(args.out, result)
    print(table(result))
    if args.out:
        print(f"wrote {args.out}")
    return 0
