"""DLRM training throughput on one GPU: jaxrec's fused tables vs plain-JAX embeddings.

    python benchmarks/dlrm_gpu.py --out benchmarks/results/dlrm_gpu_<device>.json [--quick]

The model is MLPerf's DLRM shape: 26 tables of the Criteo Kaggle cardinalities, D=128,
bottom MLP 512-256-128, top MLP 1024-1024-512-256-1, batch 65536, one id per bag
(Criteo is one-hot); ids are the synthetic click log's (Zipf over each table). Variants,
each timed in this one process with the same dense part and dense optimizer (Adam):

- jaxrec, fused:  EmbeddingBagCollection(optimizer=RowWiseAdagrad | Adagrad) trained by
                  jaxrec.nn.make_train_step (tables updated in place in the backward),
                  with its default on_nonfinite="raise" and, as "..._unguarded", with
                  "ignore" (no finiteness checks): what the step guard costs;
- jaxrec DLRM_DCN (3 cross layers, rank 512), fused rowwise Adagrad;
- jaxrec, fused, dynamic: every table a dynamic vocabulary (``DynamicVocab()``, LRU, its
                  rows rounded up to a multiple of 128) fed the same ids, which its hash
                  index maps to slots in the step (docs/dynamic_vocab.md);
- jaxrec, fused, host-cached: every table of at least 1M rows (5 tables, 97% of the rows)
                  in host memory with an LRU cache of 10% of its rows on the device
                  (``placement="host_cached"``, docs/host_memory.md); its run reports the
                  cache's hit rate over the timed steps (give it fresh batches:
                  ``--batches 64``). A smaller table's 10% holds fewer rows than a batch of
                  65536 looks up in it, which the cache refuses. As ``..._prefetch``, each
                  step also prefetches the next batch's rows (``train_step(...,
                  prefetch=next_batch.sparse)``), copied in the background;
- jaxrec, fused, host: the same tables in host memory with no cache
                  (``placement="host"``): each step reads its distinct rows over PCIe and
                  writes them back;
- plain JAX:      26 nnx.Embed-style tables (a gather per feature), optax.adagrad / sgd
                  over every parameter: the dense gradient of each table (XLA may turn
                  SGD's scatter into zeros + add into a scatter into the table);
- the two halves of the fused step: embeddings_only (the collection under a fixed random
  cotangent: lookup, fused backward and update) and dense_only (the MLPs and the
  interaction on constant pooled embeddings).

``--shape mlperf``: MLPerf Training's DLRM-DCNv2 (Criteo 1TB multi-hot): the 26 tables
capped at 40M rows (204M rows, 52 GB in bfloat16; float32's 104 GB does not fit one GPU),
MLPerf's multi-hot sizes (214 ids a sample, SUM pooling), ids log-uniform over each table
(P(id) ~ 1/(id+1)), DCNv2 (3 cross layers, rank 512), bfloat16 tables with fused rowwise
Adagrad; variants: the whole step and its two halves, with float32 MLPs and, as
``..._bf16_dense``, with the MLPs, interaction and cross net in bfloat16 (``dtype=``).

``--devices N``: the whole fused model with its tables sharded over N GPUs by the planner
(built sharded: each table goes to the host once drawn, so no GPU holds them all), the
dense part data parallel, ``--batch-size`` per GPU.

A step's time is the median of 3 repeats of ``iters`` back-to-back steps (the host
waits once per repeat) over ``--batches`` (4) pre-generated batches already on the
device; samples/s = batch / step time. Data loading is not part of it.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxrec.parallel as par
from jaxrec.benchmark._environment import environment
from jaxrec.benchmark._report import write_json
from jaxrec.data import CRITEO_KAGGLE_CARDINALITIES, Batch, SyntheticClickLog
from jaxrec.models import DLRM, DLRM_DCN
from jaxrec.nn import DynamicVocab, EmbeddingBagCollection, EmbeddingBagConfig, make_train_step
from jaxrec.optim import Adagrad, RowWiseAdagrad
from jaxrec.sparse import KeyedJaggedTensor, KeyedTensor

DIM, BOTTOM, TOP = 128, [512, 256, 128], [1024, 1024, 512, 256, 1]
# MLPerf Training DLRM-DCNv2: Criteo 1TB's cardinalities capped at 40M rows, and ids per sample.
MLPERF_ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
               2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
MLPERF_MULTI_HOT = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
MLPERF_GLOBAL_BATCH, MLPERF_GPUS = 55296, 8  # HugeCTR's MLPerf Training submissions on 8 GPUs


class EmbedArch(nnx.Module):
    """The plain-JAX peer of an EmbeddingBagCollection with one id per bag: one ``nnx.Embed``
    per feature, a gather each."""

    def __init__(self, keys, sizes, dim, *, rngs):
        self.keys = tuple(keys)
        self.embeds = nnx.List([nnx.Embed(n, dim, rngs=rngs) for n in sizes])
        self.feature_names = self.keys
        self.dim = dim

    def embedding_bag_configs(self):
        return FixedSparse.embedding_bag_configs(self)

    def __call__(self, kjt):
        b = kjt.stride()
        ids = kjt.values()[: b * len(self.keys)].reshape(len(self.keys), b)  # one id per bag
        rows = [e(ids[k]) for k, e in enumerate(self.embeds)]
        return KeyedTensor(list(self.keys), [self.dim] * len(self.keys), jnp.concatenate(rows, 1))


class FixedSparse(nnx.Module):
    """Pooled embeddings that are a constant: DLRM's dense part alone ("dense_only")."""

    def __init__(self, keys, pooled):
        self.feature_names = tuple(keys)
        self.pooled = nnx.Variable(pooled)  # not a Param: never trained, carried through
        self.dim = pooled.shape[1] // len(keys)

    def embedding_bag_configs(self):
        return [EmbeddingBagConfig(name=k, num_embeddings=1, embedding_dim=self.dim,
                                   feature_names=[k]) for k in self.feature_names]

    def __call__(self, kjt):
        return KeyedTensor(list(self.feature_names), [self.dim] * len(self.feature_names),
                           self.pooled[...])


