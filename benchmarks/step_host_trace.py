"""Where a sharded DLRM step's host time goes: host events per step, by name, from a trace.

    python benchmarks/step_host_trace.py OUT.json LABEL [--checkout DIR] [--case ...]

Builds the model of ``profile_sharded_step.py`` (``build``) for one case
(``kind:devices:comm_dtype:max_ids:rows``, default row-wise on 1 GPU) and, after the
warm-up steps of ``sharded_host_time.py``, times steps issued one at a time onto an idle
device (``issue``) and 20 back to back (``b2b``), the median of 40 each (ms per step, and
of it ``dispatch_ms`` inside the compiled step's call). Then it traces 10 steps of each
mode with ``jax.profiler`` and reports, per step, the device's events and the host's
events by name (count and us), most costly first: ``GpuExecutable::ExecuteThunks``
(launching the step), ``command_buffer::update`` (XLA re-recording a command buffer, a
CUDA graph, whose buffers moved since the last call) and ``command_buffer::execute``.
Alternate the builds, one process each (``--checkout``, as ``sharded_host_time.py``), to
compare; tracing slows the host, so compare traced numbers only with traced numbers.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import numpy as np


def timed(call, batches, timer, mode: str, repeats: int = 40) -> dict:
    ms, dispatch = [], []
    for r in range(repeats):
        timer.seconds = 0.0
        start = time.perf_counter()
        if mode == "issue":
            out = call(batches[r % 4])
            ms.append((time.perf_counter() - start) * 1e3)
            dispatch.append(timer.seconds * 1e3)
            jax.block_until_ready(out)
        else:
            for i in range(20):
                out = call(batches[i % 4])
            ms.append((time.perf_counter() - start) / 20 * 1e3)
            dispatch.append(timer.seconds / 20 * 1e3)
            jax.block_until_ready(out)
    return {"ms": statistics.median(ms), "dispatch_ms": statistics.median(dispatch),
            "q25": float(np.percentile(ms, 25)), "q75": float(np.percentile(ms, 75))}


def traced(call, batches, mode: str, top: int, steps: int = 10) -> dict:
    directory = tempfile.mkdtemp()
    jax.profiler.start_trace(directory)
    for i in range(steps):
        out = call(batches[i % 4])
        if mode == "issue":
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    (path,) = glob.glob(f"{directory}/**/*.trace.json.gz", recursive=True)
    events = json.load(gzip.open(path))["traceEvents"]
    process = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    count, duration = collections.Counter(), collections.Counter()
    device = 0
    for e in events:
        name = process.get(e.get("pid"), "").lower()
        if e.get("ph") != "X":
            continue
        if "gpu" in name and "host" not in name:
            device += 1
        elif "host" in name and not e["name"].startswith("$"):
            count[e["name"][:70]] += 1
            duration[e["name"][:70]] += e.get("dur", 0)
    host = [{"name": k, "per_step": count[k] / steps, "us_per_step": duration[k] / steps}
            for k in sorted(duration, key=lambda k: -duration[k])[:top]]
    return {"device_events_per_step": device / steps, "host_events": host}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("label")
    p.add_argument("--checkout", help="take build() from this checkout's benchmarks/")
    p.add_argument("--case", default="row_wise:1:float32:1:rows")
    p.add_argument("--batch-size", type=int, default=16384)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sharded_host_time import WARM_UP_STEPS, DispatchTimer
    sys.path.insert(0, os.path.join(args.checkout, "benchmarks") if args.checkout
                    else os.path.dirname(os.path.abspath(__file__)))
    from flax import nnx
    from profile_sharded_step import build

    from jaxrec.data import CRITEO_KAGGLE_CARDINALITIES, SyntheticClickLog
    from jaxrec.nn import EmbeddingBagConfig

    log = SyntheticClickLog(num_embeddings_per_feature=CRITEO_KAGGLE_CARDINALITIES,
                            max_rows=100_000, scatter_ids=True, seed=0)
    tables = [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=r, embedding_dim=128,
                                 feature_names=[k]) for k, r in zip(log.keys, log.table_sizes)]
    rngs = nnx.Rngs(0)
    initial = {t.name: {"weights": np.asarray(t.init(rngs.params()))} for t in tables}
    kind, n, comm_dtype, bound, rows = args.case.split(":")
    with DispatchTimer() as timer:
        call, batches, _ = build(kind, int(n), comm_dtype, int(bound), rows == "rows", log,
                                 tables, initial, args.batch_size)
        for i in range(WARM_UP_STEPS):
            jax.block_until_ready(call(batches[i % 4]))
        result = {"label": args.label, "case": args.case, "device": jax.devices()[0].device_kind,
                  "jax": jax.__version__, "batch_per_device": args.batch_size}
        for mode in ("issue", "b2b"):
            result[mode] = timed(call, batches, timer, mode)
    for mode in ("issue", "b2b"):
        result[f"{mode}_trace"] = traced(call, batches, mode, args.top)
    print(args.label, {m: round(result[m]["ms"], 3) for m in ("issue", "b2b")}, flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
