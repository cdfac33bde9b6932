"""Where a sharded DLRM step's host time goes: host events per step, by name, from a trace.

    python benchmarks/step_host_trace.py OUT.json LABEL [--against DIR] [--case ...]

Builds the model of ``profile_sharded_step.py`` (``build``) for one case
(``kind:devices:comm_dtype:max_ids:rows``, default row-wise on 1 GPU) and, after the
warm-up steps of ``sharded_host_time.py``, traces 10 steps issued one at a time onto an
idle device (``issue``) and 10 back to back (``b2b``) with ``jax.profiler``. It reports,
per step, the device's events and the host's events by name (count and us), most costly
first: ``GpuExecutable::ExecuteThunks`` (launching the step), ``command_buffer::update``
(XLA re-recording a command buffer, a CUDA graph, whose buffers moved since the last call),
``command_buffer::execute`` and the thunks of custom calls. ``--against DIR`` traces an
older built checkout's step in the same process too (``sharded_host_time.load_builds``).
Tracing slows the host: compare traced numbers only with traced numbers.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile

import jax


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
    p.add_argument("label", help="this build's name in the results")
    p.add_argument("--against", metavar="DIR",
                   help="an older built checkout to trace in this process too (as 'base')")
    p.add_argument("--case", default="row_wise:1:float32:1:rows")
    p.add_argument("--batch-size", type=int, default=16384)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sharded_host_time import WARM_UP_STEPS, load_builds

    kind, n, comm_dtype, bound, rows = args.case.split(":")
    result = {"case": args.case, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "batch_per_device": args.batch_size, "builds": {}}
    calls = {}
    for label, (build, (log, tables, initial)) in load_builds(args.label, args.against,
                                                              100_000).items():
        call, batches, _ = build(kind, int(n), comm_dtype, int(bound), rows == "rows", log,
                                 tables, initial, args.batch_size)
        for i in range(WARM_UP_STEPS):
            jax.block_until_ready(call(batches[i % 4]))
        calls[label] = (call, batches)
    for label, (call, batches) in calls.items():
        result["builds"][label] = {mode: traced(call, batches, mode, args.top)
                                   for mode in ("issue", "b2b")}
        print(label, {mode: t["host_events"][:3] for mode, t in result["builds"][label].items()},
              flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