class SparseOnly(nnx.Module):
    """The collection alone, under a fixed random cotangent ("embeddings_only"): the lookup
    and the fused backward + update, without the MLPs."""

    def __init__(self, ebc, cotangent):
        self.ebc = ebc
        self.cotangent = nnx.Variable(cotangent)

    def __call__(self, dense, kjt):
        return jnp.sum(self.ebc(kjt).values() * self.cotangent[...], axis=1, keepdims=True)


def bce(model, batch):
    logits = model(batch.dense, batch.sparse)[:, 0]
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, batch.labels))


def mlperf_batches(keys, sizes, batch_size, count, seed=0):
    """``count`` host batches of MLPerf's multi-hot shape, ids log-uniform over each table."""
    rng = np.random.default_rng(seed)
    hots = MLPERF_MULTI_HOT
    lengths = np.repeat(np.asarray(hots, np.int32), batch_size)
    out = []
    for _ in range(count):
        values = np.concatenate([
            np.minimum(np.exp(rng.random(h * batch_size) * np.log(n)).astype(np.int64) - 1, n - 1)
            for n, h in zip(sizes, hots)]).astype(np.int32)
        sparse = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)
        dense = rng.standard_normal((batch_size, 13)).astype(np.float32)
        labels = (rng.random(batch_size) < 0.25).astype(np.float32)
        out.append(Batch(dense, sparse, labels, np.ones(batch_size, np.float32)))
    return out


