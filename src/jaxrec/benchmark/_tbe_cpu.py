"""CPU TBE side by side: jaxrec's C++ handlers, plain XLA on the CPU, FBGEMM's CPU TBE.

One process, the peers timed round-robin (one iteration each in turn, so they share
whatever else the machine does); fp32 tables of E rows x D, T features (one table
each), B samples, fixed bag length L, uniform random ids, a fresh id set for every
timed iteration (a few sets pre-generated and rotated), median of `iters` after warm-up.

* forward: jaxrec (jit'd ffi_call of jaxrec_tbe_forward); XLA (jnp.take + sum over L);
  FBGEMM (SplitTableBatchedEmbeddingBagsCodegen, HOST/CPU, bounds check off since
  jaxrec's kernel does not check either, and with its default WARNING check).
* forward + backward: jaxrec (forward + jaxrec_tbe_backward, the dense fp32 gradient of
  the flat buffer); XLA (jax.grad of the jnp forward, also dense); FBGEMM (forward +
  backward with EXACT_SGD, which updates the touched rows in place: no dense gradient).

Before timing, each case checks that the peers compute what jaxrec computes (same
output shape, values within RTOL/ATOL) and records the check under "check".
"""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec import _ffi
from jaxrec.benchmark._environment import cpu_model, environment, machine_info, optional_import
from jaxrec.benchmark._measure import NUM_ID_SETS, interleaved_medians, lookup_bytes
from jaxrec.benchmark._report import cpu_line, write_json
from jaxrec.ops import TableLayout

SHAPE = dict(E=100_000, D=128, B=512, L=20)
"""Rows per table, dimension, batch and bag length of a full run (T varies)."""
DEFAULT_TS, DEFAULT_ITERS = (8, 32), 30
QUICK_CONFIG, QUICK_ITERS = dict(T=4, E=10_000, D=64, B=128, L=10), 10
# Float32 rounding of the pooled sums: a bag of L <= 20 ids of U(-0.01, 0.01) weights
# is off by at most ~L * eps32 * sum|w| = 20 * 1.2e-7 * 0.2 ~ 5e-7 whatever the order
# of the additions; the dense gradients are sums of a few N(0, 1) cotangents (rtol).
RTOL, ATOL = 1e-5, 1e-6


def cpu_config(T: int, **shape: int) -> dict[str, Any]:
    """A case: T features over the full-run shape (or `shape`), fp32, uniform ids."""
    return dict(T=T, **{**SHAPE, **shape}, dtype="float32", ids="uniform")


