"""The fused update alone, to compare two builds of jaxrec on one machine, one after the other:

    python benchmarks/fused_update_builds_ab.py OUT.json [--shape fbgemm_default|zipf] [NAME ...]  # under each build

``jaxrec.fused.fused_update`` (weights and state donated, bounds check NONE) for SGD,
rowwise Adagrad, Adam, Adagrad and LAMB at the shape of issue 20's table (T=32 tables of E=1e6 rows,
D=128, B=4096, L=20 uniform ids with duplicates; float32 weights, and three 16-bit cases), or with
``--shape fbgemm_default`` at FBGEMM's default benchmark shape (E=1e5, B=512), or with ``--shape zipf``
at a DLRM step's (T=26, E=1e5, B=16384, one Zipf(1.2) id a bag): median of 5 repeats of 20
back-to-back calls after 8 warm-up calls, rotating among 4 id sets. It checks that the
weights stay finite. Used for the kept-row check (csrc/common/fused_optimizer.h,
``RowStaysFinite``): benchmarks/results/fused_update_nonfinite_check_h100_2026-11-26.json, and
for the kernels that optimizers of one state layout share (``KernelOf``):
benchmarks/results/fused_update_shared_kernels_<device>_<date>.json; for a kernel per weight
dtype against one reading weights at their runtime dtype:
benchmarks/results/fused_update_weight_dtype_ab_h100_2026-11-26.json; for the sort inside the
handler: benchmarks/results/fused_update_sort_in_handler_<device>_2026-11-28.json.
"""
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec import optim
from jaxrec.fused import fused_update
from jaxrec.ops import TableLayout

SHAPES = {"default": (32, 10**6, 128, 4096, 20), "fbgemm_default": (32, 10**5, 128, 512, 20),  # T, E, D, B, L
          "zipf": (26, 10**5, 128, 16384, 1)}  # Zipf(1.2) ids: long runs of one row (a DLRM step's)
args = sys.argv[2:]
shape = "default"
if args[:1] == ["--shape"]:
    shape, args = args[1], args[2:]
T, E, D, B, L = SHAPES[shape]
layout = TableLayout(rows=(E,) * T, dims=(D,) * T, feature_table_map=tuple(range(T)))
rng = np.random.default_rng(0)
draw = ((lambda n: (rng.zipf(1.2, n) - 1) % E) if shape == "zipf" else (lambda n: rng.integers(0, E, n)))
ids = [jnp.asarray(draw(T * B * L).astype(np.int32)) for _ in range(4)]
offsets = jnp.arange(T * B + 1, dtype=jnp.int32) * L
g = jnp.asarray(rng.normal(size=(B, T * D)).astype(np.float32))
res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "shape": dict(zip("TEDBL", SHAPES[shape])),
       "ms": {}}
CONFIGS = [  # name, optimizer, weight dtype
    ("sgd", optim.SGD(learning_rate=0.01), jnp.float32),
    ("rowwise_adagrad", optim.RowWiseAdagrad(learning_rate=0.01), jnp.float32),
    ("adam", optim.Adam(learning_rate=0.01), jnp.float32),
    ("adagrad", optim.Adagrad(learning_rate=0.01), jnp.float32),
    ("lamb", optim.LAMB(learning_rate=0.01), jnp.float32),
    ("sgd_bf16", optim.SGD(learning_rate=0.01), jnp.bfloat16),
    ("rowwise_adagrad_bf16_sr", optim.RowWiseAdagrad(learning_rate=0.01, stochastic_rounding=True), jnp.bfloat16),
    ("adam_f16", optim.Adam(learning_rate=0.01), jnp.float16)]
for name, cfg, weight_dtype in CONFIGS:
    if args and name not in args:  # only the configurations named
        continue
    w = jax.random.uniform(jax.random.key(1), (layout.num_weights,), jnp.float32, -0.1, 0.1).astype(weight_dtype)
    s = optim.init_state(cfg, layout)
    step = jax.jit(lambda w, s, i, cfg=cfg: fused_update(w, s, g, i, offsets, layout=layout, config=cfg,
                                                          bounds_check_mode="NONE"), donate_argnums=(0, 1))
    for k in range(8):
        w, s = step(w, s, ids[k % 4])
    jax.block_until_ready(w)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for k in range(20):
            w, s = step(w, s, ids[k % 4])
        jax.block_until_ready(w)
        times.append((time.perf_counter() - t0) / 20 * 1e3)
    res["ms"][name] = statistics.median(times)
    assert bool(jnp.isfinite(w).all())
    del w, s
print(json.dumps(res))
json.dump(res, open(sys.argv[1], "w"), indent=1)
