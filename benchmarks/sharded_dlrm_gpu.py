"""Sharded embeddings on several GPUs: equality with the unsharded module, and weak scaling.

    python benchmarks/sharded_dlrm_gpu.py --out benchmarks/results/sharded_dlrm_<device>.json
    python benchmarks/sharded_dlrm_gpu.py --tiny --out /tmp/tiny.json     # CPU, 8 virtual devices

1. **Equality** on all visible devices: for every sharding type (and all of them in one
   plan), small tables (SUM and MEAN, a shared table, weighted ids, empty bags, a device
   without ids), the sharded collection's forward and three fused training steps (Adam;
   rowwise Adagrad on a plan without COLUMN_WISE; plain tables with optax.adagrad) equal
   the unsharded module on one device within float32 tolerance. The script exits with
   status 1 after writing the JSON if any case differs.
2. **Weak scaling** of a DLRM train step (jaxrec.models.DLRM, 26 Criteo Kaggle tables,
   D=128, MLPs 512-256-128 / 1024-1024-512-256-1, fused rowwise Adagrad, dense Adam, one
   Zipf id per bag): the batch per GPU is fixed, the tables are TABLE_WISE (placed by the
   planner) or ROW_WISE, on sub-meshes of 1, 2, 4 and 8 of the visible devices, each with
   float32 and with bfloat16 comms of the pooled embeddings (``--comm-dtypes``), and with
   and without ``max_ids_per_bag=1`` (``--max-ids-per-bag``: one-hot features, whose
   groups then receive the distinct rows of their bags, next to the same setting without
   that, ``+no_row_return``). Reported:
   step time, samples/s, and efficiency = t(1) / t(n) (t(1): the same sharded step on one
   device; ``vs_unsharded``: jaxrec.nn's unsharded step on one device instead).

A step's time: for each sharding type, the models of every size (and the unsharded one)
live at once, and ``jaxrec.benchmark._measure.interleaved_timed`` runs ``--iters``
back-to-back steps of each case in turn, for 7 rounds in rotated order; the median over
the rounds. One model per size serves
every comms dtype and bound (they are the collection's static attributes; each setting
compiles once). ``host_ms`` is the host's time to issue a step: when it nears
``step_ms`` the step is bound by the host, not the GPUs. The tables are initialised
once (as the unsharded module would) and loaded into each sharded model through the
host (jaxrec.parallel's portable form).
"""

from __future__ import annotations

import os
import sys

if "--tiny" in sys.argv:  # before JAX starts: 8 virtual CPU devices
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import functools
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxrec.parallel as par
from jaxrec.benchmark._environment import environment, nvidia_driver
from jaxrec.benchmark._measure import interleaved_timed
from jaxrec.benchmark._report import write_json
from jaxrec.data import CRITEO_KAGGLE_CARDINALITIES, Batch, SyntheticClickLog
from jaxrec.models import DLRM
from jaxrec.nn import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    make_train_step,
)
from jaxrec.optim import Adam, RowWiseAdagrad
from jaxrec.sparse import KeyedJaggedTensor

FULL = {"dim": 128, "bottom": [512, 256, 128], "top": [1024, 1024, 512, 256, 1],
        "batch": 16384, "max_rows": None, "iters": 20, "rounds": 7}
TINY = {"dim": 16, "bottom": [32, 16], "top": [32, 16, 1], "batch": 64, "max_rows": 1000,
        "iters": 3, "rounds": 2}


# --- 1. equality ------------------------------------------------------------------------

EQ_TABLES = [
    EmbeddingBagConfig(name="t_user", num_embeddings=37, embedding_dim=8, feature_names=["user"]),
    EmbeddingBagConfig(name="t_item", num_embeddings=23, embedding_dim=8,
                       feature_names=["item", "last_item"], pooling="MEAN"),
    EmbeddingBagConfig(name="t_geo", num_embeddings=11, embedding_dim=4, feature_names=["geo"]),
    EmbeddingBagConfig(name="t_x", num_embeddings=50, embedding_dim=8, feature_names=["x"],
                       pooling="MEAN"),
    EmbeddingBagConfig(name="t_tiny", num_embeddings=3, embedding_dim=8, feature_names=["tiny"]),
]
EQ_KEYS = ["geo", "x", "item", "tiny", "user", "last_item"]
EQ_ROWS = {"user": 37, "item": 23, "last_item": 23, "geo": 11, "x": 50, "tiny": 3}
EQ_B, EQ_STEPS, RTOL, ATOL = 3, 3, 2e-5, 1e-6