def _max_abs_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def jaxrec_and_xla_steps(cfg, weights_np, id_sets, cotangent):
    """({name: step(i)}, jaxrec's forward output on set 0, the check against XLA)."""
    T, E, D, B, L = (cfg[k] for k in "TEDBL")
    weights = jnp.asarray(weights_np)
    layout = jnp.asarray(TableLayout(rows=(E,) * T, dims=(D,) * T, feature_table_map=tuple(range(T))).packed())
    offsets = jnp.arange(T * B + 1, dtype=jnp.int32) * L
    psw = jnp.zeros((0,), jnp.float32)
    g = jnp.asarray(cotangent)
    fwd_call = jax.ffi.ffi_call("jaxrec_tbe_forward", jax.ShapeDtypeStruct((B, T * D), jnp.float32))
    bwd_call = jax.ffi.ffi_call("jaxrec_tbe_backward", (jax.ShapeDtypeStruct(weights.shape, jnp.float32),
                                                        jax.ShapeDtypeStruct((0,), jnp.float32)))

    @jax.jit
    def jaxrec_fwd(w, ids):
        return fwd_call(w, ids, offsets, psw, layout, pooling=np.int32(0))

    @jax.jit
    def jaxrec_fwd_bwd(w, ids):
        out = fwd_call(w, ids, offsets, psw, layout, pooling=np.int32(0))
        # d/dW of sum(out * g): the cotangent of out is g (out is computed, as in training).
        grad, _ = bwd_call(g + 0.0 * out, w, ids, offsets, psw, layout, pooling=np.int32(0))
        return grad

    # ids: feature-major [T*B*L], ids of feature t index table t.
    table_base = (jnp.arange(T, dtype=jnp.int32) * E)[:, None, None]

    def xla_forward(w, ids):
        rows = jnp.take(w.reshape(T * E, D), ids.reshape(T, B, L) + table_base, axis=0)  # [T, B, L, D]
        return rows.sum(axis=2).transpose(1, 0, 2).reshape(B, T * D)

    xla_fwd = jax.jit(xla_forward)
    xla_fwd_bwd = jax.jit(jax.grad(lambda w, ids: jnp.sum(xla_forward(w, ids) * g)))

    ids = [(weights, jnp.asarray(s)) for s in id_sets]
    # Same results (the comparison is only meaningful if both compute the same thing).
    out, xla_out = np.asarray(jaxrec_fwd(*ids[0])), np.asarray(xla_fwd(*ids[0]))
    grad, xla_grad = np.asarray(jaxrec_fwd_bwd(*ids[0])), np.asarray(xla_fwd_bwd(*ids[0]))
    np.testing.assert_allclose(out, xla_out, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, xla_grad, rtol=RTOL, atol=ATOL)
    check = {"output_shape": {"jaxrec": list(out.shape), "xla": list(xla_out.shape)},
             "max_abs_diff": {"xla_forward": _max_abs_diff(out, xla_out),
                              "xla_forward_backward": _max_abs_diff(grad, xla_grad)},
             "rtol": RTOL, "atol": ATOL}
    block = jax.block_until_ready
    steps = {
        "jaxrec_forward_ms": lambda i: block(jaxrec_fwd(*ids[i])),
        "xla_forward_ms": lambda i: block(xla_fwd(*ids[i])),
        "jaxrec_forward_backward_ms": lambda i: block(jaxrec_fwd_bwd(*ids[i])),
        "xla_forward_backward_ms": lambda i: block(xla_fwd_bwd(*ids[i])),
    }
    return steps, out, check


def fbgemm_steps(cfg, weights_np, id_sets, cotangent):
    import torch
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        OptimType,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    T, E, D, B, L = (cfg[k] for k in "TEDBL")
    offsets = torch.arange(T * B + 1, dtype=torch.int64) * L
    g = torch.from_numpy(cotangent)
    ids = [torch.from_numpy(s.astype(np.int64)) for s in id_sets]
    modules = {}
    for check in (BoundsCheckMode.NONE, BoundsCheckMode.WARNING):
        # EXACT_SGD with learning rate 0: the backward runs, the tables stay equal to jaxrec's.
        emb = SplitTableBatchedEmbeddingBagsCodegen(
            [(E, D, EmbeddingLocation.HOST, ComputeDevice.CPU)] * T, optimizer=OptimType.EXACT_SGD,
            learning_rate=0.0, bounds_check_mode=check)
        with torch.no_grad():
            emb.weights_host.copy_(torch.from_numpy(weights_np))
        modules[check] = emb
    unchecked, checked = modules[BoundsCheckMode.NONE], modules[BoundsCheckMode.WARNING]

    def forward(emb, i):
        with torch.no_grad():
            return emb(ids[i], offsets)

    def forward_backward(i):
        unchecked(ids[i], offsets).backward(g)

    with torch.no_grad():
        first_output = unchecked(ids[0], offsets).numpy()
    steps = {"fbgemm_forward_ms": lambda i: forward(unchecked, i),
             "fbgemm_forward_checked_ms": lambda i: forward(checked, i),
             "fbgemm_forward_backward_sgd_ms": forward_backward}
    return steps, first_output


