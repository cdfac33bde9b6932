"""Quantized (inference) lookup on the GPU: int8 / int4 / fp16 tables against the float32
lookup, side by side in one process, with the copy ceiling measured in the same run.

    python benchmarks/serving_lookup_gpu.py --out benchmarks/results/serving_lookup_gpu_<device>.json [--quick]

Shape: T=32 tables of E=1e6 rows, D=128, B=4096 bags of L=20 uniform ids per table.
Peers, each timed as back-to-back calls, rounds interleaved (jaxrec.benchmark._measure):

* ``fp32_tbe``: ``embedding_bag_lookup`` over float32 tables, its default bounds check
  (the float lookup a trained model runs);
* ``fp32`` / ``fp16`` / ``int8`` / ``int4``: ``quantized_lookup`` over tables of that
  precision, float32 output (``int8_fp16_out``: float16 output);
* ``mixed``: 16 int8 and 16 int4 tables in one launch;
* ``xla_int8``: plain XLA (take, dequantize, sum) over the same int8 tables.

Bytes are counted twice: ``row_bytes`` (each id's row as stored, plus the output) and
``sector_bytes`` (the 32-byte DRAM sectors each row touches at its alignment, plus the
output), the bytes the memory system actually reads; each as GB/s and as a fraction of
the copy ceiling.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrec.benchmark._environment import environment, nvidia_driver  # noqa: E402
from jaxrec.benchmark._measure import NUM_ID_SETS, interleaved_timed  # noqa: E402
from jaxrec.benchmark._report import write_json  # noqa: E402
from jaxrec.benchmark._tbe_gpu import copy_ceiling, max_abs_diff  # noqa: E402
from jaxrec.ops import TableLayout, embedding_bag_lookup  # noqa: E402
from jaxrec.ops.quantized_lookup import quantized_lookup  # noqa: E402
from jaxrec.ops.quantized_rows import dequantize_rows, row_bytes  # noqa: E402

T, E, D, B, L = 32, 1_000_000, 128, 4096, 20
if os.environ.get("SERVING_LOOKUP_SMOKE"):  # a seconds-long run of the script's code on any machine
    T, E, B = 4, 1000, 64


def quantized_table(key, precision):
    """A table of random rows in the quantized layout: random codes, float16 scales in
    [1e-3, 1e-2) and biases in [-0.5, 0) (no zeros: every row reads real data)."""
    k1, k2, k3 = jax.random.split(key, 3)
    codes = jax.random.bits(k1, (E, row_bytes(D, precision) - 4), jnp.uint8)
    scale = jax.random.uniform(k2, (E,), minval=1e-3, maxval=1e-2).astype(jnp.float16)
    bias = jax.random.uniform(k3, (E,), minval=-0.5, maxval=0.0).astype(jnp.float16)
    head = jax.lax.bitcast_convert_type(jnp.stack([scale, bias], 1), jnp.uint8).reshape(E, 4)
    return jnp.concatenate([head, codes], axis=1)


def sector_bytes(row: int) -> float:
    """Mean bytes of the 32-byte sectors a row of ``row`` bytes touches, over the alignments
    (id * row) % 32 that rows of a table take."""
    starts = [(i * row) % 32 for i in range(32)]
    return float(np.mean([32 * -(-(s + row) // 32) for s in starts]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    iters, rounds = (20, 3) if args.quick else (50, 5)
    ceiling = copy_ceiling(iters)
    print(f"copy ceiling {ceiling:.0f} GB/s", flush=True)

    rng = np.random.default_rng(0)
    id_sets = [jnp.asarray(rng.integers(0, E, (T * B * L,)).astype(np.int32)) for _ in range(NUM_ID_SETS)]
    offsets = jnp.arange(0, T * B * L + 1, L, dtype=jnp.int32)
    keys = jax.random.split(jax.random.key(1), 3 * T)
    tables = {
        "int8": [quantized_table(keys[t], "int8") for t in range(T)],
        "int4": [quantized_table(keys[T + t], "int4") for t in range(T)],
        "fp16": [jax.random.normal(keys[2 * T + t], (E, D), jnp.float16) for t in range(T)],
    }
    layout = TableLayout.from_embedding_specs([(E, D)] * T)
    tables["fp32"] = [jax.random.normal(k, (E, D), jnp.float32) for k in jax.random.split(jax.random.key(0), T)]
    # The same rows as the TBE's flat buffer, concatenated under jit (eager reshapes would copy).
    flat = jax.jit(lambda ts: jnp.concatenate([t.reshape(-1) for t in ts]))(tables["fp32"])
    mixed = tables["int8"][:T // 2] + tables["int4"][T // 2:]
    features = list(range(T))

    # Tables and offsets are arguments, never constants captured by jit (gigabytes of them).
    def quantized(precisions, output_dtype=jnp.float32):
        return jax.jit(lambda ts, o, ids: quantized_lookup(ts, precisions, features, ids, o,
                                                           output_dtype=output_dtype))

    def xla_int8(ts, o, ids):  # take the rows, dequantize them, sum each bag (fixed bags of L)
        ids = ids.reshape(T, B, L)
        return jnp.concatenate([dequantize_rows(jnp.take(ts[t], ids[t], axis=0), "int8").sum(1)
                                for t in range(T)], axis=1)

    peers = {
        "fp32_tbe": (jax.jit(lambda w, o, ids: embedding_bag_lookup(w, ids, o, layout=layout)), flat),
        **{p: (quantized([p] * T), tables[p]) for p in ("fp32", "fp16", "int8", "int4")},
        "int8_fp16_out": (quantized(["int8"] * T, jnp.float16), tables["int8"]),
        "mixed": (quantized(["int8"] * (T // 2) + ["int4"] * (T // 2)), mixed),
        "xla_int8": (jax.jit(xla_int8), tables["int8"]),
    }

    def run(name, ids):
        fn, weights = peers[name]
        return fn(weights, offsets, ids)

    stored = {"fp32_tbe": 4 * D, "fp32": 4 * D, "fp16": 2 * D, "int8": row_bytes(D, "int8"),
              "int4": row_bytes(D, "int4"), "int8_fp16_out": row_bytes(D, "int8"), "xla_int8": row_bytes(D, "int8"),
              "mixed": (row_bytes(D, "int8") + row_bytes(D, "int4")) / 2}
    sectors = {**{k: sector_bytes(int(v)) for k, v in stored.items() if k != "mixed"},
               "mixed": (sector_bytes(row_bytes(D, "int8")) + sector_bytes(row_bytes(D, "int4"))) / 2}
    out_bytes = {k: (2 if k == "int8_fp16_out" else 4) * B * T * D for k in peers}

    checks = {}
    reference = jax.block_until_ready(run("xla_int8", id_sets[0]))
    checks["int8_vs_xla_int8_max_abs_diff"] = max_abs_diff(run("int8", id_sets[0]), reference)
    del reference
    checks["fp32_vs_fp32_tbe_max_abs_diff"] = max_abs_diff(run("fp32", id_sets[0]), run("fp32_tbe", id_sets[0]))
    print(checks, flush=True)
    names = list(peers)
    for name in names:  # compile and warm up
        jax.block_until_ready(run(name, id_sets[0]))
    cases = [(lambda ids, n=name: run(n, ids), id_sets) for name in names]
    seconds, _ = interleaved_timed(cases, iters, rounds, jax.block_until_ready)
    ids_read = T * B * L
    results = {}
    for name, s in zip(names, seconds):
        row_total = ids_read * stored[name] + out_bytes[name]
        sector_total = ids_read * sectors[name] + out_bytes[name]
        results[name] = dict(ms=s * 1e3, row_bytes=stored[name], sector_bytes_per_row=sectors[name],
                             GB_per_s_rows=row_total / s / 1e9, GB_per_s_sectors=sector_total / s / 1e9,
                             of_ceiling_rows=row_total / s / 1e9 / ceiling,
                             of_ceiling_sectors=sector_total / s / 1e9 / ceiling,
                             speedup_vs_fp32_tbe=seconds[0] / s)
        print(f"{name:14s} {s * 1e3:7.3f} ms  {results[name]['GB_per_s_sectors']:6.0f} GB/s sectors "
              f"({results[name]['of_ceiling_sectors']:.0%})  rows {results[name]['of_ceiling_rows']:.0%}  "
              f"x{results[name]['speedup_vs_fp32_tbe']:.2f} vs fp32_tbe", flush=True)
    info = dict(environment("serving_lookup_gpu", jax.devices()[0].device_kind, {}, {}), driver=nvidia_driver(),
                copy_ceiling_GB_per_s=ceiling, shape=dict(T=T, E=E, D=D, B=B, L=L, ids="uniform"),
                quick=args.quick, checks=checks, results=results,
                method=f"median over {rounds} interleaved rounds of {iters} back-to-back calls, {NUM_ID_SETS} "
                       "id sets rotated; L2 not flushed; output float32 unless named")
    write_json(args.out, info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
