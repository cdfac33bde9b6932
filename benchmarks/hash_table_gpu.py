"""The dynamic vocabulary's hash table (jaxrec.ops.hash_table) on the GPU, at
HierarchicalKV's benchmark shape: 2^27 slots (HKV: 128M), buckets of 128, int64 keys, 1M
keys a call, at load factors 0.5 / 0.75 / 0.9 / 1.0.

    python benchmarks/hash_table_gpu.py --out benchmarks/results/hash_table_<device>.json

For each load factor the table is filled with random distinct keys (find_or_insert, LRU),
then timed: ``find`` of 1M keys it holds (``jaxrec.benchmark._measure.timed``: the median
of 5 calls after 4 warm-up ones) and ``find_or_insert`` of 1M new keys (at 1.0 every
insert evicts; the median of the last 5 of 6 calls), next to a device-to-device copy of the
table's key array in the same process (the copy ceiling). Keys/s = 1M / time. At load
0.5 the jnp reference (``backend="reference"``) is timed too, for the kernels' speedup.

Zero collisions: 10M distinct ids inserted 1M a call into a table of 2^24 slots (load
0.6) must all get slots, none evicted or failed, every slot distinct, and ``find`` must
give each id its slot back.
"""

from __future__ import annotations

import argparse
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
    result.update(capacity=capacity, bucket_size=128, key_dtype="int64", keys_per_call=n,
                  copy_ceiling_gb_s=2 * table.keys.nbytes / ceiling_s / 1e9, runs=[])
    result["zero_collisions"] = zero_collisions(args.distinct, n)
    print(result["zero_collisions"], flush=True)
    present, step = None, 0
    for load in (0.5, 0.75, 0.9, 1.0):
        while int(ht.stats(table)["size"]) < int(load * capacity) - n // 2:
            keys = jnp.asarray(rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64))
            _, table, _ = insert(table, keys, step)
            step += 1
            present = keys  # the newest keys: held whatever the evictions
        size = int(ht.stats(table)["size"])
        find_s = timed(find, [(table, present)], 1, jax.block_until_ready)
        new = [jnp.asarray(rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64)) for _ in range(6)]
        insert_times = []
        for keys in new:  # each call inserts 1M new keys (the table grows, or evicts at 1.0)
            start = time.perf_counter()
            slots, table, info = insert(table, keys, step)
            jax.block_until_ready(slots)
            insert_times.append(time.perf_counter() - start)
            step += 1
        insert_s = statistics.median(insert_times[1:])
        run = {"load_factor": size / capacity, "find_ms": find_s * 1e3, "find_keys_per_s": n / find_s,
               "find_or_insert_ms": insert_s * 1e3, "find_or_insert_keys_per_s": n / insert_s,
               "evicted_last_call": int(info.evicted[0]), "failed_last_call": int(info.failed[0])}
        if load == 0.5:  # the jnp reference, for the kernels' speedup (it does not donate)
            ref_find = jax.jit(functools.partial(ht.find, backend="reference"))
            ref_insert = jax.jit(functools.partial(ht.find_or_insert, policy="lru", backend="reference"))
            run["reference_find_ms"] = timed(ref_find, [(table, present)], 1, jax.block_until_ready) * 1e3
            run["reference_find_or_insert_ms"] = timed(ref_insert, [(table, new[0], step)], 1,
                                                       jax.block_until_ready) * 1e3
        result["runs"].append(run)
        print(run, flush=True)
        present = new[-1]
    if args.out:
        write_json(args.out, result)
    return 0


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
