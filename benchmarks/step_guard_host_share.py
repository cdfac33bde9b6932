"""The step guard's share of the host's time per step, inside one process.

    python benchmarks/step_guard_host_share.py OUT.json [--case row_wise:1:float32:1:rows]

A process's host time per step falls into modes about 1.5x apart that last its whole life
(docs/parallel.md, "Host time of a step"), so two builds, each in its own process,
compare poorly. Variants of one build compare inside one process: this builds the model of
``profile_sharded_step.py`` once per variant of the train step and alternates 20-step
blocks of them (``sharded_host_time.measure``: 15 repeats, medians):

* ``raise``: the default step (``on_nonfinite="raise"``);
* ``ignore``: ``on_nonfinite="ignore"`` (no finiteness check, no selects of the old state);
* ``nofinite``: the default with its finiteness check replaced by ``True``;
* ``noread``: the default without the every-16th-step latch copy and read;
* ``local`` (sharded cases only): the default without its two collectives, the
  all-reduce of the verdict before the backward and the one of the counts after the
  finiteness check: each device decides alone.

``nofinite``, ``noread`` and ``local`` change the guard and exist to measure it, not to
train.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

import jaxrec._step_guard as guard
from jaxrec.benchmark._environment import environment
from jaxrec.nn import make_train_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_sharded_step import build, criteo_tables
from sharded_dlrm_gpu import bce
from sharded_host_time import DispatchTimer, measure

VARIANTS = ("raise", "ignore", "nofinite", "noread", "local")


def _never_read(monitor, fatal, latch, messages) -> None:
    monitor._latch = latch
    monitor.steps += 1


def variant_step(name: str):
    step = make_train_step(bce, on_nonfinite="ignore" if name == "ignore" else "raise")
    if name == "noread":
        step._monitor.issued = _never_read.__get__(step._monitor)
    return step


def first_call(name: str, call, batch) -> None:
    """Compiles the step; ``nofinite`` compiles with the finiteness check as ``True``,
    ``local`` with the guard's trace told of no mesh axis."""
    keep = guard.all_finite, guard.tracing
    if name == "nofinite":
        guard.all_finite = lambda leaves: jnp.ones((), bool)
    if name == "local":
        guard.tracing = lambda policy, latch, axis_name=None: keep[1](policy, latch)
    try:
        jax.block_until_ready(call(batch))
    finally:
        guard.all_finite, guard.tracing = keep


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--case", default="row_wise:1:float32:1:rows")
    p.add_argument("--max-rows", type=int, default=100_000)
    p.add_argument("--batch-size", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    log, tables, initial = criteo_tables(args.max_rows)
    kind, n, comm_dtype, bound, rows = args.case.split(":")
    variants = VARIANTS if int(n) > 1 else VARIANTS[:-1]
    calls = {}
    with DispatchTimer() as timer:
        for name in variants:
            call, batches, _ = build(kind, int(n), comm_dtype, int(bound), rows == "rows", log,
                                     tables, initial, args.batch_size, step=variant_step(name))
            first_call(name, call, batches[0])
            calls[name] = (call, batches)
        measured = measure(calls, timer, args.repeats)
    median = {name: {k: v for k, v in m.items() if k != "samples"} for name, m in measured.items()}
    samples = {name: m["samples"] for name, m in measured.items()}
    result = {**environment("step_guard_host_share", jax.devices()[0].device_kind, {}, {}),
              "case": args.case,
              "batch_per_device": args.batch_size, "median": median,
              "host_ms_over_raise": {name: median[name]["host_ms"] / median["raise"]["host_ms"]
                                     for name in variants},
              "samples": samples}
    for name in variants:
        print(f"{name}: host {median[name]['host_ms']:.3f} ms (dispatch "
              f"{median[name]['dispatch_ms']:.3f}), {result['host_ms_over_raise'][name]:.3f}x raise; "
              f"step {median[name]['step_ms']:.3f}", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
