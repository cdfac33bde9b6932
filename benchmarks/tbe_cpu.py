"""CPU TBE side by side: jaxrec's C++ handlers, plain XLA on the CPU, FBGEMM's CPU TBE.

    python benchmarks/tbe_cpu.py [--configs 8,32] [--iters 30] [--out benchmarks/results/...json]

One process, the peers timed round-robin (one iteration each in turn, so they share
whatever else the machine does); fp32 tables of E rows x D, T features (one table
each), B samples, fixed bag length L, uniform random ids, a fresh id set for every
timed iteration (a few sets pre-generated and rotated), median of --iters after warm-up.

* forward: jaxrec (jit'd ffi_call of jaxrec_tbe_forward); XLA (jnp.take + sum over L);
  FBGEMM (SplitTableBatchedEmbeddingBagsCodegen, HOST/CPU, bounds check off since
  jaxrec's kernel does not check either, and with its default WARNING check).
* forward + backward: jaxrec (forward + jaxrec_tbe_backward, the dense fp32 gradient of
  the flat buffer); XLA (jax.grad of the jnp forward, also dense); FBGEMM (forward +
  backward with EXACT_SGD, which updates the touched rows in place: no dense gradient).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec import _ffi

NUM_ID_SETS = 4


def register():
    if not _ffi.has_kernel("cpu"):  # registers jaxrec_tbe_forward / _backward for the CPU
        raise SystemExit("jaxrec was built without its CPU library; see jaxrec.build_info()")


def interleaved_medians(steps, num_inputs, iters, warmup=3):
    """steps: {name: fn(i)} (fn runs with id set i and blocks until done).

    The peers run round-robin, one iteration each in turn, so that they share whatever
    else the machine is doing; returns {name: median ms}.
    """
    for i in range(warmup):
        for fn in steps.values():
            fn(i % num_inputs)
    times = {name: [] for name in steps}
    for i in range(iters):
        for name, fn in steps.items():
            start = time.perf_counter()
            fn(i % num_inputs)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def packed_layout(T, E, D):
    values = [t * E * D for t in range(T)] + [D] * T + [E] * T + [t * D for t in range(T + 1)]
    return np.array(values, np.int64).view(np.int32)


def jaxrec_and_xla_steps(cfg, weights_np, id_sets, cotangent):
    T, E, D, B, L = (cfg[k] for k in "TEDBL")
    weights = jnp.asarray(weights_np)
    layout = jnp.asarray(packed_layout(T, E, D))
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
    np.testing.assert_allclose(jaxrec_fwd(*ids[0]), xla_fwd(*ids[0]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(jaxrec_fwd_bwd(*ids[0]), xla_fwd_bwd(*ids[0]), rtol=1e-4, atol=1e-4)
    block = jax.block_until_ready
    return {
        "jaxrec_forward_ms": lambda i: block(jaxrec_fwd(*ids[i])),
        "xla_forward_ms": lambda i: block(xla_fwd(*ids[i])),
        "jaxrec_forward_backward_ms": lambda i: block(jaxrec_fwd_bwd(*ids[i])),
        "xla_forward_backward_ms": lambda i: block(xla_fwd_bwd(*ids[i])),
    }


def fbgemm_steps(cfg, weights_np, id_sets, cotangent):
    import torch
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, OptimType, SplitTableBatchedEmbeddingBagsCodegen)

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


def machine_info():
    model = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    info = {"cpu_model": model, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "jax": jax.__version__,
            "load_average_at_end": os.getloadavg()}
    try:  # the dense backward gains most where transparent huge pages are on or `madvise`
        info["transparent_hugepage"] = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        pass
    import jaxlib
    info["jaxlib"] = jaxlib.__version__
    try:
        import fbgemm_gpu
        import torch
        info.update(torch=torch.__version__, fbgemm_gpu=fbgemm_gpu.__version__,
                    torch_threads=torch.get_num_threads())
    except ImportError:
        pass
    return info


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="8,32", help="comma-separated T values (E=1e5, D=128, B=512, L=20)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--no-fbgemm", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    register()
    rng = np.random.default_rng(0)
    runs = []
    for T in (int(t) for t in args.configs.split(",")):
        cfg = dict(T=T, E=100_000, D=128, B=512, L=20, dtype="float32", ids="uniform")
        T, E, D, B, L = (cfg[k] for k in "TEDBL")
        weights = rng.uniform(-0.01, 0.01, T * E * D).astype(np.float32)
        id_sets = [rng.integers(0, E, T * B * L, dtype=np.int32) for _ in range(NUM_ID_SETS)]
        cotangent = rng.standard_normal((B, T * D)).astype(np.float32)
        steps = jaxrec_and_xla_steps(cfg, weights, id_sets, cotangent)
        if not args.no_fbgemm:
            fb_steps, fb_out = fbgemm_steps(cfg, weights, id_sets, cotangent)
            jaxrec_out = np.asarray(jax.jit(lambda w, i: jax.ffi.ffi_call(
                "jaxrec_tbe_forward", jax.ShapeDtypeStruct((B, T * D), jnp.float32))(
                w, i, jnp.arange(T * B + 1, dtype=jnp.int32) * L, jnp.zeros((0,), jnp.float32),
                jnp.asarray(packed_layout(T, E, D)), pooling=np.int32(0)))(weights, id_sets[0]))
            np.testing.assert_allclose(jaxrec_out, fb_out, rtol=1e-4, atol=1e-5)
            steps.update(fb_steps)
        del weights
        times = interleaved_medians(steps, NUM_ID_SETS, args.iters)
        del steps
        ratios = {"xla_forward / jaxrec_forward": times["xla_forward_ms"] / times["jaxrec_forward_ms"],
                  "xla_forward_backward / jaxrec_forward_backward":
                      times["xla_forward_backward_ms"] / times["jaxrec_forward_backward_ms"]}
        if "fbgemm_forward_ms" in times:
            ratios["fbgemm_forward / jaxrec_forward"] = times["fbgemm_forward_ms"] / times["jaxrec_forward_ms"]
            ratios["fbgemm_forward_backward_sgd / jaxrec_forward_backward"] = (
                times["fbgemm_forward_backward_sgd_ms"] / times["jaxrec_forward_backward_ms"])
        gb = (4 * B * T * D + 4 * B * T * D * L) / 1e9
        runs.append({"config": cfg, "times_ms": times, "ratios": ratios,
                     "jaxrec_forward_GB_per_s": gb / (times["jaxrec_forward_ms"] / 1e3)})
        print(json.dumps(runs[-1], indent=1), flush=True)
    result = {"date": datetime.date.today().isoformat(), "machine": machine_info(), "iters": args.iters,
              "id_sets": NUM_ID_SETS, "runs": runs}
    out = Path(args.out or Path(__file__).parent / "results" / f"tbe_cpu_{result['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
