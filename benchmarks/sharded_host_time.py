"""The host's time to issue a sharded DLRM train step, for comparing builds.

    python benchmarks/sharded_host_time.py OUT.json LABEL [--against DIR] [--cases ...]

Builds the model of ``profile_sharded_step.py`` (``build``: 26 Criteo tables, D=128, fused
rowwise Adagrad, one Zipf id per bag) for each case (``kind:devices:comm_dtype:max_ids:rows``)
and measures, after ``WARM_UP_STEPS`` warm-up steps:

* ``host_ms``: the time to issue 20 back-to-back steps, per step, the median of
  ``--repeats`` blocks; of it ``dispatch_ms``, inside the compiled step's call (launching
  its kernels), and ``python_ms``, the rest; ``step_ms``: the 20 steps to completion, per step;
* ``issue_ms``: one step issued while nothing is queued on the device (the step is
  awaited before the next is issued), the median of 60: the host's own work per step,
  free of backpressure from a device that is behind.

``--against DIR`` builds the same model with an older built checkout in the same process
(``older_build.py``) and alternates the two builds' blocks and steps. A process's host
time falls into modes about 1.5x apart for its whole life, so builds compare only inside
one process; run several processes to sample the modes, alternating ``--base-first``: on
one GPU the model built first issued its steps up to 1.08x slower than a second copy of
itself built last (docs/parallel.md, "Host time of a step"). ``--settle`` measures each
block after an unmeasured block of the same build, as in a process that trains one
model; without it every block follows the other build's. Tables are capped at
``--max-rows`` (100,000: the host's work does not depend on a table's size).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import jax


class DispatchTimer:
    """While active, the functions ``jax.jit`` returns add the seconds spent inside their
    calls to ``seconds``, and keep doing so after: the compiled step's dispatch, apart
    from the Python around it (the train step jits on its first call)."""

    def __init__(self):
        self.seconds = 0.0
        self._jit = jax.jit

    def __enter__(self):
        timer = self

        class Timed:
            def __init__(self, jitted):
                self._jitted = jitted

            def __call__(self, *args, **kwargs):
                start = time.perf_counter()
                try:
                    return self._jitted(*args, **kwargs)
                finally:
                    timer.seconds += time.perf_counter() - start

            def __getattr__(self, name):
                return getattr(self._jitted, name)

        jax.jit = lambda *args, **kwargs: Timed(self._jit(*args, **kwargs))
        return self

    def __exit__(self, *exc):
        jax.jit = self._jit


# Past the step guard's first two latch copies (steps 15 and 31): the first compiles
# jnp.copy, the second the copy into a reused buffer, whose tracing set off a full
# garbage collection (~120 ms on a 2-core host); within the measured steps either
# would be one slow sample.
WARM_UP_STEPS = 40


def back_to_back(call, batches, timer: DispatchTimer) -> dict:
    """20 steps issued back to back, ms per step: ``host_ms`` to issue them, of it
    ``dispatch_ms`` inside the compiled step's call, and ``step_ms`` to their completion."""
    timer.seconds = 0.0
    start = time.perf_counter()
    for i in range(20):
        out = call(batches[i % 4])
    issued = time.perf_counter()
    jax.block_until_ready(out)
    done = time.perf_counter()
    return {"host_ms": (issued - start) / 20 * 1e3, "dispatch_ms": timer.seconds / 20 * 1e3,
            "step_ms": (done - start) / 20 * 1e3}


def measure(calls: dict, timer: DispatchTimer, repeats: int = 15, settle: bool = False) -> dict:
    """``calls`` maps a name to ``(call, batches)``. After ``WARM_UP_STEPS`` each, their
    20-step blocks alternate, in an order rotated each repeat, and then their single steps;
    per name, medians and samples.

    ``settle``: each measured block (and single step) follows an unmeasured one of the same
    call, as in a process that trains one model; else it follows another call's, whose
    code and buffers have just passed through the host's caches."""
    for call, batches in calls.values():
        for i in range(WARM_UP_STEPS):
            out = call(batches[i % 4])
        jax.block_until_ready(out)
    names = list(calls)
    samples = {n: {"issue_ms": [], "host_ms": [], "dispatch_ms": [], "python_ms": [],
                   "step_ms": []} for n in names}
    for r in range(repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:
            if settle:
                back_to_back(*calls[n], timer)
            block = back_to_back(*calls[n], timer)
            block["python_ms"] = block["host_ms"] - block["dispatch_ms"]
            for key, value in block.items():
                samples[n][key].append(value)
    for i in range(60):
        for n in names:
            call, batches = calls[n]
            if settle:
                jax.block_until_ready(call(batches[(i + 1) % 4]))
            start = time.perf_counter()
            out = call(batches[i % 4])
            samples[n]["issue_ms"].append((time.perf_counter() - start) * 1e3)
            jax.block_until_ready(out)
    return {n: {**{k: statistics.median(v) for k, v in s.items()}, "samples": s}
            for n, s in samples.items()}


def load_builds(label: str, against: str | None, max_rows: int) -> dict:
    """``{label: (build, (log, tables, initial))}`` for this build and, given ``against``
    (an older built checkout), ``"base"`` for that one, in this process (``older_build.py``):
    ``profile_sharded_step``'s ``build`` and ``criteo_tables`` inputs of each."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import profile_sharded_step

    builds = {label: (profile_sharded_step.build, profile_sharded_step.criteo_tables(max_rows))}
    if against:
        from older_build import PACKAGE, import_older

        older = import_older(against, tempfile.mkdtemp())
        builds["base"] = (older.build, profile_sharded_step.criteo_tables(max_rows, PACKAGE))
    return builds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("label", help="this build's name in the results")
    p.add_argument("--against", metavar="DIR",
                   help="an older built checkout to run in this process too (as 'base')")
    p.add_argument("--base-first", action="store_true",
                   help="build the older checkout's model first (alternate it across processes)")
    p.add_argument("--cases", default="row_wise:2:float32:1:rows,table_wise:2:float32:1:rows,"
                                      "row_wise:1:float32:1:rows")
    p.add_argument("--max-rows", type=int, default=100_000)
    p.add_argument("--batch-size", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--settle", action="store_true",
                   help="precede each measured block by an unmeasured one of the same build")
    args = p.parse_args(argv)
    builds = load_builds(args.label, args.against, args.max_rows)
    if args.base_first:
        builds = dict(reversed(builds.items()))
    result = {"labels": list(builds), "device": jax.devices()[0].device_kind,
              "jax": jax.__version__, "batch_per_device": args.batch_size,
              "max_rows": args.max_rows, "repeats": args.repeats, "settle": args.settle,
              "cases": {}}
    for spec in args.cases.split(","):
        kind, n, comm_dtype, bound, rows = spec.split(":")
        with DispatchTimer() as timer:
            calls = {}
            for label, (build, (log, tables, initial)) in builds.items():
                call, batches, _ = build(kind, int(n), comm_dtype, int(bound), rows == "rows",
                                         log, tables, initial, args.batch_size)
                calls[label] = (call, batches)
            case = result["cases"][spec] = measure(calls, timer, args.repeats, args.settle)
        for label, m in case.items():
            print(f"{label} {spec}: issue alone {m['issue_ms']:.3f} ms; back to back: host "
                  f"{m['host_ms']:.3f} (dispatch {m['dispatch_ms']:.3f}, python "
                  f"{m['python_ms']:.3f}), step {m['step_ms']:.3f}", flush=True)
        del calls
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
