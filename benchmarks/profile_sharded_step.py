"""Where a sharded DLRM train step spends its GPU time: per-op kernel time from a trace.

    python benchmarks/profile_sharded_step.py --out $OUT/profile.json

Builds the weak-scaling benchmark's DLRM (``sharded_dlrm_gpu.py``: 26 Criteo tables,
D=128, fused rowwise Adagrad, one Zipf id per bag, hot ids scattered) for each case of
``--cases`` (``kind:devices:comm_dtype:max_ids:rows``), times it untraced, then traces
``--steps`` steps with ``jax.profiler`` and sums the first GPU's kernel time per HLO op
(the trace's "XLA Ops" line), with the op's JAX name stack where the trace has one, and
the host's time to issue a step (``host_ms``; near ``step_ms``, the step is bound by the
host), of it the time inside the compiled step's call (``dispatch_ms``: launching its
kernels; the rest is Python), and its most costly Python functions (``host_top``, from
``cProfile``).
Comparing the one-GPU case with the n-GPU case of one setting shows what sharding adds.
This is a diagnostic, not a benchmark: tracing slows the step; use the untraced time.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import glob
import importlib
import os
import pstats
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxrec.parallel as par
from jaxrec.benchmark._environment import environment
from jaxrec.benchmark._report import write_json
from jaxrec.models import DLRM
from jaxrec.nn import make_train_step
from jaxrec.optim import RowWiseAdagrad

sys.path.insert(0, os.path.dirname(__file__))
from sharded_dlrm_gpu import FULL, bce
from sharded_host_time import DispatchTimer

DEFAULT_CASES = ("row_wise:1:bfloat16:1:rows,row_wise:4:bfloat16:1:rows,"
                 "table_wise:4:bfloat16:1:rows")


def build(kind: str, n: int, comm_dtype: str, bound: int, rows: bool, log, tables, initial,
          batch: int, step=None):
    """``(call, batches, row_return_capacity)``: ``call(batch)`` issues one train step,
    ``step`` (default ``make_train_step(bce)``) on a new model."""
    devices = jax.devices()[:n]
    mesh = jax.sharding.Mesh(np.asarray(devices), ("data",))
    constraints = {t.name: par.ParameterConstraints(sharding_types=[kind]) for t in tables}
    optimizer = RowWiseAdagrad(learning_rate=0.01)
    topology = par.Topology(world_size=n, batch_size=batch)
    plan = par.EmbeddingShardingPlanner(topology, optimizer=optimizer,
                                        constraints=constraints).plan(tables)
    ebc = par.ShardedEmbeddingBagCollection(tables, plan, mesh, optimizer=optimizer,
                                            initial=initial)
    model = par.shard(DLRM(ebc, log.num_dense, FULL["bottom"], FULL["top"], rngs=nnx.Rngs(1)),
                      plan, mesh)
    ebc.max_ids_per_bag = (bound,) * len(ebc.feature_names)
    batches = [par.shard_batch(x, mesh, model=model) for x in log.batches(n * batch, 4)]
    ebc.comm_dtype = jnp.dtype(comm_dtype)
    if not rows:
        ebc.row_return_capacity = (0,) * len(ebc.row_return_capacity)
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    if step is None:
        step = make_train_step(bce)
    return (lambda b: step(model, opt, b)), batches, list(ebc.row_return_capacity)


def criteo_tables(max_rows: int, package: str = "jaxrec"):
    """``(log, tables, initial)``: the synthetic Criteo log (hot ids scattered), its 26 tables
    of D=128 capped at ``max_rows`` rows, and their initial weights (host arrays); of the
    classes of ``package`` (an older build's, ``older_build.py``, to pass to its ``build``)."""
    data = importlib.import_module(f"{package}.data")
    config = importlib.import_module(f"{package}.nn").EmbeddingBagConfig
    log = data.SyntheticClickLog(num_embeddings_per_feature=data.CRITEO_KAGGLE_CARDINALITIES,
                                 max_rows=max_rows, scatter_ids=True, seed=0)
    tables = [config(name=f"t_{k}", num_embeddings=r, embedding_dim=FULL["dim"],
                     feature_names=[k]) for k, r in zip(log.keys, log.table_sizes)]
    rngs = nnx.Rngs(0)
    with jax.default_device(jax.devices()[0]):
        initial = {t.name: {"weights": np.asarray(t.init(rngs.params()))} for t in tables}
    return log, tables, initial


def host_profile(call, batches, top: int, steps: int = 50) -> list[dict]:
    """The host's time per step to issue ``steps`` back-to-back steps, per Python function
    (``cProfile``'s own time, which inflates Python against C++ calls), most first."""
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(steps):
        out = call(batches[i % 4])
    profiler.disable()
    jax.block_until_ready(out)
    stats = pstats.Stats(profiler).stats
    rows = sorted(((tottime, calls, f"{os.path.basename(file)}:{line}({name})")
                   for (file, line, name), (_, calls, tottime, _, _) in stats.items()),
                  reverse=True)[:top]
    return [{"function": name, "us_per_step": t / steps * 1e6, "calls_per_step": c / steps}
            for t, c, name in rows]


def op_times(trace_dir: str, steps: int, top: int) -> dict:
    """The first GPU's kernel time per HLO op, per step, from the trace in ``trace_dir``."""
    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    data = jax.profiler.ProfileData.from_file(path)
    planes = sorted((p for p in data.planes if p.name.startswith("/device:GPU:")),
                    key=lambda p: p.name)
    if not planes:  # a CPU run: only the host's side
        return {"plane": None, "busy_us_per_step": float("nan"), "ops": []}
    plane = planes[0]
    lines = {line.name: list(line.events) for line in plane.lines}
    # "XLA Ops": one event per HLO op run; without it, the kernels on the streams.
    ops = lines.get("XLA Ops") or [e for name, events in lines.items()
                                   if name.startswith("Stream") for e in events]
    total = collections.Counter()
    count = collections.Counter()
    where = {}
    for event in ops:
        total[event.name] += event.duration_ns
        count[event.name] += 1
        if event.name not in where:
            stats = dict(event.stats)
            where[event.name] = {k: str(v)[:300] for k, v in stats.items()
                                 if k in ("tf_op", "name", "source", "hlo_category",
                                          "long_name")}
    modules = [e.duration_ns for e in lines.get("XLA Modules", [])]
    busy = sum(total.values())
    return {
        "plane": plane.name, "lines": sorted(lines),
        "busy_us_per_step": busy / steps / 1e3,
        "module_us": [m / 1e3 for m in modules][-steps:],
        "ops": [{"op": name, "us_per_step": t / steps / 1e3, "calls_per_step": count[name] / steps,
                 **where[name]} for name, t in total.most_common(top)],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--max-rows", type=int, default=2_000_000)
    p.add_argument("--batch-size", type=int, default=FULL["batch"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=60)
    args = p.parse_args(argv)
    log, tables, initial = criteo_tables(args.max_rows)
    result = environment("profile_sharded_step", jax.devices()[0].device_kind, {}, {})
    result["cases"] = []
    for spec in args.cases.split(","):
        kind, n, comm_dtype, bound, rows = spec.split(":")
        with DispatchTimer() as dispatch:
            call, batches, capacity = build(kind, int(n), comm_dtype, int(bound), rows == "rows",
                                            log, tables, initial, args.batch_size)
            for i in range(5):
                jax.block_until_ready(call(batches[i % 4]))
        dispatch.seconds = 0.0
        start = time.perf_counter()
        for i in range(20):
            out = call(batches[i % 4])
        host_ms = (time.perf_counter() - start) / 20 * 1e3
        dispatch_ms = dispatch.seconds / 20 * 1e3
        jax.block_until_ready(out)
        step_ms = (time.perf_counter() - start) / 20 * 1e3
        host_top = host_profile(call, batches, args.top)
        with tempfile.TemporaryDirectory() as trace_dir:
            jax.profiler.start_trace(trace_dir)
            for i in range(args.steps):
                out = call(batches[i % 4])
            jax.block_until_ready(out)
            jax.profiler.stop_trace()
            profile = op_times(trace_dir, args.steps, args.top)
        case = {"case": spec, "step_ms": step_ms, "host_ms": host_ms, "dispatch_ms": dispatch_ms,
                "host_top": host_top,
                "row_return_capacity": capacity, **profile}
        result["cases"].append(case)
        print(f"== {spec}: {step_ms:.2f} ms untraced (host {host_ms:.2f}, of it the compiled "
              f"step's dispatch {dispatch_ms:.2f}), GPU busy "
              f"{case['busy_us_per_step']:.0f} us/step", flush=True)
        for row in host_top[:25]:
            print(f"  host {row['us_per_step']:8.1f} us x{row['calls_per_step']:6.1f}  {row['function']}",
                  flush=True)
        for op in case["ops"][:40]:
            print(f"  {op['us_per_step']:8.1f} us x{op['calls_per_step']:4.1f}  {op['op'][:40]:40s}"
                  f"  {op.get('tf_op', op.get('name', ''))[:110]}", flush=True)
        del call, batches
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
