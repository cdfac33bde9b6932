"""Benchmarks of jaxrec's TBE lookup against its peers, installed with the package.

``jaxrec bench`` (:func:`main`) runs the benchmark of the platform at hand;
``benchmarks/tbe_gpu.py`` and ``benchmarks/tbe_cpu.py`` are the same benchmarks with
their own command lines. PyTorch and FBGEMM are optional peers: a result names them
under "skipped" when they do not import.

Modules, one concept each:

    _measure.py       the timing loops, the id sets, the bytes counted (FBGEMM's way)
    _environment.py   device, versions and optional peers: the header of every result
    _tbe_gpu.py       GPU: jaxrec vs XLA take+sum / segment_sum vs torch embedding_bag
    _tbe_cpu.py       CPU: jaxrec's C++ handlers vs XLA vs FBGEMM's CPU TBE
    _report.py        progress lines, the terminal table, the JSON file
    _cli.py           ``jaxrec bench``
"""

from jaxrec.benchmark._cli import main
from jaxrec.benchmark._environment import machine_info, nvidia_driver
from jaxrec.benchmark._measure import (
    NUM_ID_SETS,
    interleaved_medians,
    interleaved_timed,
    lookup_bytes,
    timed,
)
from jaxrec.benchmark._tbe_cpu import tbe_cpu, tbe_cpu_script
from jaxrec.benchmark._tbe_gpu import tbe_gpu, tbe_gpu_script

__all__ = [
    "NUM_ID_SETS",
    "interleaved_medians",
    "interleaved_timed",
    "lookup_bytes",
    "machine_info",
    "main",
    "nvidia_driver",
    "tbe_cpu",
    "tbe_cpu_script",
    "tbe_gpu",
    "tbe_gpu_script",
    "timed",
]
