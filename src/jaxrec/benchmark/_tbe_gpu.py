"""TBE lookup on the GPU, side by side in one process with plain XLA, PyTorch and the
device-to-device copy ceiling.

Bytes are counted as FBGEMM's benchmark does: forward = out_bytes*B*sum(D) +
w_bytes*(ids looked up)*D (for fixed bags: w_bytes*B*sum(D)*L). A case's JAX peers run
in interleaved rounds of `iters` back-to-back calls each (asynchronous dispatch keeps
the GPU busy; the host waits once per peer and round), the median over the rounds, so
that the ratios between them do not move with the machine's drift; PyTorch's peer is
timed after them (median of 5 repeats). Warm-up first; the requests rotate among 4
pre-generated id sets; L2 (50 MB) is not flushed, the tables are far larger.

Peers: XLA ``jnp.take`` + sum and ``segment_sum`` (fixed bags), a per-table
``segment_sum`` (jagged bags) and, when PyTorch imports and sees a GPU,
``torch.nn.functional.embedding_bag``. ``max_abs_diff_vs_xla`` is jaxrec's distance to
XLA on the first id set.

"jaxrec" is the lookup as users call it, with the default ``bounds_check_mode``
(WARNING: checked inside the CUDA forward); ``jaxrec_bounds_check_none`` is NONE beside
it, and the ratios are against the default.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec.benchmark._environment import environment, nvidia_driver, optional_import, share_gpu_with_torch
from jaxrec.benchmark._measure import NUM_ID_SETS, interleaved_by_name, lookup_bytes, timed
from jaxrec.benchmark._report import gpu_line, write_json
from jaxrec.ops import TableLayout, embedding_bag_lookup, init_weights

CRITEO_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
               27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
CASES = ("fbgemm_default", "large", "huge", "jagged", "criteo", "zipf", "bf16", "fp16")
QUICK_CASES = ("fbgemm_default", "criteo")
ROUNDS = 9  # interleaved rounds of the JAX peers
METHOD = (f"JAX peers: median of {ROUNDS} interleaved rounds of back-to-back calls; torch: median of 5 "
          "repeats; after warm-up; requests rotate among 4 pre-generated id sets; L2 not flushed; "
          "jaxrec: the default bounds_check_mode (WARNING), jaxrec_bounds_check_none: NONE")


def jax_time(fn, arg_sets, iters):
    return timed(fn, arg_sets, iters, jax.block_until_ready)


def jax_times(peers: dict[str, tuple[Callable, Sequence[tuple]]], iters: int) -> dict[str, float]:
    """Seconds per call of each ``{name: (fn, arg_sets)}``, in interleaved rounds."""
    cases = {name: (lambda args, fn=fn: fn(*args), sets) for name, (fn, sets) in peers.items()}
    return interleaved_by_name(cases, iters, ROUNDS, jax.block_until_ready)


def torch_time(torch, fn, arg_sets, iters):
    return timed(fn, arg_sets, iters, lambda _: torch.cuda.synchronize())


def max_abs_diff(a, b):
    return float(jax.jit(lambda a, b: jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))(a, b))


def zipf_ids(rng, rows, shape, alpha=1.15):
    """Zipf(alpha) ranks mapped through a fixed permutation, duplicates removed per bag
    (FBGEMM's generator), topped up with uniform ids where a bag ran short."""
    ranks = np.arange(1, rows + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** -alpha)
    cdf /= cdf[-1]
    perm = rng.permutation(rows)
    bags, length = int(np.prod(shape[:-1])), shape[-1]
    cand = perm[np.minimum(np.searchsorted(cdf, rng.random((bags, 3 * length))), rows - 1)]
    out = rng.integers(0, rows, size=(bags, length))
    for k in range(bags):
        uniq, first = np.unique(cand[k], return_index=True)
        uniq = uniq[np.argsort(first)][:length]
        out[k, :len(uniq)] = uniq
    return out.reshape(shape)


def fixed_bag_case(rng, cfg, dtype, dist):
    t, e, d, b, l = cfg["T"], cfg["E"], cfg["D"], cfg["B"], cfg["L"]
    layout = TableLayout.from_embedding_specs([(e, d)] * t)
    weights = init_weights(jax.random.key(0), layout, dtype)
    sets = []
    for _ in range(NUM_ID_SETS):
        ids = zipf_ids(rng, e, (t, b, l)) if dist == "zipf" else rng.integers(0, e, size=(t, b, l))
        sets.append(ids.astype(np.int32))
    return layout, weights, sets


def bench_fixed(rng, cfg, dtype, dist, iters, record, backward, torch):
    t, e, d, b, l = cfg["T"], cfg["E"], cfg["D"], cfg["B"], cfg["L"]
    layout, weights, id_sets = fixed_bag_case(rng, cfg, dtype, dist)
    nbytes = lookup_bytes(b, [d] * t, [b * l] * t, weight_bytes=jnp.dtype(dtype).itemsize)
    offsets = jnp.arange(0, t * b * l + 1, l, dtype=jnp.int32)
    flat_sets = [(weights, jnp.asarray(ids.reshape(-1)), offsets) for ids in id_sets]
    # The XLA peers reshape the flat buffer inside jit (free); an eager reshape would copy it.
    grouped_sets = [(weights, jnp.asarray(ids)) for ids in id_sets]

    lookup = jax.jit(lambda w, i, o: embedding_bag_lookup(w, i, o, layout=layout))
    lookup_none = jax.jit(lambda w, i, o: embedding_bag_lookup(w, i, o, layout=layout, bounds_check_mode="NONE"))

    def xla_take_sum(w, ids):  # flat [T*E*D], [T, B, L] -> [B, T*D]
        w3 = w.reshape(t, e, d)
        pooled = jax.vmap(lambda table, i: jnp.take(table, i, axis=0).astype(jnp.float32).sum(1))(w3, ids)
        return pooled.transpose(1, 0, 2).reshape(b, t * d)

    def xla_segment_sum(w, ids):
        rows = w.reshape(t * e, d)[(ids + (jnp.arange(t) * e)[:, None, None]).reshape(-1)]
        seg = jnp.repeat(jnp.arange(t * b), l)
        pooled = jax.ops.segment_sum(rows.astype(jnp.float32), seg, num_segments=t * b)
        return pooled.reshape(t, b, d).transpose(1, 0, 2).reshape(b, t * d)

    row = dict(config=cfg["name"], **{k: cfg[k] for k in "TEDBL"}, weights=jnp.dtype(dtype).name,
               ids=dist, bytes=nbytes)
    times = jax_times({"jaxrec": (lookup, flat_sets), "jaxrec_bounds_check_none": (lookup_none, flat_sets),
                       "xla_take_sum": (jax.jit(xla_take_sum), grouped_sets),
                       "xla_segment_sum": (jax.jit(xla_segment_sum), grouped_sets)}, iters)
    row["max_abs_diff_vs_xla"] = max_abs_diff(lookup(*flat_sets[0]), jax.jit(xla_take_sum)(*grouped_sets[0]))
    if torch is not None:
        tw = torch.from_dlpack(weights).view(t * e, d)
        tsets = []
        for ids in id_sets:
            gid = torch.from_dlpack(jnp.asarray((ids + np.arange(t)[:, None, None] * e).reshape(-1)))
            tsets.append((tw, gid.long(), torch.arange(0, t * b * l + 1, l, device="cuda")))
        times["torch_embedding_bag"] = torch_time(
            torch, lambda w, i, o: torch.nn.functional.embedding_bag(i, w, o, mode="sum", include_last_offset=True),
            tsets, iters)
    row["ms"] = {k: v * 1e3 for k, v in times.items()}
    row["GB_per_s"] = {k: nbytes / v / 1e9 for k, v in times.items()}
    row["speedup_of_jaxrec"] = {k: v / times["jaxrec"] for k, v in times.items() if k != "jaxrec"}
    record(row)

    if backward:
        g_sets = [(w, i, o, jax.random.normal(jax.random.key(k), (b, t * d))) for k, (w, i, o) in enumerate(flat_sets)]
        def bwd_of(mode):
            return jax.jit(lambda w, i, o, g: jax.vjp(lambda w: embedding_bag_lookup(
                w, i, o, layout=layout, bounds_check_mode=mode), w)[1](g)[0])

        bwd = bwd_of("WARNING")
        xla_bwd = jax.jit(lambda w, ids, g: jax.vjp(lambda w: xla_take_sum(w, ids), w)[1](g)[0])
        gx_sets = [(weights, jnp.asarray(ids), g) for ids, (_, _, _, g) in zip(id_sets, g_sets)]
        # Both dense gradients at once do not fit beside 16 GB tables: compare the small config only.
        diff = max_abs_diff(bwd(*g_sets[0]), xla_bwd(*gx_sets[0])) if t * e * d < 2**30 else None
        btimes = jax_times({"jaxrec": (bwd, g_sets), "jaxrec_bounds_check_none": (bwd_of("NONE"), g_sets),
                            "xla_scatter_add": (xla_bwd, gx_sets)}, iters)
        brow = dict(config=cfg["name"] + "_dense_backward", **{k: cfg[k] for k in "TEDBL"},
                    weights=jnp.dtype(dtype).name, ids=dist, max_abs_diff_vs_xla=diff,
                    bytes=lookup_bytes(b, [d] * t, [b * l] * t) + 4 * t * e * d,
                    ms={k: v * 1e3 for k, v in btimes.items()},
                    speedup_of_jaxrec={k: v / btimes["jaxrec"] for k, v in btimes.items() if k != "jaxrec"})
        brow["GB_per_s"] = {k: brow["bytes"] / v / 1e9 for k, v in btimes.items()}
        record(brow)
    del weights, flat_sets, grouped_sets


def bench_jagged(rng, name, rows, dims, b, max_len, iters, record, torch):
    """Per-table rows and dims, jagged bag lengths U[0, max_len]."""
    t = len(rows)
    layout = TableLayout.from_embedding_specs(list(zip(rows, dims)))
    weights = init_weights(jax.random.key(1), layout)
    tables = layout.split_embedding_weights(weights)
    sets, nbytes = [], []
    for _ in range(NUM_ID_SETS):
        lengths = rng.integers(0, max_len + 1, size=(t, b))
        ids = [rng.integers(0, rows[f], size=int(lengths[f].sum())).astype(np.int32) for f in range(t)]
        sets.append((lengths, ids))
        nbytes.append(lookup_bytes(b, dims, [int(lengths[f].sum()) for f in range(t)]))
    nbytes = float(np.mean(nbytes))
    flat_sets, table_sets = [], []
    for lengths, ids in sets:
        offsets = np.concatenate([[0], np.cumsum(lengths.reshape(-1))]).astype(np.int32)
        flat_sets.append((weights, jnp.asarray(np.concatenate(ids)), jnp.asarray(offsets)))
        segs = [jnp.asarray(np.repeat(np.arange(b), lengths[f]).astype(np.int32)) for f in range(t)]
        table_sets.append((tables, [jnp.asarray(i) for i in ids], segs))

    lookup = jax.jit(lambda w, i, o: embedding_bag_lookup(w, i, o, layout=layout))
    lookup_none = jax.jit(lambda w, i, o: embedding_bag_lookup(w, i, o, layout=layout, bounds_check_mode="NONE"))

    def xla_per_table(tables, ids, segs):
        return jnp.concatenate([jax.ops.segment_sum(tb[i], s, num_segments=b)
                                for tb, i, s in zip(tables, ids, segs)], axis=1)

    times = jax_times({"jaxrec": (lookup, flat_sets), "jaxrec_bounds_check_none": (lookup_none, flat_sets),
                       "xla_per_table_segment_sum": (jax.jit(xla_per_table), table_sets)}, iters)
    diff = max_abs_diff(lookup(*flat_sets[0]), jax.jit(xla_per_table)(*table_sets[0]))
    if torch is not None:
        ttables = [torch.from_dlpack(tb) for tb in tables]
        tsets = []
        for lengths, ids in sets:
            tsets.append([(torch.from_dlpack(jnp.asarray(i)).long(),
                           torch.from_dlpack(jnp.asarray(
                               np.concatenate([[0], np.cumsum(lengths[f])]).astype(np.int32))).long())
                          for f, i in enumerate(ids)])

        def torch_per_table(pairs):
            return torch.cat([torch.nn.functional.embedding_bag(i, tb, o, mode="sum", include_last_offset=True)
                              for tb, (i, o) in zip(ttables, pairs)], dim=1)

        times["torch_per_table_embedding_bag"] = torch_time(torch, torch_per_table, [(s,) for s in tsets], iters)
    row = dict(config=name, T=t, B=b, dims=sorted(set(dims)), max_len=max_len, weights="float32",
               ids="uniform", bytes=nbytes, max_abs_diff_vs_xla=diff,
               ms={k: v * 1e3 for k, v in times.items()},
               GB_per_s={k: nbytes / v / 1e9 for k, v in times.items()},
               speedup_of_jaxrec={k: v / times["jaxrec"] for k, v in times.items() if k != "jaxrec"})
    record(row)


def copy_ceiling(iters):
    x = jnp.asarray(np.random.default_rng(0).random(2**29, dtype=np.float32))  # 2 GiB
    t = jax_time(jax.jit(lambda x: x * 1.5), [(x,)], iters)
    return 2 * x.nbytes / t / 1e9


def _torch_peer() -> tuple[Any, dict[str, str]]:
    torch, note = optional_import("torch")
    if torch is not None and not torch.cuda.is_available():
        torch, note = None, f"torch {torch.__version__} sees no CUDA GPU; its peer was skipped"
    return torch, ({"torch": note} if note else {})


def tbe_gpu(*, quick: bool = False, only: Sequence[str] | None = None, out=None,
            log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Runs the GPU benchmark; returns the result (the JSON written to `out`, if given).

    quick: the cases of QUICK_CASES with 20 calls per repeat instead of 50. only: the
    cases to run, in this order (names from CASES). The file is rewritten after every
    case, so that a failure keeps what was measured. log: receives one line per case.
    """
    cases = list(only) if only else list(QUICK_CASES if quick else CASES)
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ValueError(f"unknown GPU benchmark case(s) {unknown}; choose from {list(CASES)}")
    torch, skipped = _torch_peer()
    rng = np.random.default_rng(0)
    iters = 20 if quick else 50
    results = []
    ceiling = copy_ceiling(iters)
    log(f"device-to-device copy ceiling: {ceiling:.0f} GB/s")
    info = dict(environment("tbe_gpu", jax.devices()[0].device_kind, {"torch": torch}, skipped),
                driver=nvidia_driver(), copy_ceiling_GB_per_s=ceiling, quick=quick, results=results,
                method=METHOD)

    def record(row):  # saved after every config, so that a failure keeps what was measured
        results.append(row)
        log(gpu_line(row))
        if out is not None:
            write_json(out, info)

    big = dict(name="T32_E1e6_B4096", T=32, E=1_000_000, D=128, B=4096, L=20)
    huge = dict(name="T2_E1e7_D192_B65536", T=2, E=10_000_000, D=192, B=65536, L=32)
    mixed_dims = [(16, 32, 64, 128, 256)[i % 5] for i in range(26)]
    runs = {
        "fbgemm_default": lambda: bench_fixed(
            rng, dict(name="fbgemm_default", T=32, E=100_000, D=128, B=512, L=20), jnp.float32,
            "uniform", iters, record, backward=True, torch=torch),
        # Dense backward only on the small config: back-to-back 16 GB gradients exhaust the GPU.
        "large": lambda: bench_fixed(rng, big, jnp.float32, "uniform", iters, record, False, torch),
        "huge": lambda: bench_fixed(rng, huge, jnp.float32, "uniform", iters, record, False, torch),
        "jagged": lambda: bench_jagged(rng, "jagged_T32_E1e6_D128", [1_000_000] * 32, [128] * 32,
                                       4096, 40, iters, record, torch),
        "criteo": lambda: bench_jagged(rng, "criteo_26_mixed_dims",
                                       [min(r, 2_000_000) for r in CRITEO_ROWS], mixed_dims, 4096,
                                       40, iters, record, torch),
        "zipf": lambda: bench_fixed(rng, big, jnp.float32, "zipf", iters, record, False, torch),
        "bf16": lambda: bench_fixed(rng, big, jnp.bfloat16, "uniform", iters, record, False, torch),
        "fp16": lambda: bench_fixed(rng, big, jnp.float16, "uniform", iters, record, False, torch),
    }
    for name in cases:
        runs[name]()
    return info


def tbe_gpu_script(argv: list[str] | None = None) -> int:
    """``python benchmarks/tbe_gpu.py --out FILE [--quick] [--only CASE ...]``."""
    share_gpu_with_torch()
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--out", required=True, help="the JSON file, rewritten after every case")
    parser.add_argument("--quick", action="store_true", help="small configs only (smoke test)")
    parser.add_argument("--only", nargs="+", choices=CASES, metavar="CASE",
                        help=f"configs to run, in this order (default: all): {', '.join(CASES)}")
    args = parser.parse_args(argv)
    tbe_gpu(quick=args.quick, only=args.only, out=args.out, log=lambda line: print(line, flush=True))
    print(f"wrote {args.out}")
    return 0