def build_sharded(variant, keys, sizes, dtype, mesh, dense_dtype=None):
    """The model with its tables sharded over ``mesh`` by the planner, built sharded (no
    device ever holds all the tables). The planner gets no constraints, so it takes every
    bag for one id: what the committed 2-GPU run measured (docs/nn.md)."""
    if variant not in ("fused_rowwise_adagrad", "dcn_fused_rowwise_adagrad"):
        raise ValueError(f"--devices > 1 times the whole fused model only, not {variant!r}")
    config = RowWiseAdagrad(learning_rate=0.01)
    tables = [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=n, embedding_dim=DIM, feature_names=[k],
                                 dtype=dtype) for k, n in zip(keys, sizes)]
    plan = par.EmbeddingShardingPlanner(par.Topology(world_size=mesh.devices.size), optimizer=config).plan(tables)
    ebc = par.ShardedEmbeddingBagCollection(tables, plan, mesh, optimizer=config, rngs=nnx.Rngs(0))
    rngs = nnx.Rngs(1)
    model = (DLRM_DCN(ebc, 13, BOTTOM, TOP, dcn_num_layers=3, dcn_low_rank_dim=512, dtype=dense_dtype, rngs=rngs)
             if "dcn" in variant else DLRM(ebc, 13, BOTTOM, TOP, dtype=dense_dtype, rngs=rngs))
    model = par.shard(model, plan, mesh)  # the dense part replicated
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def build(variant, keys, sizes, batch_size, dtype="float32", dense_dtype=None):
    rngs = nnx.Rngs(0)
    if variant.startswith("plain"):
        sparse = EmbedArch(keys, sizes, DIM, rngs=rngs)
    else:
        config = Adagrad(learning_rate=0.01) if "exact_adagrad" in variant else RowWiseAdagrad(
            learning_rate=0.01)
        if variant.endswith((HOST_CACHED, HOST)):
            placed = CACHED if variant.endswith(HOST_CACHED) else {"placement": "host"}
            tables = [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=n, embedding_dim=DIM, feature_names=[k],
                                         dtype=dtype, **(placed if n >= LARGE else {}))
                      for k, n in zip(keys, sizes)]
        elif variant.endswith(DYNAMIC):
            tables = [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=-(-n // 128) * 128, embedding_dim=DIM,
                                         feature_names=[k], dtype=dtype, dynamic=DynamicVocab())
                      for k, n in zip(keys, sizes)]
        else:
            tables = [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=n, embedding_dim=DIM,
                                         feature_names=[k], dtype=dtype) for k, n in zip(keys, sizes)]
        sparse = EmbeddingBagCollection(tables, optimizer=config, rngs=rngs)
    if variant == "embeddings_only":
        cotangent = jax.random.normal(jax.random.key(1), (batch_size, DIM * len(keys))) * 1e-3
        model = SparseOnly(sparse, cotangent)
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    if variant.endswith("dense_only"):
        del sparse
        gc.collect()
        pooled = jax.random.normal(jax.random.key(1), (batch_size, DIM * len(keys))) * 0.1
        sparse = FixedSparse(keys, pooled)
    if "dcn" in variant:
        model = DLRM_DCN(sparse, 13, BOTTOM, TOP, dcn_num_layers=3, dcn_low_rank_dim=512, dtype=dense_dtype,
                         rngs=rngs)
    else:
        model = DLRM(sparse, 13, BOTTOM, TOP, dtype=dense_dtype, rngs=rngs)
    if variant == "plain_sgd":
        tx = optax.multi_transform({"tables": optax.sgd(0.01), "dense": optax.adam(1e-3)},
                                   _labels(model))
    elif variant == "plain_adagrad":
        tx = optax.multi_transform({"tables": optax.adagrad(0.01), "dense": optax.adam(1e-3)},
                                   _labels(model))
    else:
        tx = optax.adam(1e-3)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def _labels(model):
    state = nnx.state(model, nnx.Param)
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "tables" if "embeds" in jax.tree_util.keystr(path) else "dense", state)


UNGUARDED = "_unguarded"  # the same step with on_nonfinite="ignore": what the guard costs
BF16_DENSE = "_bf16_dense"  # the MLPs, interaction and cross net computed in bfloat16 (dtype=)
DYNAMIC = "_dynamic"  # every table a dynamic vocabulary
HOST_CACHED = "_host_cached"  # every large table in host memory, a 10% cache on the device
HOST = "_host"  # every large table in host memory, no cache
PREFETCH = "_prefetch"  # host-cached, each step prefetching the next batch's rows
LARGE, CACHED = 1_000_000, {"placement": "host_cached", "cache_load_factor": 0.1}


