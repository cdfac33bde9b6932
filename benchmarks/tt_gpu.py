"""TT embedding bags on one GPU: jaxrec's CUDA kernels vs the pure-jnp TT path vs a dense TBE.

    python benchmarks/tt_gpu.py --out benchmarks/results/tt_gpu_<device>.json [--quick]

FBTT's benchmark configuration (its tt_embeddings_benchmark.py defaults): B=512 bags of
L=20 uniform ids, p=[200,220,250] (11M rows), q=[4,4,4] (D=64), ranks [32,32], fused SGD;
a step is forward + backward + update, the output gradient fixed and random (FBTT's
``tt_emb(indices, offsets).backward(grad_output)``). Peers, in this one process on the
same id sets:

- jaxrec TT, CUDA kernels (``backend="kernel"``);
- jaxrec TT, pure jnp (``backend="reference"``: gather + einsum chain, autodiff scatter);
- a dense fused TBE of the same shape (``FusedEmbeddingTables``, 11M x 64 float32, SGD).

Reported: µs per id (nnz) for the whole step and for the forward alone, GFLOP/s with
FBTT's count (``3 * 2 * nnz * (q0 r1 q1 r2 + q0 q1 r2 q2)`` for fwd+bwd) and the
compression ratio. FBTT's README reports 0.416 µs/nnz for this configuration (on a V100).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrec.benchmark._environment import environment
from jaxrec.benchmark._measure import timed
from jaxrec.benchmark._report import write_json
from jaxrec.fused import (
    FusedEmbeddingTables,
    TTEmbeddingTables,
    fused_lookup,
    make_functional_train_step,
    tt_fused_lookup,
)
from jaxrec.ops import TableLayout, TTLayout, init_tt_cores, init_weights
from jaxrec.optim import SGD

P, Q, RANKS = (200, 220, 250), (4, 4, 4), (32, 32)


def id_sets(rng, n_sets, batch, pooling, rows):
    """(indices int32[B*L], offsets int32[B+1]) per set; uniform ids."""
    offsets = jnp.arange(0, batch * pooling + 1, pooling, dtype=jnp.int32)
    return [(jnp.asarray(rng.integers(0, rows, batch * pooling), jnp.int32), offsets)
            for _ in range(n_sets)]


def train_step(lookup):
    """A jitted fused step: loss = <out, grad_output>, so the backward sees grad_output."""
    def loss(params, tables, indices, offsets, grad_output):
        return jnp.sum(lookup(tables, indices, offsets) * grad_output) * params

    return make_functional_train_step(loss, optax.sgd(0.0))


def time_step(step, tables, sets, grad_output, iters):
    state = {"tables": tables, "p": jnp.float32(1.0)}
    state["s"] = optax.sgd(0.0).init(state["p"])

    def run(indices, offsets):
        state["p"], state["s"], state["tables"], value = step(
            state["p"], state["s"], state["tables"], indices, offsets, grad_output)
        return value

    return timed(run, sets, iters, jax.block_until_ready)


def copy(cores):
    """Fresh buffers: the train steps donate (and so delete) the cores they are given."""
    return tuple(jnp.array(c, copy=True) for c in cores)


def flops_per_nnz(p_q=Q, ranks=RANKS):
    q, r = p_q, ranks
    return 2.0 * (q[0] * r[0] * q[1] * r[1] + q[0] * q[1] * r[1] * q[2])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--pooling", type=int, default=20)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="small table (CPU smoke run)")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    p_shapes = (20, 22, 25) if args.quick else P
    rows = int(np.prod(p_shapes))
    layout = TTLayout.create(rows, int(np.prod(Q)), RANKS, p_shapes, Q)
    dim, nnz = layout.embedding_dim, args.batch * args.pooling
    rng = np.random.default_rng(0)
    sets = id_sets(rng, 4, args.batch, args.pooling, rows)
    grad_output = jnp.asarray(rng.random((args.batch, dim), np.float32) * 0.1)
    cores = init_tt_cores(jax.random.key(0), layout, "approx-uniform")
    sgd = SGD(learning_rate=0.05)

    result = environment("tt_gpu", device.device_kind, {}, {})
    result["config"] = dict(batch=args.batch, pooling=args.pooling, nnz=nnz, p_shapes=p_shapes,
                            q_shapes=Q, ranks=RANKS, optimizer="fused SGD", ids="uniform",
                            iters=args.iters)
    result["compression_ratio"] = layout.compression_ratio
    result["core_bytes"] = 4 * layout.num_parameters
    result["dense_bytes"] = 4 * rows * dim
    runs = {}
    for name, backend in (("tt_kernel", "kernel"), ("tt_jnp", "reference")):
        if backend == "kernel" and device.platform != "gpu":
            continue
        step = train_step(lambda t, i, o, b=backend: tt_fused_lookup(
            t, i, o, bounds_check_mode="none", backend=b))
        tables = TTEmbeddingTables.create(layout, sgd, cores=copy(cores), name="tt")
        seconds = time_step(step, tables, sets, grad_output, args.iters)
        forward = jax.jit(lambda c, i, o, b=backend: tt_fused_lookup(
            TTEmbeddingTables.create(layout, sgd, cores=c), i, o, bounds_check_mode="none",
            backend=b))
        fwd_cores = copy(cores)
        fwd_seconds = timed(lambda i, o: forward(fwd_cores, i, o), sets, args.iters,  # noqa: B023 (called here)
                            jax.block_until_ready)
        runs[name] = dict(step_us=seconds * 1e6, us_per_nnz=seconds * 1e6 / nnz,
                          forward_us_per_nnz=fwd_seconds * 1e6 / nnz,
                          gflops=3 * flops_per_nnz() * nnz / seconds / 1e9)
        print(name, runs[name], flush=True)

    tbe = TableLayout(rows=(rows,), dims=(dim,), feature_table_map=(0,))
    dense = FusedEmbeddingTables.create(tbe, sgd, weights=init_weights(jax.random.key(1), tbe),
                                        name="dense")
    step = train_step(lambda t, i, o: fused_lookup(t, i, o, bounds_check_mode="none"))
    seconds = time_step(step, dense, sets, grad_output, args.iters)
    runs["dense_tbe"] = dict(step_us=seconds * 1e6, us_per_nnz=seconds * 1e6 / nnz)
    print("dense_tbe", runs["dense_tbe"], flush=True)
    del dense
    if "tt_kernel" in runs:
        runs["ratios"] = dict(jnp_over_kernel=runs["tt_jnp"]["step_us"] / runs["tt_kernel"]["step_us"],
                              kernel_over_dense_tbe=runs["tt_kernel"]["step_us"] / runs["dense_tbe"]["step_us"])
    result["runs"] = runs
    write_json(args.out, result)
    print(result["runs"].get("ratios"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
