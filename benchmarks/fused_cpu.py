"""The fused TBE backward + optimizer on the CPU: jaxrec's C++ handlers vs FBGEMM's CPU TBE.

    python benchmarks/fused_cpu.py [--configs default,d64_b2048,b2048] [--iters 20] [--out FILE.json]

Run it where torch 2.13 CPU, fbgemm-gpu-cpu 1.8.0, jax and jaxrec are installed
(docs/fused.md). One process; fp32 tables of E rows x D, T features (one table each), B
samples, bags of L uniform random ids (duplicates included), 4 id sets rotated; the peers
run round-robin, one iteration each in turn (tbe_cpu.interleaved_medians), median of --iters.

A step is forward + backward with the optimizer fused in, EXACT_ROWWISE_ADAGRAD,
EXACT_ADAGRAD and EXACT_SGD, the same learning rate and eps, bounds checks off on both sides:

* FBGEMM: SplitTableBatchedEmbeddingBagsCodegen (HOST, CPU): ``out = emb(ids, offsets);
  out.backward(g)`` (the update happens inside backward).
* jaxrec: one jitted step, weights and state donated: ``out = embedding_bag_lookup(...)``,
  then ``fused_update(w, s, g + 0 * out, ...)``. The ``0 * out`` stands for a real loss's
  gradient: it orders the update after the lookup, and without it XLA copies the table to
  let the lookup read it before the in-place update (it would cost O(table) per step).
* jaxrec_fused_*: ``fused_update`` alone (the backward only); jaxrec_sort_by_row: the radix
  sort of the T*B*L ids by table row that the update's handler runs first, as a handler of
  its own (``jaxrec.ops.row_sort``); and, for reference, xla_sort_of_the_ids: XLA's sort of
  the same keys, which the update once ran instead.

The timings need an idle machine: each library uses every core, and FBGEMM's OpenMP
threads slow down many times over when another process takes a core. Each run records
``contention_while_timed`` (CPU time that other processes took meanwhile); rerun unless it is ~0.

Cross-check, once and untimed: from the same weights and batch, one step of each library;
the updated weights and optimizer states and the forward outputs must agree (max |diff|).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import resource
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tbe_cpu import NUM_ID_SETS, interleaved_medians, machine_info

from jaxrec.fused import fused_update
from jaxrec.ops import TableLayout, embedding_bag_lookup
from jaxrec.ops.row_sort import sort_by_row
from jaxrec.optim import SGD, Adagrad, RowWiseAdagrad, init_state, split_optimizer_states

LR, EPS = 0.01, 1e-8
OPTIMIZERS = {"rowwise_adagrad": (RowWiseAdagrad(learning_rate=LR, eps=EPS), "EXACT_ROWWISE_ADAGRAD"),
              "adagrad": (Adagrad(learning_rate=LR, eps=EPS), "EXACT_ADAGRAD"),
              "sgd": (SGD(learning_rate=LR), "EXACT_SGD")}
CONFIGS = {
    "default": dict(T=8, E=100_000, D=128, B=512, L=20),
    "d64_b2048": dict(T=8, E=100_000, D=64, B=2048, L=20),
    "b2048": dict(T=8, E=100_000, D=128, B=2048, L=20),
    "quick": dict(T=2, E=1000, D=16, B=32, L=5),
}
CHECK_TOLERANCE = 1e-5


def jaxrec_steps(cfg, weights_np, id_sets, grad):
    """{name: fn(i)} and, per optimizer, the (weights, state) after one untimed step on set 0."""
    T, E, D, B, L = (cfg[k] for k in "TEDBL")
    layout = TableLayout.from_embedding_specs([(E, D)] * T)
    offsets = jnp.arange(T * B + 1, dtype=jnp.int32) * L
    g = jnp.asarray(grad)
    ids = [jnp.asarray(s) for s in id_sets]
    lookup = jax.jit(lambda w, i: embedding_bag_lookup(w, i, offsets, layout=layout, bounds_check_mode="NONE"))
    fresh = {}

    def step_fn(config):
        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(w, s, i, g):
            out = embedding_bag_lookup(w, i, offsets, layout=layout, bounds_check_mode="NONE")
            w, s = fused_update(w, s, g + 0.0 * out, i, offsets, layout=layout, config=config,
                                bounds_check_mode="NONE")
            return w, s, out

        return step

    def threaded(fn, config):
        box = [fn(jnp.array(weights_np), init_state(config, layout), ids[0], g)]  # the checked step
        w, s, out = box[0]  # copied: the next (donated) step overwrites these buffers
        fresh[config] = (np.array(w), jax.tree.map(np.array, s), np.array(out))

        def run(i):
            box[0] = fn(*box[0][:2], ids[i], g)
            jax.block_until_ready(box[0])

        return run

    forward_w = jnp.array(weights_np)
    steps = {"jaxrec_forward_ms": lambda i: jax.block_until_ready(lookup(forward_w, ids[i]))}
    for name, (config, _) in OPTIMIZERS.items():
        steps[f"jaxrec_step_{name}_ms"] = threaded(step_fn(config), config)
    rowwise = OPTIMIZERS["rowwise_adagrad"][0]
    fused_only = jax.jit(lambda w, s, i, g: fused_update(w, s, g, i, offsets, layout=layout, config=rowwise,
                                                      bounds_check_mode="NONE"), donate_argnums=(0, 1))
    box = [(jnp.array(weights_np), init_state(rowwise, layout))]

    def fused_run(i):
        box[0] = fused_only(*box[0], ids[i], g)
        jax.block_until_ready(box[0])

    steps["jaxrec_fused_rowwise_adagrad_ms"] = fused_run
    by_row = jax.jit(lambda i: sort_by_row(layout, i, offsets))
    steps["jaxrec_sort_by_row_ms"] = lambda i: jax.block_until_ready(by_row(ids[i]))
    # XLA's sort of the same keys ((table, id)), which the update ran before its own sort.
    n = T * B * L
    sort = jax.jit(lambda i: jax.lax.sort_key_val(i + (jnp.arange(n, dtype=jnp.int32) // (B * L)) * E,
                                                  jnp.arange(n, dtype=jnp.int32)))
    steps["xla_sort_of_the_ids_ms"] = lambda i: jax.block_until_ready(sort(ids[i]))
    checked = {name: fresh[config] for name, (config, _) in OPTIMIZERS.items()}
    return steps, checked, layout


def fbgemm_steps(cfg, weights_np, id_sets, grad):
    import torch
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        OptimType,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    T, E, D, B, L = (cfg[k] for k in "TEDBL")
    offsets = torch.arange(T * B + 1, dtype=torch.int64) * L
    g = torch.from_numpy(grad)
    ids = [torch.from_numpy(s.astype(np.int64)) for s in id_sets]
    steps, checked = {}, {}
    for name, (_, fbgemm_name) in OPTIMIZERS.items():
        emb = SplitTableBatchedEmbeddingBagsCodegen(
            [(E, D, EmbeddingLocation.HOST, ComputeDevice.CPU)] * T, optimizer=getattr(OptimType, fbgemm_name),
            learning_rate=LR, eps=EPS, bounds_check_mode=BoundsCheckMode.NONE)
        with torch.no_grad():
            emb.weights_host.copy_(torch.from_numpy(weights_np))
        out = emb(ids[0], offsets)  # the checked step
        out.backward(g)
        checked[name] = (torch.cat([w.reshape(-1) for w in emb.split_embedding_weights()]).detach().numpy().copy(),
                         [s[0].detach().numpy().copy() for s in emb.split_optimizer_states() if s],
                         out.detach().numpy().copy())

        def step(i, emb=emb):
            emb(ids[i], offsets).backward(g)

        steps[f"fbgemm_step_{name}_ms"] = step
        if name == "rowwise_adagrad":
            def forward(i, emb=emb):
                with torch.no_grad():
                    emb(ids[i], offsets)

            steps["fbgemm_forward_ms"] = forward
    return steps, checked


def cross_check(layout, jaxrec_checked, fbgemm_checked):
    """Max |difference| after one step from the same weights: jaxrec vs FBGEMM."""
    out = {}
    for name, (config, _) in OPTIMIZERS.items():
        jw, js, jout = jaxrec_checked[name]
        fw, fstates, fout = fbgemm_checked[name]
        jstates = [np.asarray(t["momentum1"]).reshape(-1) for t in split_optimizer_states(config, layout, js)
                   if "momentum1" in t]
        state_diff = max((float(np.abs(a - b.reshape(-1)).max()) for a, b in zip(jstates, fstates)), default=0.0)
        state_scale = max((float(np.abs(b).max()) for b in fstates), default=1.0)  # SGD has no state
        out[name] = dict(
            weights_max_abs_diff=float(np.abs(jw - fw).max()),
            weights_largest_update=float(np.abs(fw - fbgemm_checked["_initial"]).max()),
            state_max_abs_diff=state_diff, state_max_rel_diff=state_diff / state_scale,
            forward_max_abs_diff=float(np.abs(jout - fout).max()))
        out[name]["agree"] = bool(out[name]["weights_max_abs_diff"] <= CHECK_TOLERANCE
                                  and out[name]["state_max_rel_diff"] <= CHECK_TOLERANCE
                                  and out[name]["forward_max_abs_diff"] <= CHECK_TOLERANCE)
    return out


def cpu_seconds():
    """(CPU seconds of every process on the machine, of this process) so far."""
    values = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    busy = (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    own = resource.getrusage(resource.RUSAGE_SELF)
    return busy, own.ru_utime + own.ru_stime


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="default,d64_b2048,b2048",
                        help=f"comma-separated, among {list(CONFIGS)}")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    names = [n for n in args.configs.split(",") if n]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configs {unknown}; choose among {list(CONFIGS)}")
    load_at_start = os.getloadavg()
    rng = np.random.default_rng(0)
    runs = []
    for name in names:
        cfg = dict(name=name, **CONFIGS[name], dtype="float32", ids="uniform")
        T, E, D, B, L = (cfg[k] for k in "TEDBL")
        bound = 1 / np.sqrt(E)
        weights = rng.uniform(-bound, bound, T * E * D).astype(np.float32)
        id_sets = [rng.integers(0, E, T * B * L, dtype=np.int32) for _ in range(NUM_ID_SETS)]
        grad = rng.standard_normal((B, T * D)).astype(np.float32)
        unique = float(np.mean([np.unique(s.reshape(T, -1) + (np.arange(T) * E)[:, None]).size for s in id_sets]))

        steps, jaxrec_checked, layout = jaxrec_steps(cfg, weights, id_sets, grad)
        fb_steps, fbgemm_checked = fbgemm_steps(cfg, weights, id_sets, grad)
        fbgemm_checked["_initial"] = weights
        check = cross_check(layout, jaxrec_checked, fbgemm_checked)
        del fbgemm_checked, jaxrec_checked, weights
        steps.update(fb_steps)
        start, (busy0, own0) = time.perf_counter(), cpu_seconds()
        times = interleaved_medians(steps, NUM_ID_SETS, args.iters)
        wall, (busy1, own1) = time.perf_counter() - start, cpu_seconds()
        others = max(0.0, (busy1 - busy0) - (own1 - own0))  # other processes (the timings need them idle)
        contention = dict(wall_s=wall, cpu_s_of_other_processes=others,
                          share_of_the_machine_taken_by_others=others / (wall * os.cpu_count()))
        del steps, fb_steps
        ratios = {"fbgemm_forward / jaxrec_forward": times["fbgemm_forward_ms"] / times["jaxrec_forward_ms"]}
        for opt in OPTIMIZERS:
            value = times[f"fbgemm_step_{opt}_ms"] / times[f"jaxrec_step_{opt}_ms"]
            ratios[f"fbgemm_step_{opt} / jaxrec_step_{opt}"] = dict(value=value, target=">= 1", met=value >= 1)
        runs.append({"config": cfg, "unique_rows_per_batch": unique, "times_ms": times, "ratios": ratios,
                     "cross_check_one_step": check, "contention_while_timed": contention})
        print(json.dumps(runs[-1], indent=1), flush=True)
    machine = dict(machine_info(), load_average_at_start=load_at_start)
    result = {"date": datetime.date.today().isoformat(), "machine": machine, "iters": args.iters,
              "id_sets": NUM_ID_SETS, "learning_rate": LR, "eps": EPS,
              "cross_check_tolerance": CHECK_TOLERANCE, "runs": runs}
    out = Path(args.out or Path(__file__).parent / "results" / f"fused_cpu_{result['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