def time_variant(variant, keys, sizes, batches, iters, dtype, mesh=None, ids_per_bag=None):
    guarded = not variant.endswith(UNGUARDED)
    base = variant.removesuffix(UNGUARDED)
    prefetch = base.endswith(PREFETCH)
    base = base.removesuffix(PREFETCH)
    dense_dtype = jnp.bfloat16 if base.endswith(BF16_DENSE) else None
    base = base.removesuffix(BF16_DENSE)
    if mesh is None:
        model, optimizer = build(base, keys, sizes, batches[0].batch_size, dtype, dense_dtype)
    else:
        model, optimizer = build_sharded(base, keys, sizes, dtype, mesh, dense_dtype)
    train_step = make_train_step(bce, on_nonfinite="raise" if guarded else "ignore")

    def step(model, optimizer, i):  # batch i, prefetching batch i + 1
        upcoming = {"prefetch": batches[(i + 1) % len(batches)].sparse} if prefetch else {}
        return train_step(model, optimizer, batches[i % len(batches)], **upcoming)

    start = time.perf_counter()
    jax.block_until_ready(step(model, optimizer, 0))
    compile_s = time.perf_counter() - start
    for i in range(3):
        jax.block_until_ready(step(model, optimizer, i))
    cached = base.endswith(HOST_CACHED)
    before = _cache_counts(model) if cached else None
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for i in range(iters):
            loss = step(model, optimizer, i)
        float(loss)
        train_step.check()
        times.append((time.perf_counter() - start) / iters)
    step_s = statistics.median(times)
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))  # fused slots included
    optax_bytes = sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(optimizer.opt_state))
    placement = {}
    if base.endswith(DYNAMIC):  # what the indices did over the run, summed over the tables
        stats = model.sparse_arch.dynamic_statistics().values()
        placement["dynamic"] = {k: int(sum(int(s[k]) for s in stats))
                                for k in ("size", "inserted", "evicted", "failed_inserts")}
    if cached:  # the timed steps' misses against the distinct rows they looked up
        after = _cache_counts(model)
        stats = model.sparse_arch.cache_statistics()
        looked_up = sum(_distinct_rows(batches[i % len(batches)], stats) for _ in range(3) for i in range(iters))
        misses = after["inserted"] - before["inserted"]
        placement["host_cached"] = {
            "tables": sorted(stats),
            "cache_rows": sum(t.cache_size() for t in model.sparse_arch.table_configs if t.name in stats),
            "host_rows": int(sum(n for k, n in zip(keys, sizes) if f"t_{k}" in stats)),
            "distinct_rows_per_step": looked_up / (3 * iters), "misses_per_step": misses / (3 * iters),
            "evictions_per_step": (after["evicted"] - before["evicted"]) / (3 * iters),
            "hit_rate": 1 - misses / looked_up}
    if mesh is not None:  # where the planner put each table, and each device's ids per sample
        plan = next(m for _, m in nnx.iter_modules(model) if isinstance(m, par.ShardedEmbeddingBagCollection)).plan
        placement["plan"] = {name: [ps.sharding_type.value, [s.device for s in ps.shards]]
                             for name, ps in plan.shardings}
        rows, hots = ({f"t_{k}": x for k, x in zip(keys, xs)} for xs in (sizes, ids_per_bag))
        per_device = [0.0] * mesh.devices.size
        for name, ps in plan.shardings:
            for s in ps.shards:  # a row-wise table's ids spread as its rows (uniform ids)
                per_device[s.device] += hots[name] * s.num_rows / rows[name]
        placement["ids_per_sample_per_device"] = per_device
    del model, optimizer, step
    gc.collect()
    samples = batches[0].labels.size  # the global batch (a sharded one is [devices, per device])
    return {"variant": variant, "step_ms": step_s * 1e3, "samples_per_s": samples / step_s,
            "compile_s": compile_s, "final_loss": float(loss), "model_state_gb": model_bytes / 1e9, **placement,
            "optax_state_gb": optax_bytes / 1e9,
            "repeats_ms": [t * 1e3 for t in times]}


def _cache_counts(model) -> dict[str, int]:
    stats = model.sparse_arch.cache_statistics().values()
    return {k: sum(int(s[k]) for s in stats) for k in ("inserted", "evicted")}


