"""Host memory on the GPU: PCIe copy rates, the row gather of host-placed tables and the row
exchange of host-cached tables.

    python benchmarks/host_cache_gpu.py --out benchmarks/results/host_cache_gpu_<device>.json

In one process, on tables of ``--rows`` rows of D=128 float32 (and a row-wise optimizer
state) in host memory (JAX's ``pinned_host``):

- the PCIe rates of bulk copies, host -> device and device -> host (``jax.device_put`` of
  a 1 GiB array): the ceiling;
- the gather of a host-placed table (``placement="host"``): N random distinct rows, in
  the sorted order that the lookup reads them in (and, to show why, in random order), of
  the weights alone and of the weights with the state, into device memory; and the
  write-back of N rows to host memory;
- ``jaxrec.ops.host_cache.exchange_rows`` loading N random distinct rows into a device
  cache (a miss each), and writing N back while loading N (an eviction each): the bytes
  crossing PCIe per second, and their share of the copy rate of that direction.

Times: the median of 20 calls after 3 warm-up calls, each call on fresh random rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec.benchmark._environment import environment
from jaxrec.benchmark._report import write_json
from jaxrec.ops.host_cache import copy_rows, exchange_rows, to_host_memory

DIM = 128


def copy_rate(x, sharding) -> float:
    """GB/s of ``jax.device_put(x, sharding)``, the median of 10."""
    times = []
    for _ in range(11):
        start = time.perf_counter()
        jax.device_put(x, sharding).block_until_ready()
        times.append(time.perf_counter() - start)
    return x.nbytes / statistics.median(times[1:]) / 1e9


def exchange_rate(cache, host, n: int, evict: bool, rng) -> dict:
    """The exchange of ``n`` rows (loads, and write-backs if ``evict``): ms and GB/s."""
    cache_rows, host_rows = cache[1].size, host[1].size
    run = jax.jit(lambda c, h, *rows: exchange_rows(c, h, *rows, cache_num_rows=cache_rows, host_num_rows=host_rows),
                  donate_argnums=(0, 1))
    times = []
    for i in range(23):
        picked = rng.choice(host_rows, size=2 * n, replace=False).astype(np.int32)
        slots = rng.choice(cache_rows, size=n, replace=False).astype(np.int32)
        rows = [jnp.asarray(a) for a in (slots, picked[:n] if evict else np.full(n, -1, np.int32), picked[n:])]
        jax.block_until_ready(rows)
        start = time.perf_counter()
        cache, host = run(cache, host, *rows)
        jax.block_until_ready((cache, host))
        if i >= 3:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    row_bytes = (DIM + 1) * 4  # the row and its row-wise state
    moved = n * row_bytes * (2 if evict else 1)
    return {"rows": n, "evict": evict, "ms": seconds * 1e3, "gb_per_s": moved / seconds / 1e9}, cache, host


def _gather(buffers, rows, n: int, total: int):
    at = jnp.arange(n, dtype=jnp.int32)
    return [copy_rows(jnp.zeros((b.size // total * n,), b.dtype), at, b, rows, dst_num_rows=n, src_num_rows=total)
            for b in buffers]


def _scatter(buffers, rows, scratch, n: int, total: int):
    at = jnp.arange(n, dtype=jnp.int32)
    return [copy_rows(b, rows, s, at, dst_num_rows=total, src_num_rows=n) for b, s in zip(buffers, scratch)]


def gather_rate(host, n: int, rng, *, ordered: bool, with_state: bool) -> dict:
    """The host placement's gather of ``n`` random distinct rows (sorted if ``ordered``):
    ms and GB/s of the rows moved."""
    total = host[1].size
    buffers = host if with_state else host[:1]
    run = jax.jit(lambda b, rows: _gather(b, rows, n, total))
    times = []
    for i in range(23):
        rows = rng.choice(total, size=n, replace=False).astype(np.int32)
        rows = jnp.asarray(np.sort(rows) if ordered else rows)
        jax.block_until_ready(rows)
        start = time.perf_counter()
        jax.block_until_ready(run(buffers, rows))
        if i >= 3:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    moved = n * (DIM + (1 if with_state else 0)) * 4
    return {"op": "gather", "rows": n, "sorted": ordered, "with_state": with_state, "ms": seconds * 1e3,
            "gb_per_s": moved / seconds / 1e9}


def write_back_rate(host, n: int, rng) -> tuple[dict, list]:
    """The host placement's write-back of ``n`` sorted random distinct rows, weights and state."""
    total = host[1].size
    scratch = [jnp.ones((b.size // total * n,), b.dtype) for b in host]
    run = jax.jit(lambda b, rows, s: _scatter(b, rows, s, n, total), donate_argnums=0)
    times = []
    for i in range(23):
        rows = jnp.asarray(np.sort(rng.choice(total, size=n, replace=False)).astype(np.int32))
        jax.block_until_ready(rows)
        start = time.perf_counter()
        host = run(host, rows, scratch)
        jax.block_until_ready(host)
        if i >= 3:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    moved = n * (DIM + 1) * 4
    return {"op": "write_back", "rows": n, "sorted": True, "with_state": True, "ms": seconds * 1e3,
            "gb_per_s": moved / seconds / 1e9}, host


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--rows", type=int, default=8_000_000, help="rows of the host table")
    p.add_argument("--cache-rows", type=int, default=1 << 20)
    args = p.parse_args(argv)
    device = jax.devices()[0]
    on_device = jax.sharding.SingleDeviceSharding(device)
    in_host = on_device.with_memory_kind("pinned_host")
    result = environment("host_cache_gpu", device.device_kind, {}, {})
    rng = np.random.default_rng(0)
    block = rng.standard_normal((1 << 28,), dtype=np.float32)  # 1 GiB
    host_block = jax.device_put(block, in_host)
    device_block = jax.device_put(block, on_device)
    result["copy_gb_per_s"] = {"host_to_device": copy_rate(host_block, on_device),
                               "device_to_host": copy_rate(device_block, in_host)}
    del host_block, device_block
    host = [to_host_memory(jax.random.normal(jax.random.key(0), (args.rows * DIM,), jnp.float32)),
            to_host_memory(jnp.zeros((args.rows,), jnp.float32))]
    cache = [jnp.zeros((args.cache_rows * DIM,), jnp.float32), jnp.zeros((args.cache_rows,), jnp.float32)]
    result.update(host_rows=args.rows, cache_rows=args.cache_rows, dim=DIM, runs=[], host_placement=[])
    for n in (65_536, 524_288):
        runs = [gather_rate(host, n, rng, ordered=o, with_state=w) for o, w in ((True, False), (True, True),
                                                                              (False, False))]
        back, host = write_back_rate(host, n, rng)
        for run in (*runs, back):
            ceiling = result["copy_gb_per_s"]["host_to_device" if run["op"] == "gather" else "device_to_host"]
            run["of_copy"] = run["gb_per_s"] / ceiling
            result["host_placement"].append(run)
            print(run, file=sys.stderr, flush=True)
    for n in (16_384, 131_072, 524_288):
        for evict in (False, True):
            run, cache, host = exchange_rate(cache, host, n, evict, rng)
            ceiling = result["copy_gb_per_s"]["host_to_device"]
            run["of_host_to_device_copy"] = run["gb_per_s"] / ceiling
            result["runs"].append(run)
            print(run, file=sys.stderr, flush=True)
    if args.out:
        write_json(args.out, result)
    print(result["copy_gb_per_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