def equality_plans(n: int) -> dict:
    local = max(1, n // 2)
    two = lambda i: [i % n, (i + 1) % n] if n > 1 else [0]
    return {
        "table_wise": {t.name: par.table_wise(i * 3 % n) for i, t in enumerate(EQ_TABLES)},
        "row_wise": {t.name: par.row_wise() for t in EQ_TABLES},
        "column_wise": {t.name: par.column_wise(two(i)) for i, t in enumerate(EQ_TABLES)},
        "table_row_wise": {t.name: par.table_row_wise(i % (n // local))
                           for i, t in enumerate(EQ_TABLES)},
        "data_parallel": {t.name: par.data_parallel() for t in EQ_TABLES},
        "mixed": {"t_user": par.table_wise(n - 1), "t_item": par.row_wise(),
                  "t_geo": par.column_wise(two(0)), "t_x": par.table_row_wise(n // local - 1),
                  "t_tiny": par.data_parallel()},
        "rows": {"t_user": par.table_wise(n - 1), "t_item": par.row_wise(),
                 "t_geo": par.table_wise(0), "t_x": par.table_row_wise(0),
                 "t_tiny": par.data_parallel()},
    }, local


def equality_batch(seed: int, n: int, one_hot: bool = False) -> Batch:
    """Bags of 0..3 ids from a table's first 6 rows (duplicates), or with ``one_hot`` of 0..1
    id from all its rows."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 2 if one_hot else 4, size=(len(EQ_KEYS), n * EQ_B))
    lengths[:, (seed % n) * EQ_B:(seed % n + 1) * EQ_B] = 0  # one device without ids
    values = np.concatenate([rng.integers(0, EQ_ROWS[k] if one_hot else min(6, EQ_ROWS[k]),
                                          lengths[i].sum())
                             for i, k in enumerate(EQ_KEYS)])
    weights = rng.uniform(0.5, 2.0, values.shape[0]).astype(np.float32)
    kjt = KeyedJaggedTensor.from_lengths_sync(EQ_KEYS, values, lengths.ravel(), weights=weights)
    return Batch(jnp.asarray(rng.normal(size=(n * EQ_B, 2)), jnp.float32), kjt,
                 jnp.asarray(rng.normal(size=(n * EQ_B,)), jnp.float32),
                 jnp.ones((n * EQ_B,), jnp.float32))


class EqModel(nnx.Module):
    def __init__(self, ebc, *, rngs):
        self.sparse_arch = ebc
        self.head = nnx.Linear(44 + 2, 1, rngs=rngs)

    def __call__(self, dense, kjt):
        return self.head(jnp.concatenate([self.sparse_arch(kjt).values(), dense], 1))[:, 0]


def equality(devices) -> list[dict]:
    n = len(devices)
    mesh = jax.sharding.Mesh(np.asarray(devices), ("data",))
    plans, local = equality_plans(n)
    # (plan, optimizer, max_ids_per_bag): bags have up to 3 ids; with the bound 1, one-hot
    # bags whose distinct rows come back to the devices that asked (shard_batch(model=))
    cases = ([(kind, "adam", None) for kind in plans if kind != "rows"]
             + [("rows", "rowwise_adagrad", None), ("mixed", "plain", None),
                ("mixed", "adam", 3), ("rows", "rowwise_adagrad", 3),
                ("row_wise", "adam", 1), ("rows", "rowwise_adagrad", 1)])
    reference_steps = {}
    results = []
    for kind, opt_name, bound in cases:
        optimizer = {"adam": Adam(learning_rate=0.05), "rowwise_adagrad":
                     RowWiseAdagrad(learning_rate=0.1), "plain": None}[opt_name]
        tx = optax.adagrad(0.1) if optimizer is None else optax.adam(1e-2)

        def build(optimizer=optimizer):
            return EqModel(EmbeddingBagCollection(EQ_TABLES, optimizer=optimizer,
                                                  rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))

        with jax.default_device(devices[0]):
            reference = build()
        plan = par.construct_plan(EQ_TABLES, plans[kind], n, local_world_size=local)
        model = par.shard(build(), plan, mesh, max_ids_per_bag=bound)
        ref_opt, opt = nnx.Optimizer(reference, tx, wrt=nnx.Param), nnx.Optimizer(model, tx, wrt=nnx.Param)
        ref_step = reference_steps.setdefault(opt_name, make_train_step(
            lambda m, b: jnp.sum((m(b.dense, b.sparse) - b.labels) ** 2) / (n * EQ_B)))
        step = make_train_step(lambda m, b: jnp.sum((m(b.dense, b.sparse) - b.labels) ** 2) / EQ_B)
        forward = par.make_forward(lambda m, kjt: m.sparse_arch(kjt).values())
        errors = {}
        one_hot = bound == 1
        sized = model if one_hot else None
        batch = equality_batch(0, n, one_hot)
        pooled = np.asarray(forward(model, par.shard_batch(batch.sparse, mesh, model=sized)))
        pooled = pooled.reshape(n * EQ_B, -1)
        with jax.default_device(devices[0]):
            errors["forward"] = _error(pooled, reference.sparse_arch(batch.sparse).values())
        losses = []
        for i in range(EQ_STEPS):
            batch = equality_batch(i, n, one_hot)
            losses.append((float(step(model, opt, par.shard_batch(batch, mesh, model=sized))),
                           float(ref_step(reference, ref_opt, batch))))
        errors["loss"] = max(_error(a, b) for a, b in losses)
        got = model.sparse_arch.split_embedding_weights()
        want = reference.sparse_arch.split_embedding_weights()
        errors["tables"] = max(_error(got[k], want[k]) for k in want)
        errors["dense"] = max(_error(a, b) for a, b in zip(jax.tree.leaves(nnx.state(model.head)),
                                                           jax.tree.leaves(nnx.state(reference.head))))
        ok = all(e <= 1.0 for e in errors.values())
        capacity = model.sparse_arch.row_return_capacity
        ok = ok and int(model.sparse_arch.dropped_ids.get_value()) == 0
        results.append({"plan": kind, "optimizer": opt_name, "max_ids_per_bag": bound,
                        "row_return_capacity": list(capacity), "devices": n, "ok": ok,
                        "error_over_tolerance": errors})
        print(f"equality {kind:15s} {opt_name:16s} {bound} {'ok' if ok else 'MISMATCH'} {errors}",
              file=sys.stderr, flush=True)
    return results


def _error(actual, expected) -> float:
    """max |a - e| / (ATOL + RTOL |e|): <= 1 passes ``assert_allclose(rtol, atol)``."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(a - e) / (ATOL + RTOL * np.abs(e)))) if a.size else 0.0


# --- 2. weak scaling --------------------------------------------------------------------

def bce(model, batch):
    logits = model(batch.dense, batch.sparse)[:, 0]
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, batch.labels))


def weak_scaling(devices, cfg: dict, sizes: list[int]) -> dict:
    # Hot ids scattered over the rows, as hashing spreads them in real logs (row-wise
    # shards would otherwise hold all hot rows on the first device).
    log = SyntheticClickLog(num_embeddings_per_feature=CRITEO_KAGGLE_CARDINALITIES,
                            max_rows=cfg["max_rows"], scatter_ids=True, seed=0)
    tables = [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=r, embedding_dim=cfg["dim"],
                                 feature_names=[k]) for k, r in zip(log.keys, log.table_sizes)]
    optimizer = RowWiseAdagrad(learning_rate=0.01)
    start = time.perf_counter()
    rngs = nnx.Rngs(0)  # the keys the unsharded collection draws, in its order
    with jax.default_device(devices[0]):
        initial = {t.name: {"weights": np.asarray(t.init(rngs.params()))} for t in tables}
    init_s = time.perf_counter() - start
    b = cfg["batch"]
    runs = []
    for kind in ("table_wise", "row_wise"):
        # Every size's model (and the unsharded one) at once, measured round-robin: a drift
        # of the machine's speed then touches every case alike.
        cases = []
        if kind == "table_wise":  # the unsharded baseline: jaxrec.nn on one device
            with jax.default_device(devices[0]):
                batches = [jax.device_put(x, devices[0]) for x in log.batches(b, 4)]
                ebc = EmbeddingBagCollection(tables, optimizer=optimizer, rngs=nnx.Rngs(0))
                model = DLRM(ebc, log.num_dense, cfg["bottom"], cfg["top"], rngs=nnx.Rngs(1))
                opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
            step = make_train_step(bce)
            cases.append(({"plan": "unsharded", "devices": 1},
                          functools.partial(step, model, opt), batches, 1, None))
        for n in sizes:
            mesh = jax.sharding.Mesh(np.asarray(devices[:n]), ("data",))
            constraints = {t.name: par.ParameterConstraints(sharding_types=[kind]) for t in tables}
            topology = par.Topology(world_size=n, batch_size=b)
            plan = par.EmbeddingShardingPlanner(topology, optimizer=optimizer,
                                                constraints=constraints).plan(tables)
            ebc = par.ShardedEmbeddingBagCollection(tables, plan, mesh, optimizer=optimizer,
                                                    initial=initial)
            model = par.shard(DLRM(ebc, log.num_dense, cfg["bottom"], cfg["top"],
                                   rngs=nnx.Rngs(1)), plan, mesh)
            # The row return's capacity, sized for these batches as one-hot (the bound 1)
            ebc.max_ids_per_bag = (1,) * len(ebc.feature_names)
            batches = [par.shard_batch(x, mesh, model=model) for x in log.batches(n * b, 4)]
            fitted = ebc.row_return_capacity
            opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
            step = make_train_step(bce)
            estimate = {"step_ms": max(plan.stats.perf) * 1e3, "memory_gb": plan.stats.memory / 1e9,
                        "imbalance": plan.stats.imbalance}
            for label, _, comm_dtype, bound, rows in variants(cfg["comm_dtypes"], cfg["bounds"],
                                                               [kind]):
                # One model per size; the settings are the collection's static attributes
                # (each setting compiles its own step once).
                # Set at every call: the cases share the model. Equal settings keep the
                # model's split (jaxrec.nn._split_cache); a new one splits it again.
                setting = {"comm_dtype": jnp.dtype(comm_dtype),
                           "max_ids_per_bag": (bound or 0,) * len(ebc.feature_names),
                           "row_return_capacity": fitted if rows else (0,) * len(fitted)}

                def call(batch, ebc=ebc, model=model, opt=opt, step=step, setting=setting):
                    for name, value in setting.items():
                        setattr(ebc, name, value)
                    return step(model, opt, batch)
                cases.append(({"plan": label, "devices": n, "global_batch": n * b,
                               "comm_dtype": comm_dtype, "max_ids_per_bag": bound,
                               "row_return_capacity": list(setting["row_return_capacity"]),
                               "planner_estimate": estimate}, call, batches, n, ebc))
        for run, call, batches, *_ in cases:
            start = time.perf_counter()
            jax.block_until_ready(call(batches[0]))
            run["compile_s"] = time.perf_counter() - start
            for i in range(3):
                jax.block_until_ready(call(batches[i % len(batches)]))
        step_s, host_s = interleaved_timed([(call, batches) for _, call, batches, *_ in cases],
                                           cfg["iters"], cfg["rounds"], jax.block_until_ready)
        for (run, _, _, n, ebc), seconds, host in zip(cases, step_s, host_s):
            run.update(step_ms=seconds * 1e3, host_ms=host * 1e3, samples_per_s=n * b / seconds,
                       samples_per_s_per_device=b / seconds)
            if ebc is not None:  # every batch was sized: no id may have been dropped
                run["dropped_ids"] = int(ebc.dropped_ids.get_value())
            runs.append(run)
            print(run, file=sys.stderr, flush=True)
        del cases, call, model, opt, ebc, batches
        gc.collect()

    base = {r["plan"]: r["step_ms"] for r in runs if r["devices"] == 1}
    unsharded = base.pop("unsharded")
    efficiency = {label: {str(r["devices"]): {"efficiency": base[label] / r["step_ms"],
                                              "vs_unsharded": unsharded / r["step_ms"]}
                          for r in runs if r["plan"] == label}
                  for label, *_ in variants(cfg["comm_dtypes"], cfg["bounds"])}
    return {"runs": runs, "efficiency": efficiency, "table_init_s": init_s,
            "table_rows": list(log.table_sizes), "total_rows": int(sum(log.table_sizes))}


def variants(comm_dtypes: list[str], bounds: list[int | None],
             kinds=("table_wise", "row_wise")):
    """(label, sharding type, comm dtype, max_ids_per_bag, row return): float32 comms and no
    bound are the plain label. With a bound the groups receive the distinct rows of their
    bags (what batches from ``shard_batch(model=)`` get); ``+no_row_return`` is the same
    setting with the pooled bags or partial sums on the wire instead, side by side."""
    out = []
    for bound in bounds:
        for dtype in comm_dtypes:
            for kind in kinds:
                label = (kind + ("" if dtype == "float32" else f"+{dtype}_comms")
                         + ("" if bound is None else f"+max_ids_{bound}"))
                rows = bound is not None
                out.append((label, kind, dtype, bound, rows))
                if rows:
                    out.append((label + "+no_row_return", kind, dtype, bound, False))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON result path")
    p.add_argument("--tiny", action="store_true", help="small tables and batch (CPU smoke run)")
    p.add_argument("--batch-size", type=int, help="samples per device (default 16384)")
    p.add_argument("--max-rows", type=int, help="cap on every table's rows")
    p.add_argument("--iters", type=int)
    p.add_argument("--max-devices", type=int, help="use at most this many devices")
    p.add_argument("--comm-dtypes", default="float32,bfloat16",
                   help="pooled-embedding comms dtypes to scale with (comm_dtype)")
    p.add_argument("--max-ids-per-bag", default="none,1",
                   help="max_ids_per_bag values to scale with ('none': no bound)")
    p.add_argument("--skip-equality", action="store_true")
    p.add_argument("--skip-scaling", action="store_true")
    args = p.parse_args(argv)
    cfg = dict(TINY if args.tiny else FULL, comm_dtypes=args.comm_dtypes.split(","),
               bounds=[None if b == "none" else int(b) for b in args.max_ids_per_bag.split(",")])
    for key, value in (("batch", args.batch_size), ("max_rows", args.max_rows),
                       ("iters", args.iters)):
        if value is not None:
            cfg[key] = value
    devices = jax.devices()[:args.max_devices] if args.max_devices else jax.devices()
    sizes = [n for n in (1, 2, 4, 8) if n <= len(devices)]
    result = environment("sharded_dlrm_gpu", devices[0].device_kind, {}, {})
    result.update(nvidia_driver=nvidia_driver(), platform=devices[0].platform,
                  xla_flags=os.environ.get("XLA_FLAGS", ""),
                  device_count=len(devices), config={**cfg, "sizes": sizes,
                                                     "optimizer": "fused rowwise Adagrad 0.01",
                                                     "dense_optimizer": "adam 1e-3"})
    ok = True
    if not args.skip_equality:
        result["equality"] = equality(devices)
        ok = all(r["ok"] for r in result["equality"])
    if not args.skip_scaling:
        result["weak_scaling"] = weak_scaling(devices, cfg, sizes)
    if args.out:
        write_json(args.out, result)
    for r in result.get("weak_scaling", {}).get("runs", []):
        eff = result["weak_scaling"]["efficiency"].get(r["plan"], {}).get(str(r["devices"]), {})
        print(f"{r['plan']:36s} {r['devices']} device(s)  {r['step_ms']:7.2f} ms  "
              f"(host {r['host_ms']:5.2f})  "
              f"{r['samples_per_s'] / 1e6:7.3f} M samples/s  efficiency "
              f"{eff.get('efficiency', 1.0):.2f}  vs unsharded {eff.get('vs_unsharded', 1.0):.2f}")
    print("equality:", "ok" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
