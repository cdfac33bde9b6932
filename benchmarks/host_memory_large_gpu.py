"""A DLRM whose tables exceed the GPU's memory, trained on one GPU with host-cached tables.

    python benchmarks/host_memory_large_gpu.py --out benchmarks/results/host_memory_large_<device>.json

The model is benchmarks/dlrm_gpu.py's DLRM (D=128, bottom MLP 512-256-128, top MLP
1024-1024-512-256-1, fused rowwise Adagrad, Adam on the MLPs, batch 65536, one id per
bag) with the 21 Criteo Kaggle tables of fewer than 1M rows on the device and ``--big``
(8) tables of ``--big-rows`` rows each in host memory, host-cached (``placement=
"host_cached"``, ``--cache-load-factor`` 0.02 of their rows in device memory) or
host-placed (``--placement host``). By default the big tables hold ``--times`` (1.2)
times the device's memory (``--device-gib``, 80) in float32 weights, their optimizer
state besides. Ids are the synthetic click log's: Zipf (exponent 1.1) over each table,
hot ids scattered over the rows.

XLA hands out 64 GiB of host memory on the GPU unless ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``
says more: run it with ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=112`` (the collection refuses
tables over the cap, naming the variable).

Reported: the build time, the step time and samples/s (the median of 3 repeats of
``--iters`` steps over ``--batches`` pre-generated batches), the hit rate of the caches,
the device's peak memory in use and the host's resident memory.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx

from jaxrec.benchmark._environment import environment
from jaxrec.benchmark._report import write_json
from jaxrec.data import CRITEO_KAGGLE_CARDINALITIES, SyntheticClickLog
from jaxrec.models import DLRM
from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig, make_train_step
from jaxrec.optim import RowWiseAdagrad

DIM, BOTTOM, TOP = 128, [512, 256, 128], [1024, 1024, 512, 256, 1]
SMALL = 1_000_000  # Kaggle tables below this stay on the device


def bce(model, batch):
    logits = model(batch.dense, batch.sparse)[:, 0]
    return optax.sigmoid_binary_cross_entropy(logits, batch.labels).mean()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--big", type=int, default=8, help="tables in host memory")
    p.add_argument("--big-rows", type=int, help="rows of each (default: --times the device's memory in all)")
    p.add_argument("--times", type=float, default=1.2)
    p.add_argument("--device-gib", type=float, default=80.0, help="the device's memory (H100: 80 GiB)")
    p.add_argument("--placement", choices=["host_cached", "host"], default="host_cached")
    p.add_argument("--cache-load-factor", type=float, default=0.02)
    p.add_argument("--batch-size", type=int, default=65536)
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    big_rows = args.big_rows or int(args.times * args.device_gib * 2**30 / (args.big * DIM * 4)) + 1
    small = [n for n in CRITEO_KAGGLE_CARDINALITIES if n < SMALL]
    sizes = [big_rows] * args.big + small
    log = SyntheticClickLog(num_embeddings_per_feature=sizes, scatter_ids=True, seed=0)
    placed = {"placement": args.placement}
    if args.placement == "host_cached":
        placed["cache_load_factor"] = args.cache_load_factor
    tables = [EmbeddingBagConfig(name=f"t_{key}", num_embeddings=n, embedding_dim=DIM, feature_names=[key],
                                 **(placed if k < args.big else {}))
              for k, (key, n) in enumerate(zip(log.keys, sizes))]
    device = jax.devices()[0]
    result = environment("host_memory_large_gpu", device.device_kind, {}, {})
    host_bytes = args.big * big_rows * DIM * 4
    result.update(placement=args.placement, big_tables=args.big, big_rows=big_rows, small_tables=len(small),
                  host_table_bytes=host_bytes, device_gib=args.device_gib,
                  host_tables_over_device_memory=host_bytes / (args.device_gib * 2**30),
                  cache_load_factor=args.cache_load_factor if args.placement == "host_cached" else None,
                  batch_size=args.batch_size)
    print(f"{args.big} tables of {big_rows} rows: {host_bytes / 2**30:.1f} GiB in host memory "
          f"({result['host_tables_over_device_memory']:.2f}x the device's {args.device_gib} GiB)", flush=True)
    start = time.perf_counter()
    ebc = EmbeddingBagCollection(tables, optimizer=RowWiseAdagrad(learning_rate=0.01), rngs=nnx.Rngs(0))
    model = DLRM(ebc, 13, BOTTOM, TOP, rngs=nnx.Rngs(1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    result["build_s"] = time.perf_counter() - start
    print(f"built in {result['build_s']:.0f} s", flush=True)
    start = time.perf_counter()
    batches = [jax.device_put(b) for b in log.batches(args.batch_size, args.batches)]
    result["batch_generation_s"] = time.perf_counter() - start
    step = make_train_step(bce)
    start = time.perf_counter()
    jax.block_until_ready(step(model, optimizer, batches[0]))
    result["compile_s"] = time.perf_counter() - start
    for i in range(3):
        jax.block_until_ready(step(model, optimizer, batches[i % len(batches)]))
    counts = _counts(ebc) if args.placement == "host_cached" else None
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for i in range(args.iters):
            loss = step(model, optimizer, batches[i % len(batches)])
        float(loss)
        step.check()
        times.append((time.perf_counter() - start) / args.iters)
    step_s = statistics.median(times)
    result.update(step_ms=step_s * 1e3, samples_per_s=args.batch_size / step_s, final_loss=float(loss),
                  repeats_ms=[t * 1e3 for t in times])
    if counts is not None:
        after = _counts(ebc)
        distinct = sum(_distinct(batches[i % len(batches)], args.big) for _ in range(3) for i in range(args.iters))
        misses = after["inserted"] - counts["inserted"]
        result["host_cached"] = {"cache_rows": sum(t.cache_size() for t in tables[:args.big]),
                                 "distinct_rows_per_step": distinct / (3 * args.iters),
                                 "misses_per_step": misses / (3 * args.iters),
                                 "evictions_per_step": (after["evicted"] - counts["evicted"]) / (3 * args.iters),
                                 "hit_rate": 1 - misses / distinct}
    stats = device.memory_stats() or {}
    result["device_peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    result["device_bytes_limit"] = stats.get("bytes_limit")
    result["host_max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if args.out:
        write_json(args.out, result)
    print({k: v for k, v in result.items() if k not in ("environment",)}, flush=True)
    return 0


def _counts(ebc) -> dict[str, int]:
    stats = ebc.cache_statistics().values()
    return {k: sum(int(s[k]) for s in stats) for k in ("inserted", "evicted")}


def _distinct(batch, big: int) -> int:
    """Distinct ids of the big tables in ``batch`` (one id a bag: feature k's ids are the
    k-th block of B values)."""
    values, size = np.asarray(batch.sparse.values()), batch.batch_size
    return sum(np.unique(values[k * size:(k + 1) * size]).size for k in range(big))


if __name__ == "__main__":
    sys.exit(main())
