"""Where a ``find_or_insert`` call's time goes on the GPU: a JAX profiler trace of one call
of 1M new ids and one of the same ids again (all found), at hash_table_gpu.py's shape
(2^27 slots, buckets of 128, int64 keys, LRU), at each of the given load factors; and the
kernel time of ``find`` of 1M held ids and of 1M absent ones, in random order.

    python benchmarks/hash_table_profile.py --out benchmarks/results/hash_table_profile_<device>.json

For each call: the device time of its kernels, grouped ("sorts": CUB's radix sort
kernels; the lookup; the placement; the rest, the sort's fix-up of equal keys among them),
the device's busy time and its span (from the call's first device event, the copy of its
Python-int step, to its last). Also the wall time of back-to-back calls of new ids.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import sys
import tempfile
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrec.benchmark._environment import environment  # noqa: E402
from jaxrec.benchmark._report import write_json  # noqa: E402
from jaxrec.ops import hash_table as ht  # noqa: E402

GROUPS = {"DeviceRadix": "sorts", "LookupRuns": "lookup", "PlaceNewRuns": "placement"}
CAPACITY, N = 1 << 27, 1 << 20  # slots, ids a call


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--loads", type=float, nargs="+", default=[0.75, 0.5])
    args = p.parse_args(argv)
    result = environment("hash_table_profile", jax.devices()[0].device_kind, {}, {})
    result.update(capacity=CAPACITY, bucket_size=128, keys_per_call=N, runs=[profile(load) for load in args.loads])
    if args.out:
        write_json(args.out, result)
    return 0


def profile(target_load: float) -> dict:
    rng = np.random.default_rng(0)

    def fresh():
        return jnp.asarray(rng.integers(-2**63, 2**63 - 1, N, dtype=np.int64))

    table = ht.create(CAPACITY, bucket_size=128, dtype=jnp.int64)
    insert = jax.jit(functools.partial(ht.find_or_insert, policy="lru"), donate_argnums=0)
    step = 0
    while int(ht.stats(table)["size"]) < int(target_load * CAPACITY) - 6 * N:
        _, table, _ = insert(table, fresh(), step)
        step += 1
    for _ in range(2):  # warm-up
        _, table, _ = insert(table, fresh(), step)
        step += 1
    back_to_back = [fresh() for _ in range(4)]
    jax.block_until_ready(table)
    start = time.perf_counter()
    for keys in back_to_back:
        slots, table, _ = insert(table, keys, step)
        step += 1
    jax.block_until_ready(slots)
    per_call_ms = (time.perf_counter() - start) / len(back_to_back) * 1e3
    load = int(ht.stats(table)["size"]) / CAPACITY

    new, absent = fresh(), fresh()
    find = jax.jit(ht.find)
    jax.block_until_ready(find(table, absent))
    trace_dir = tempfile.mkdtemp(prefix="hash_table_profile_")
    jax.profiler.start_trace(trace_dir)
    for keys in (new, new):  # new ids, then the same ids: found
        slots, table, _ = insert(table, keys, step)
        jax.block_until_ready(slots)
        step += 1
        time.sleep(0.01)  # a gap that separates the calls in the trace
    for keys in (new, absent):
        jax.block_until_ready(find(table, keys))
        time.sleep(0.01)
    jax.profiler.stop_trace()
    calls = split_calls(device_events(trace_dir))
    find_us = [sum(e["dur"] for e in call if "FindKernel" in e["name"]) for call in calls[-2:]]
    run = {"load_factor": load, "back_to_back_ms_per_call": per_call_ms,
           "calls": {"new_ids": summarize(calls[-4]), "found_ids": summarize(calls[-3])},
           "find_kernel_us": {"held_ids": round(find_us[0], 1), "absent_ids": round(find_us[1], 1)}}
    print(json.dumps(run, indent=1), flush=True)
    return run


def device_events(trace_dir: str) -> list[dict]:
    (path,) = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
    data = json.load(gzip.open(path))
    gpu = {e["pid"] for e in data["traceEvents"]
           if e.get("ph") == "M" and e.get("name") == "process_name" and "GPU" in e["args"]["name"]}
    return sorted((e for e in data["traceEvents"] if e.get("ph") == "X" and e["pid"] in gpu), key=lambda e: e["ts"])


def split_calls(events: list[dict], gap_us: float = 1000) -> list[list[dict]]:
    calls = [[events[0]]]
    for before, e in zip(events, events[1:]):
        if e["ts"] - before["ts"] - before["dur"] > gap_us:
            calls.append([])
        calls[-1].append(e)
    return calls


def summarize(events: list[dict]) -> dict:
    groups = collections.Counter()
    for e in events:
        groups[next((g for key, g in GROUPS.items() if key in e["name"]), "rest")] += e["dur"]
    span = events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]
    return {"kernels_us": {g: round(t, 1) for g, t in groups.items()},
            "busy_us": round(sum(groups.values()), 1), "span_us": round(span, 1)}


if __name__ == "__main__":
    sys.exit(main())
