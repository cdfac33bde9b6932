"""The host's time to issue a sharded DLRM train step, for comparing builds.

    python benchmarks/sharded_host_time.py OUT.json LABEL [--checkout DIR] [--cases ...]

Builds the model of ``profile_sharded_step.py`` (``build``: 26 Criteo tables, D=128, fused
rowwise Adagrad, one Zipf id per bag) for each case (``kind:devices:comm_dtype:max_ids:rows``)
and measures, after ``WARM_UP_STEPS`` warm-up steps:

* ``issue_ms``: one step issued while nothing is queued on the device (the step is
  awaited before the next is issued), the median of 60: the host's own work per step,
  free of backpressure from a device that is behind;
* ``host_ms``: the time to issue 20 back-to-back steps, per step, the median of 15
  repeats; of it ``dispatch_ms``, inside the compiled step's call (launching its kernels),
  and ``python_ms``, the rest; ``step_ms``: the 20 steps to completion, per step.

Tables are capped at ``--max-rows`` (100,000: the host's work does not depend on a table's
size). ``--checkout DIR`` takes ``build`` from that checkout's benchmarks (an older build,
installed where ``PYTHONPATH`` points): alternate the builds, one process each, to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
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


def measure(call, batches, timer: DispatchTimer) -> dict:
    for i in range(WARM_UP_STEPS):
        jax.block_until_ready(call(batches[i % 4]))
    host, dispatch, step = [], [], []
    for _ in range(15):
        block = back_to_back(call, batches, timer)
        host.append(block["host_ms"])
        dispatch.append(block["dispatch_ms"])
        step.append(block["step_ms"])
    issue = []
    for i in range(60):
        start = time.perf_counter()
        out = call(batches[i % 4])
        issue.append((time.perf_counter() - start) * 1e3)
        jax.block_until_ready(out)
    median = statistics.median
    return {"issue_ms": median(issue), "host_ms": median(host), "dispatch_ms": median(dispatch),
            "python_ms": median(h - d for h, d in zip(host, dispatch)), "step_ms": median(step),
            "samples": {"issue_ms": issue, "host_ms": host, "dispatch_ms": dispatch, "step_ms": step}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("label")
    p.add_argument("--checkout", help="take build() from this checkout's benchmarks/")
    p.add_argument("--cases", default="row_wise:2:float32:1:rows,table_wise:2:float32:1:rows,"
                                      "row_wise:1:float32:1:rows")
    p.add_argument("--max-rows", type=int, default=100_000)
    p.add_argument("--batch-size", type=int, default=16384)
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.join(args.checkout, "benchmarks") if args.checkout
                    else os.path.dirname(os.path.abspath(__file__)))
    import numpy as np
    from flax import nnx
    from profile_sharded_step import build

    from jaxrec.data import CRITEO_KAGGLE_CARDINALITIES, SyntheticClickLog
    from jaxrec.nn import EmbeddingBagConfig

    log = SyntheticClickLog(num_embeddings_per_feature=CRITEO_KAGGLE_CARDINALITIES,
                            max_rows=args.max_rows, scatter_ids=True, seed=0)
    tables = [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=r, embedding_dim=128,
                                 feature_names=[k]) for k, r in zip(log.keys, log.table_sizes)]
    rngs = nnx.Rngs(0)
    with jax.default_device(jax.devices()[0]):
        initial = {t.name: {"weights": np.asarray(t.init(rngs.params()))} for t in tables}
    result = {"label": args.label, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "batch_per_device": args.batch_size, "max_rows": args.max_rows, "cases": {}}
    for spec in args.cases.split(","):
        kind, n, comm_dtype, bound, rows = spec.split(":")
        with DispatchTimer() as timer:
            call, batches, _ = build(kind, int(n), comm_dtype, int(bound), rows == "rows", log,
                                     tables, initial, args.batch_size)
            case = result["cases"][spec] = measure(call, batches, timer)
        print(f"{args.label} {spec}: issue alone {case['issue_ms']:.3f} ms; back to back: host "
              f"{case['host_ms']:.3f} (dispatch {case['dispatch_ms']:.3f}, python "
              f"{case['python_ms']:.3f}), step {case['step_ms']:.3f}", flush=True)
        del call, batches
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