def _distinct_rows(batch, tables) -> int:
    """Distinct ids of ``batch`` in the host-cached ``tables`` (one id per bag: feature k's
    ids are the k-th block of B values)."""
    values, size = np.asarray(batch.sparse.values()), batch.batch_size
    keys = batch.sparse.keys()
    return sum(np.unique(values[k * size:(k + 1) * size]).size for k, key in enumerate(keys) if f"t_{key}" in tables)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--quick", action="store_true", help="small tables and batch (a smoke test)")
    p.add_argument("--batch-size", type=int, default=65536)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--batches", type=int, default=4, help="distinct pre-generated batches, cycled")
    p.add_argument("--only", help="comma-separated variants")
    p.add_argument("--shape", choices=["kaggle", "mlperf"], default="kaggle",
                   help="kaggle: one-hot Criteo Kaggle tables in float32; mlperf: MLPerf DLRM-DCNv2's "
                        "multi-hot Criteo 1TB tables in bfloat16")
    p.add_argument("--devices", type=int, default=1,
                   help="shard the tables over this many GPUs (the planner's plan); --batch-size is "
                        "then per GPU")
    args = p.parse_args(argv)
    mesh = None
    if args.devices > 1:
        mesh = jax.make_mesh((args.devices,), ("data",), devices=jax.devices()[:args.devices])
    max_rows = 10_000 if args.quick else None
    batch_size = 1024 if args.quick else args.batch_size
    log = SyntheticClickLog(num_embeddings_per_feature=CRITEO_KAGGLE_CARDINALITIES, max_rows=max_rows,
                            seed=0)
    start = time.perf_counter()
    if args.shape == "mlperf":
        keys, dtype = log.keys, "bfloat16"
        sizes = [min(n, max_rows or n) for n in MLPERF_ROWS]
        batches = mlperf_batches(keys, sizes, batch_size * args.devices, 4)
        variants = ["dcn_fused_rowwise_adagrad", "dcn_fused_rowwise_adagrad" + BF16_DENSE, "embeddings_only",
                    "dcn_dense_only", "dcn_dense_only" + BF16_DENSE]
    else:
        keys, sizes, dtype = log.keys, log.table_sizes, "float32"
        batches = list(log.batches(batch_size * args.devices, args.batches))
        variants = ["fused_rowwise_adagrad", "fused_rowwise_adagrad" + UNGUARDED,
                    "fused_rowwise_adagrad" + DYNAMIC, "fused_exact_adagrad",
                    "dcn_fused_rowwise_adagrad", "plain_sgd", "plain_adagrad", "embeddings_only", "dense_only"]
    if mesh is None:
        batches = [jax.device_put(b) for b in batches]
    else:
        batches = [par.shard_batch(b, mesh) for b in batches]
        variants = [v for v in variants if v.removesuffix(BF16_DENSE) in ("fused_rowwise_adagrad",
                                                                           "dcn_fused_rowwise_adagrad")]
    data_s = time.perf_counter() - start
    if args.only:
        variants = args.only.split(",")
    device = jax.devices()[0]
    result = environment("dlrm_gpu", device.device_kind, {}, {})
    result.update(shape=args.shape, devices=args.devices, batch_size_per_device=batch_size,
                  batch_size=batch_size * args.devices, embedding_dim=DIM, table_dtype=dtype,
                  bottom_mlp=BOTTOM, top_mlp=TOP, table_rows=list(sizes), total_rows=int(sum(sizes)),
                  batches=len(batches), synthetic_batch_generation_s=data_s / len(batches), runs=[])
    if args.shape == "mlperf":
        result.update(multi_hot_sizes=MLPERF_MULTI_HOT, ids_per_sample=sum(MLPERF_MULTI_HOT),
                      mlperf_batch_per_gpu=MLPERF_GLOBAL_BATCH // MLPERF_GPUS)
    for variant in variants:
        try:
            run = time_variant(variant, keys, sizes, batches, args.iters, dtype, mesh,
                               MLPERF_MULTI_HOT if args.shape == "mlperf" else [1] * len(keys))
        except Exception as e:  # e.g. the plain peers running out of memory: record it
            run = {"variant": variant, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            gc.collect()
        result["runs"].append(run)
        print(run, file=sys.stderr, flush=True)
    base = {r["variant"]: r for r in result["runs"] if "step_ms" in r}
    ours = base.get("fused_rowwise_adagrad" if args.shape == "kaggle" else "dcn_fused_rowwise_adagrad")
    if ours:
        result["speedup_vs"] = {v: r["step_ms"] / ours["step_ms"] for v, r in base.items()}
    if args.out:
        write_json(args.out, result)
    for r in result["runs"]:
        line = (f"{r['step_ms']:8.2f} ms  {r['samples_per_s'] / 1e6:6.2f} M samples/s"
                if "step_ms" in r else r["error"])
        print(f"{r['variant']:28s} {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