def tbe_cpu(*, configs: Sequence[dict[str, Any]] | None = None, iters: int = DEFAULT_ITERS,
            fbgemm: bool = True, log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Runs the CPU benchmark on JAX's CPU device; returns the result (the JSON of a run).

    configs: cases from :func:`cpu_config` (default: T = 8 and 32 at the full-run shape).
    fbgemm: whether to time FBGEMM's CPU TBE (skipped with a note when it does not import).
    log: receives one line per case.
    """
    if not _ffi.has_kernel("cpu"):  # registers jaxrec_tbe_forward / _backward for the CPU
        raise RuntimeError("jaxrec was built without its CPU library (jaxrec.build_info()['cpu'] "
                           "is False); rebuild it: `pip install --no-build-isolation .`")
    configs = list(configs) if configs is not None else [cpu_config(T) for T in DEFAULT_TS]
    fbgemm_gpu, note = optional_import("fbgemm_gpu") if fbgemm else (None, "disabled (--no-fbgemm)")
    torch = optional_import("torch")[0] if fbgemm_gpu is not None else None
    skipped = {"fbgemm": note} if note else {}
    rng = np.random.default_rng(0)
    runs = []
    with jax.default_device(jax.devices("cpu")[0]):
        for cfg in configs:
            runs.append(_run_case(rng, cfg, iters, fbgemm_gpu is not None))
            log(cpu_line(runs[-1]))
    return {**environment("tbe_cpu", cpu_model(), {"torch": torch, "fbgemm_gpu": fbgemm_gpu}, skipped),
            "machine": machine_info(), "iters": iters, "id_sets": NUM_ID_SETS, "runs": runs}


def _run_case(rng, cfg, iters, with_fbgemm):
    T, E, D, B, L = (cfg[k] for k in "TEDBL")
    weights = rng.uniform(-0.01, 0.01, T * E * D).astype(np.float32)
    id_sets = [rng.integers(0, E, T * B * L, dtype=np.int32) for _ in range(NUM_ID_SETS)]
    cotangent = rng.standard_normal((B, T * D)).astype(np.float32)
    steps, jaxrec_out, check = jaxrec_and_xla_steps(cfg, weights, id_sets, cotangent)
    if with_fbgemm:
        fb_steps, fb_out = fbgemm_steps(cfg, weights, id_sets, cotangent)
        np.testing.assert_allclose(jaxrec_out, fb_out, rtol=RTOL, atol=ATOL)
        check["output_shape"]["fbgemm"] = list(fb_out.shape)
        check["max_abs_diff"]["fbgemm_forward"] = _max_abs_diff(jaxrec_out, fb_out)
        steps.update(fb_steps)
    del weights
    times = interleaved_medians(steps, NUM_ID_SETS, iters)
    del steps
    ratios = {"xla_forward / jaxrec_forward": times["xla_forward_ms"] / times["jaxrec_forward_ms"],
              "xla_forward_backward / jaxrec_forward_backward":
                  times["xla_forward_backward_ms"] / times["jaxrec_forward_backward_ms"]}
    if "fbgemm_forward_ms" in times:
        ratios["fbgemm_forward / jaxrec_forward"] = times["fbgemm_forward_ms"] / times["jaxrec_forward_ms"]
        ratios["fbgemm_forward_backward_sgd / jaxrec_forward_backward"] = (
            times["fbgemm_forward_backward_sgd_ms"] / times["jaxrec_forward_backward_ms"])
    gb = lookup_bytes(B, [D] * T, [B * L] * T) / 1e9
    return {"config": cfg, "times_ms": times, "ratios": ratios, "check": check,
            "jaxrec_forward_GB_per_s": gb / (times["jaxrec_forward_ms"] / 1e3)}


def tbe_cpu_script(argv: list[str] | None = None, *, results_dir: str | Path = "results") -> int:
    """``python benchmarks/tbe_cpu.py [--configs 8,32] [--iters 30] [--no-fbgemm] [--quick] [--out FILE]``.

    Without --out the JSON goes to `results_dir`/tbe_cpu_<date>.json.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(map(str, DEFAULT_TS)),
                        help="comma-separated T values (E=1e5, D=128, B=512, L=20)")
    parser.add_argument("--iters", type=int, default=None, help=f"default {DEFAULT_ITERS} ({QUICK_ITERS} with --quick)")
    parser.add_argument("--no-fbgemm", action="store_true")
    parser.add_argument("--quick", action="store_true", help=f"one small case {QUICK_CONFIG} (a smoke test)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        configs, iters = [cpu_config(**QUICK_CONFIG)], QUICK_ITERS
    else:
        configs, iters = [cpu_config(int(t)) for t in args.configs.split(",")], DEFAULT_ITERS
    result = tbe_cpu(configs=configs, iters=args.iters or iters, fbgemm=not args.no_fbgemm,
                     log=lambda line: print(line, flush=True))
    out = Path(args.out or Path(results_dir) / f"tbe_cpu_{datetime.date.today().isoformat()}.json")
    write_json(out, result)
    print("wrote", out)
    return 0
