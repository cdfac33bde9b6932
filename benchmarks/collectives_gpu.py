"""The collectives a row-wise output could use, timed on the visible GPUs.

    python benchmarks/collectives_gpu.py --out benchmarks/results/collectives_<gpu>_<date>.json

Per device, the shapes of the sharded DLRM benchmark (B=16384 samples, 26 one-hot
features, D=128, float32), on 2 and 4 GPUs:

* ``psum_scatter`` of the pooled partial sums of the global batch, ``[N*B, 26*D]``
  (what ROW_WISE sends today), and an ``all_to_all`` of the same bytes;
* ``ragged_all_to_all`` of the rows themselves, ``C = 26*B`` rows of D per device, C/N
  to each peer (what returning looked-up rows to their batch owners would send), and
  its gradient (the transposed ragged all-to-all); checked against the expected rows;
* the ``all_to_all`` of a table-wise output, ``[N*B, 26*D/N]``.

Each time is the median of 10 calls, each waited for.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

B, S, D = 16384, 26, 128


def median_ms(f, *args, iters=10):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def run(n: int) -> dict:
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:n]), ("x",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    rows_per_device = B * S

    def per_device(f):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    def sharded(key, shape):
        return jax.device_put(jax.random.normal(jax.random.key(key), shape),
                              NamedSharding(mesh, P("x")))

    def ragged(x):  # rows_per_device / n rows to every peer
        send = jnp.full((n,), rows_per_device // n, jnp.int32)
        input_offsets = jnp.arange(n, dtype=jnp.int32) * send[0]
        recv = jax.lax.all_to_all(send, "x", 0, 0, tiled=True)
        recv_offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(recv)[:-1]])
        output_offsets = jax.lax.all_to_all(recv_offsets, "x", 0, 0, tiled=True)
        return jax.lax.ragged_all_to_all(x, jnp.zeros_like(x), input_offsets, send,
                                         output_offsets, recv, axis_name="x")

    partial = sharded(0, (n * n * B, S * D))
    rows = sharded(1, (n * n * rows_per_device, D))
    table_wise = sharded(2, (n * n * B, S * D // n))
    reduce_scatter = per_device(lambda x: jax.lax.psum_scatter(x, "x", scatter_dimension=0,
                                                               tiled=True))
    all_to_all = per_device(lambda x: jax.lax.all_to_all(x, "x", 0, 0, tiled=True))
    ragged_rows = per_device(ragged)
    ragged_grad = per_device(jax.grad(lambda x: (ragged(x) * 1.5).sum()))

    got = np.asarray(ragged_rows(rows)).reshape(n, n * rows_per_device, D)
    sent = np.asarray(rows).reshape(n, n * rows_per_device, D)
    q = rows_per_device // n
    ok = all(np.array_equal(got[d, s * q:(s + 1) * q], sent[s, d * q:(d + 1) * q])
             for d in range(n) for s in range(n))
    return {"n": n, "ragged_ok": bool(ok),
            "psum_scatter_ms": median_ms(reduce_scatter, partial),
            "all_to_all_same_bytes_ms": median_ms(all_to_all, partial),
            "ragged_C_rows_ms": median_ms(ragged_rows, rows),
            "ragged_grad_ms": median_ms(ragged_grad, rows),
            "bytes_rs_per_dev": n * B * S * D * 4, "bytes_ragged_per_dev": rows_per_device * D * 4,
            "all_to_all_tablewise_ms": median_ms(all_to_all, table_wise)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON result path")
    args = p.parse_args()
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "runs": []}
    for n in (2, 4):
        if n <= len(jax.devices()):
            result["runs"].append(run(n))
            print(result["runs"][-1], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
