"""The dynamic vocabulary's hash table (jaxrec.ops.hash_table) on the GPU, at
HierarchicalKV's benchmark shape: 2^27 slots (HKV: 128M), buckets of 128, int64 keys, 1M
keys a call, at load factors 0.5 / 0.75 / 0.9 / 1.0.

    python benchmarks/hash_table_gpu.py --out benchmarks/results/hash_table_<device>.json

The keys of a call are HKV's benchmark's (``create_keys_for_hitrate``, ``last_insert``):
60% of them from the keys of the call before (held), 40% new (``find``: absent). Also
timed: ``find_or_insert`` of 1M keys that are all new. HKV reports "billion keys/s" in
units of 2^30 keys/s; this script reports keys/s (``hkv_unit`` in the JSON is 2^30).

Each kind of call is timed two ways:

* **in a jitted step** (``in_jit``), as a training step calls it: one jitted function runs
  8 calls one after the other (``find_or_insert``: the table carried and donated); a
  call's time is the function's wall time / 8 after an ahead-of-time compile and a first
  run on an empty table (``find``: the median of 3 runs; ``find_or_insert``: the mean of 2,
  of new keys: 1). That is the device's
  time per call, the launches between its kernels and an eighth of the function's start
  included, without a Python dispatch per call: what the targets are read on. (Not a
  ``lax.scan``: XLA's while loop copies its condition to the host every call, and slices
  of one stacked array reach the handler through a dynamic-slice thunk; both leave the
  device waiting, about 0.1 ms a call.)
* **a call from Python** (``python_call``), as HKV times a call (its C++ call and a stream
  synchronize): the wall time from the Python call to the result being ready, so the jit
  dispatch and the wait are in it (``find``: ``jaxrec.benchmark._measure.timed``, the median
  of 5 calls after 4 warm-up ones; ``find_or_insert``: the median of the last 5 of 6 calls).

For each load factor the table is filled with random distinct keys (``find_or_insert``,
LRU) to just below it, so that the new keys of the in-jit ``find_or_insert`` calls of
HKV's mix straddle it; each timed kind reports the load factors before and after it (at
1.0 every new key evicts). A device-to-device copy of the table's key array in the same
process is the copy ceiling. At load 0.5 the jnp reference (``backend="reference"``) is
timed too (from Python), for the kernels' speedup.

Zero collisions: 10M distinct ids inserted 1M a call into a table of 2^24 slots (load
0.6) must all get slots, none evicted or failed, every slot distinct, and ``find`` must
give each id its slot back.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrec.benchmark._environment import environment  # noqa: E402
from jaxrec.benchmark._measure import timed  # noqa: E402
from jaxrec.benchmark._report import write_json  # noqa: E402
from jaxrec.ops import hash_table as ht  # noqa: E402

HIT_RATE = 0.6  # HKV's benchmark: the share of a call's keys from the call before
CALLS = 8  # calls a jitted function runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--log2-capacity", type=int, default=27)
    p.add_argument("--batch", type=int, default=1 << 20)
    p.add_argument("--distinct", type=int, default=10_000_000, help="ids of the zero-collision check")
    args = p.parse_args(argv)
    capacity, n = 1 << args.log2_capacity, args.batch
    rng = np.random.default_rng(0)
    table = ht.create(capacity, bucket_size=128, dtype=jnp.int64)
    insert = jax.jit(functools.partial(ht.find_or_insert, policy="lru"), donate_argnums=0)
    find = jax.jit(ht.find)
    copy = jax.jit(lambda x: x + 0)
    ceiling_s = timed(copy, [(table.keys,)], 1, jax.block_until_ready)
    result = environment("hash_table_gpu", jax.devices()[0].device_kind, {}, {})
    result.update(capacity=capacity, bucket_size=128, key_dtype="int64", keys_per_call=n, hit_rate=HIT_RATE,
                  hkv_unit=2**30, copy_ceiling_gb_s=2 * table.keys.nbytes / ceiling_s / 1e9, runs=[])
    result["zero_collisions"] = zero_collisions(args.distinct, n)
    print(result["zero_collisions"], flush=True)

    def new_keys(count=n):
        return rng.integers(-2**63, 2**63 - 1, count, dtype=np.int64)

    def mixed(before):  # HKV's keys: HIT_RATE of them from `before`, the rest new, shuffled
        hits = rng.choice(before, int(HIT_RATE * n), replace=False)
        return rng.permutation(np.concatenate([hits, new_keys(n - hits.size)]))

    def load_factor():
        return int(ht.stats(table)["size"]) / capacity

    recent, step = collections.deque(maxlen=CALLS), 0  # the newest keys: held whatever the evictions
    for load in (0.5, 0.75, 0.9, 1.0):
        fill = capacity - n // 2 if load >= 1 else load * capacity - CALLS * (1 - HIT_RATE) * n
        while int(ht.stats(table)["size"]) < fill:
            keys = new_keys()
            _, table, _ = insert(table, jnp.asarray(keys), step)
            step += 1
            recent.append(keys)
        run = {"in_jit": {}, "python_call": {}}
        lf = [load_factor()]
        batches = [jnp.asarray(mixed(keys)) for keys in recent]
        run["in_jit"]["find_ms"] = find_in_jit(table, batches) * 1e3
        run["python_call"]["find_ms"] = timed(find, [(table, batches[-1])], 1, jax.block_until_ready) * 1e3
        before = recent[-1]
        times = []
        for _ in range(2):  # HKV's mix, in-jit
            batches = []
            for _ in range(CALLS):
                batches.append(mixed(before))
                before = batches[-1]
            table, seconds, step = find_or_insert_in_jit(table, [jnp.asarray(b) for b in batches], step)
            times.append(seconds)
        run["in_jit"]["find_or_insert_ms"] = statistics.mean(times) * 1e3
        lf.append(load_factor())
        times = []
        for _ in range(6):  # HKV's mix, from Python
            keys = mixed(before)
            ids = jnp.asarray(keys)
            jax.block_until_ready(ids)
            start = time.perf_counter()
            slots, table, info = insert(table, ids, step)
            jax.block_until_ready(slots)
            times.append(time.perf_counter() - start)
            step += 1
            before = keys
        run["python_call"]["find_or_insert_ms"] = statistics.median(times[1:]) * 1e3
        lf.append(load_factor())
        table, seconds, step = find_or_insert_in_jit(table, [jnp.asarray(new_keys()) for _ in range(CALLS)], step)
        run["in_jit"]["find_or_insert_all_new_ms"] = seconds * 1e3
        lf.append(load_factor())
        for how in run.values():
            how.update({k.replace("_ms", "_keys_per_s"): n / (v / 1e3) for k, v in list(how.items())})
        run.update(load_factor=(lf[0] + lf[1]) / 2, load_factors={
            "before": lf[0], "after_in_jit": lf[1], "after_python_calls": lf[2], "after_new_keys": lf[3]},
            evicted_last_python_call=int(info.evicted[0]), failed_last_python_call=int(info.failed[0]))
        if load == 0.5:  # the jnp reference, for the kernels' speedup (it does not donate)
            ref_find = jax.jit(functools.partial(ht.find, backend="reference"))
            ref_insert = jax.jit(functools.partial(ht.find_or_insert, policy="lru", backend="reference"))
            ids = jnp.asarray(mixed(before))
            run["reference_find_ms"] = timed(ref_find, [(table, ids)], 1, jax.block_until_ready) * 1e3
            run["reference_find_or_insert_ms"] = timed(ref_insert, [(table, ids, step)], 1,
                                                       jax.block_until_ready) * 1e3
        result["runs"].append(run)
        print(run, flush=True)
    if args.out:
        write_json(args.out, result)
    return 0


def find_in_jit(table, batches) -> float:
    """Seconds per ``find`` of one of ``batches`` (arrays of ids) when one jitted function runs them all."""
    run = ahead_of_time(find_calls, table, batches)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(run(table, batches))
        times.append(time.perf_counter() - start)
    return statistics.median(times) / len(batches)


def find_or_insert_in_jit(table, batches, step: int):
    """Seconds per ``find_or_insert`` of one of ``batches`` (separate arrays: slices of one
    would reach the handler through a dynamic-slice thunk) when one jitted function runs them
    all, the table carried and donated. Returns the table, that, the next step."""
    first_step = jnp.int32(step)  # on the device before the clock starts, as a training step's is
    run = ahead_of_time(find_or_insert_calls, table, batches, first_step)
    jax.block_until_ready((table, batches, first_step))
    start = time.perf_counter()
    table, slots = run(table, batches, first_step)
    jax.block_until_ready(slots)
    return table, (time.perf_counter() - start) / len(batches), step + len(batches)


@jax.jit
def find_calls(table, batches):
    return [ht.find(table, ids)[:1] for ids in batches]


@functools.partial(jax.jit, donate_argnums=0)
def find_or_insert_calls(table, batches, first_step):
    slots = []
    for k, ids in enumerate(batches):
        s, table, _ = ht.find_or_insert(table, ids, first_step + k, policy="lru")
        slots.append(s[:1])
    return table, slots


_COMPILED = {}


def ahead_of_time(fn, table, batches, *rest):
    """``fn`` compiled for these arguments, once per number of batches (the table's and the
    batches' shapes do not change), and run once on an empty table of the same shape: an
    executable's first run does one-time work (about 0.2 ms a call of ``find_or_insert``
    here) that a step run many times does not."""
    key = (fn, len(batches))
    if key not in _COMPILED:
        _COMPILED[key] = fn.lower(table, batches, *rest).compile()
        spare = ht.create(table.capacity, bucket_size=table.keys.shape[1], dtype=table.keys.dtype)
        jax.block_until_ready(_COMPILED[key](spare, batches, *rest))
    return _COMPILED[key]


def zero_collisions(distinct: int, n: int) -> dict:
    """``distinct`` ids (distinct by construction: an odd multiplier mod 2^64) into 2^24 slots."""
    table = ht.create(1 << 24, bucket_size=128, dtype=jnp.int64)
    insert = jax.jit(functools.partial(ht.find_or_insert, policy="lru"), donate_argnums=0)
    ids = (np.arange(distinct, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)
    slots, evicted, failed = [], 0, 0
    for step, start in enumerate(range(0, distinct, n)):
        s, table, info = insert(table, jnp.asarray(ids[start:start + n]), step)
        slots.append(s)
        evicted, failed = evicted + int(info.evicted[0]), failed + int(info.failed[0])
    slots = jnp.concatenate(slots)
    found = ht.find(table, jnp.asarray(ids))
    return {"ids": distinct, "capacity": table.capacity, "load_factor": distinct / table.capacity,
            "evicted": evicted, "failed": failed, "min_slot": int(slots.min()),
            "distinct_slots": int(jnp.unique(slots).size), "find_agrees": bool(jnp.all(found == slots))}


if __name__ == "__main__":
    sys.exit(main())
