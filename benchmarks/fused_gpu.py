"""The fused TBE backward + optimizer on the GPU, side by side in one process with plain
XLA (an exact rowwise Adagrad written in jnp, a scatter-add SGD) and PyTorch's sparse
optimizers.

    python benchmarks/fused_gpu.py --out benchmarks/results/fused_gpu_<device>.json
                                   [--quick] [--only default,fbgemm_default,table_sweep,no_donation]

Per case (fp32 tables of E rows x D, T features of one table each, B samples, fixed
bags of L uniform random ids, duplicates included):

* forward: ``embedding_bag_lookup`` alone.
* fused_<opt>: ``jaxrec.fused.fused_update`` alone (the backward with the optimizer fused
  in), weights and state donated, from a precomputed random ``grad_output``.
* sort_keys: XLA's sort of the same (row key, position) pairs (bags, row keys, their sort;
  ``sort_by_row_reference``, what the dense backward runs), with whether the compiled sort is
  CUB's radix sort. The fused update sorts inside its handler, a part of fused_<opt>.
* step_<opt>: a whole step from ``make_functional_train_step`` (donated): fused lookup, a small dense
  part (loss = mean((acts @ v)^2), optax SGD on v), the fused update of the tables.
* peers, each a whole step of the same loss, jitted and donated: jax_exact_rowwise_adagrad
  (jnp.take forward, per-position gradient rows, jnp.unique + segment_sum to merge
  duplicates, rowwise Adagrad, .at[].set back), xla_scatter_sgd (.at[].add of -lr * rows
  into the table) and, when PyTorch sees a GPU, torch_sparse_{sgd,adagrad,adam}
  (nn.EmbeddingBag(sparse=True) per table + SGD / Adagrad / SparseAdam).

Timing as benchmarks/tbe_gpu.py: median of 5 repeats of `iters` back-to-back calls after
warm-up, requests rotating among 4 pre-generated id sets (donated buffers are threaded
from call to call). The forward and the steps run the default bounds check (WARNING), as users
call them, with NONE beside them (``*_bounds_check_none``); ``fused_*`` (the backward alone) runs
NONE, since its explicit form would check the ids again. Bytes (as FBGEMM counts them): forward =
4*B*sum(D) + 4*B*sum(D)*L; fused backward = grad_output read (4*B*sum(D)) + unique rows
read and written (2*U*D*4) + optimizer state read and written (2*U*4 for rowwise Adagrad,
2*2*U*D*4 for Adam), U = unique (table, row) pairs of the id set (numpy).

Memory: XLA's allocator never hands memory back, so PyTorch's peers run first, for every
case (their memory is released with empty_cache), then jaxrec and XLA; cases run
largest table first (1e8 x 128 fp32 is 51 GB) whatever the order of --only. JAX may take
90% of the GPU (XLA_PYTHON_CLIENT_MEM_FRACTION, unless set). A measurement that fails
(out of memory, say) is recorded under "skipped" with its error and the rest goes on.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import re
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # PyTorch shares the GPU
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxrec  # noqa: E402
from jaxrec.benchmark import NUM_ID_SETS as SETS  # noqa: E402
from jaxrec.benchmark._environment import nvidia_driver  # noqa: E402
from jaxrec.benchmark._measure import timed  # noqa: E402
from jaxrec.fused import (  # noqa: E402
    FusedEmbeddingTables,
    fused_lookup,
    fused_update,
    make_functional_train_step,
)
from jaxrec.ops import TableLayout, embedding_bag_lookup  # noqa: E402
from jaxrec.ops.row_sort import sort_by_row_reference  # noqa: E402
from jaxrec.optim import SGD, Adam, RowWiseAdagrad, init_state  # noqa: E402

try:
    import torch
except ImportError:  # the peer is optional
    torch = None

LR, EPS, DENSE_LR = 0.01, 1e-8, 0.01
OPTIMIZERS = {"sgd": SGD(learning_rate=LR), "rowwise_adagrad": RowWiseAdagrad(learning_rate=LR, eps=EPS),
              "adam": Adam(learning_rate=LR, eps=EPS)}
STATE_FLOATS_PER_ROW = {"sgd": lambda d: 0, "rowwise_adagrad": lambda d: 1, "adam": lambda d: 2 * d}
TARGETS = {  # name: (numerator, denominator, comparison, target)
    "bwd_fused_rowwise_adagrad / forward": ("fused_rowwise_adagrad", "forward", "<=", 2.5),
    "jax_exact_rowwise_adagrad / step_rowwise_adagrad": ("jax_exact_rowwise_adagrad", "step_rowwise_adagrad",
                                                         ">=", 4.0),
    "torch_sparse_sgd / step_rowwise_adagrad": ("torch_sparse_sgd", "step_rowwise_adagrad", ">=", 5.0),
    "xla_scatter_sgd / step_sgd": ("xla_scatter_sgd", "step_sgd", None, None),
    "torch_sparse_adagrad / step_rowwise_adagrad": ("torch_sparse_adagrad", "step_rowwise_adagrad", None, None),
    "torch_sparse_adam / step_adam": ("torch_sparse_adam", "step_adam", None, None),
}


def sci(x):
    """1e+08 -> 1e8."""
    return f"{x:.0e}".replace("e+0", "e").replace("e+", "e")


def case(config, t, e, d, b, l, iters, fused=(), steps=(), peers=(), torch_opts=(), no_donation=False):
    name = f"{config}_T{t}_E{sci(e)}_D{d}_B{b}_L{l}"
    return dict(config=config, name=name, T=t, E=e, D=d, B=b, L=l, iters=iters, fused=fused,
                steps=steps, peers=peers, torch_opts=torch_opts, no_donation=no_donation,
                seed=(t * 1_000_003 + e * 7 + d * 131 + b * 8191 + l) % 2**31)


def cases(quick):
    """{config: [case, ...]} in run order: the largest tables first (see the module doc)."""
    if quick:
        t, e, d, b, l, iters = 4, 1000, 16, 64, 5, 3
        sweep_rows, sweep_b, big_e = (100, 1000, 10_000, 100_000), 256, 10_000
    else:
        t, e, d, b, l, iters = 32, 10**6, 128, 4096, 20, 20
        sweep_rows, sweep_b, big_e = (10**5, 10**6, 10**7, 10**8), 65536, 10**7
    few = max(iters // 2, 3)  # the large cases
    peers = ("jax_exact_rowwise_adagrad", "xla_scatter_sgd")
    return {
        "table_sweep": [case("table_sweep", 1, r, d, sweep_b, l, few, fused=("rowwise_adagrad",),
                             steps=("rowwise_adagrad",), peers=peers, torch_opts=("sgd",))
                        for r in sorted(sweep_rows, reverse=True)],
        "default": [case("default", t, e, d, b, l, iters, fused=tuple(OPTIMIZERS), steps=tuple(OPTIMIZERS),
                         peers=peers, torch_opts=("sgd", "adagrad", "adam"))],
        # FBGEMM's benchmark default shape (E=1e5, B=512), reported beside the default one.
        "fbgemm_default": [case("fbgemm_default", t, max(e // 10, 1), d, max(b // 8, 1), l, iters,
                                fused=("rowwise_adagrad",), steps=("rowwise_adagrad",), peers=(),
                                torch_opts=())],
        # 32 tables of 1e7 rows would be 164 GB: 4 of them at E=1e7 (1 in --quick).
        "no_donation": [case("no_donation", t, e, d, b, l, few, no_donation=True),
                        case("no_donation", max(t // 8, 1), big_e, d, b, l, few, no_donation=True)],
    }


def id_sets(c):
    rng = np.random.default_rng(c["seed"])
    return [rng.integers(0, c["E"], size=(c["T"], c["B"], c["L"])).astype(np.int32) for _ in range(SETS)]


def random_weights(rows, dim, bound, seed):
    """Flat fp32 [rows * dim] ~ U(-bound, bound): a hash of (row, column), made on the device
    in one pass (jax.random would need temporaries as large as a 51 GB table)."""

    @jax.jit
    def make():
        r = jax.lax.broadcasted_iota(jnp.uint32, (rows, dim), 0)
        c = jax.lax.broadcasted_iota(jnp.uint32, (rows, dim), 1)
        h = r * np.uint32(0x9E3779B1) ^ (c + np.uint32(seed)) * np.uint32(0x85EBCA77)
        for shift, mult in ((16, 0x7FEB352D), (15, 0x846CA68B)):
            h = (h ^ (h >> shift)) * np.uint32(mult)
        u = ((h ^ (h >> 16)) >> 8).astype(jnp.float32) * 2.0**-24
        return ((2.0 * u - 1.0) * bound).reshape(-1)

    return make()


def dense_loss(acts, v):
    return jnp.mean(jnp.square(acts @ v))


# --- plain-XLA peers: whole steps over the tables as [T*E, D], ids grouped [T, B, L] ---

def xla_forward(table, ids, t, e, d):
    b = ids.shape[1]
    rows = ids + (jnp.arange(t, dtype=ids.dtype) * e)[:, None, None]
    pooled = jnp.take(table, rows.reshape(-1), axis=0).reshape(*ids.shape, d).sum(2)  # [T, B, D]
    return pooled.transpose(1, 0, 2).reshape(b, t * d), rows.reshape(-1)


def position_grads(g_acts, ids, t, d):
    """The gradient row of every id position (its bag's slice of g_acts): [T*B*L, D]."""
    b, l = ids.shape[1], ids.shape[2]
    g = g_acts.reshape(b, t, d).transpose(1, 0, 2)
    return jnp.broadcast_to(g[:, :, None], (t, b, l, d)).reshape(-1, d)


def jax_exact_rowwise_adagrad(t, e, d):
    def step(w, m, v, ids):
        table = w.reshape(t * e, d)
        acts, rows = xla_forward(table, ids, t, e, d)
        g_acts, g_v = jax.grad(dense_loss, argnums=(0, 1))(acts, v)
        n = rows.shape[0]
        uniq, inverse = jnp.unique(rows, size=n, fill_value=t * e, return_inverse=True)
        grads = jax.ops.segment_sum(position_grads(g_acts, ids, t, d), inverse.reshape(-1), num_segments=n)
        safe = jnp.minimum(uniq, t * e - 1)  # fill slots read row T*E-1 and are dropped below
        m_new = m[safe] + jnp.mean(grads * grads, axis=1)
        w_new = table[safe] - (LR / (jnp.sqrt(m_new) + EPS))[:, None] * grads
        table = table.at[uniq].set(w_new, mode="drop")
        return table.reshape(-1), m.at[uniq].set(m_new, mode="drop"), v - DENSE_LR * g_v

    return step


def xla_scatter_sgd(t, e, d):
    def step(w, v, ids):
        table = w.reshape(t * e, d)
        acts, rows = xla_forward(table, ids, t, e, d)
        g_acts, g_v = jax.grad(dense_loss, argnums=(0, 1))(acts, v)
        table = table.at[rows].add(-LR * position_grads(g_acts, ids, t, d))
        return table.reshape(-1), v - DENSE_LR * g_v

    return step


# --- timing helpers -------------------------------------------------------------------

def jax_time(step, iters):
    return timed(step, [(i,) for i in range(SETS)], iters, jax.block_until_ready)


def threaded(fn, carry, batches):
    """step(i) for timed(): carry = fn(*carry, *batches[i]) (the donated buffers move on)."""
    box = [carry]

    def step(i):
        box[0] = fn(*box[0], *batches[i])
        return box[0]

    return step, box


def free():
    gc.collect()
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def torch_device(quick):
    if torch is None:
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if quick else None  # --quick on a CPU exercises the code path


def torch_step(tables, v, opt, dense, sets):
    """One PyTorch training step on id set i: the same loss as jaxrec's step."""

    def step(i):
        opt.zero_grad(set_to_none=True)
        dense.zero_grad(set_to_none=True)
        acts = torch.cat([tb(ids) for tb, ids in zip(tables, sets[i])], dim=1)
        torch.mean(torch.square(acts @ v)).backward()
        opt.step()
        dense.step()

    return step


def torch_peers(c, device):
    """{torch_sparse_<opt>: seconds} and {name: why skipped} for case c."""
    t, e, d = c["T"], c["E"], c["D"]
    times, skipped = {}, {}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sets = [torch.from_numpy(ids.astype(np.int64)).to(device) for ids in id_sets(c)]
    torch.manual_seed(0)
    tables = [torch.nn.EmbeddingBag(e, d, mode="sum", sparse=True, device=device) for _ in range(t)]
    v = torch.nn.Parameter(torch.randn(t * d, 1, device=device) / np.sqrt(t * d))
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=LR),
            "adagrad": lambda p: torch.optim.Adagrad(p, lr=LR, eps=EPS),
            "adam": lambda p: torch.optim.SparseAdam(p, lr=LR, eps=EPS)}
    state_copies = {"sgd": 0, "adagrad": 1, "adam": 2}
    for name in c["torch_opts"]:
        key = f"torch_sparse_{name}"
        need = state_copies[name] * t * e * d * 4
        if device == "cuda" and need > torch.cuda.mem_get_info()[0] - 2**31:
            skipped[key] = f"its state needs {need / 1e9:.1f} GB, {torch.cuda.mem_get_info()[0] / 1e9:.1f} GB free"
            continue
        try:
            opt = make[name]([p for tb in tables for p in tb.parameters()])
            step = torch_step(tables, v, opt, torch.optim.SGD([v], lr=DENSE_LR), sets)
            times[key] = timed(step, [(i,) for i in range(SETS)], c["iters"], lambda _: sync())
        except Exception as err:  # noqa: BLE001  (out of memory, say: record it and go on)
            skipped[key] = f"{type(err).__name__}: {str(err)[:300]}"
        opt = step = None  # the optimizer state goes before the next one is made
        free()
    return times, skipped


def memory_of(fn, args, table_elements):
    """XLA's buffer plan of the compiled step: bytes aliased (donated input = output), bytes of
    temporaries, and copies of the whole table (0 when the update is in place)."""
    compiled = fn.lower(*args).compile()
    copies = sum(int(np.prod([int(x) for x in dims.split(",")])) == table_elements
                 for dims in re.findall(r"= f32\[([\d,]+)\]\{[^}]*\} copy\(", compiled.as_text()))
    m = compiled.memory_analysis()
    plan = dict(table_copies=copies)
    if m is not None:
        plan.update(temp_MB=m.temp_size_in_bytes / 1e6, aliased_MB=m.alias_size_in_bytes / 1e6)
    return plan


def jax_measurements(c, layout, offsets, batches, grads, weights):
    """Seconds of every jaxrec / XLA measurement of case c, what was skipped and why, the
    buffer plans and the peer checks; ``weights`` is consumed (donated)."""
    t, e, d = c["T"], c["E"], c["D"]
    times, skipped, memory = {}, {}, {}
    box = {"w": weights}
    v0 = jax.random.normal(jax.random.key(1), (t * d, 1)) / np.sqrt(t * d)

    def weights_now():  # the last measurement's weights (a failed donated call may have consumed them)
        if box["w"].is_deleted():
            box["w"] = random_weights(t * e, d, 1 / np.sqrt(e), c["seed"])
        return box["w"]

    def fresh_weights():  # the initial weights again, in the same memory's place (tables up to 51 GB)
        box["w"].delete()
        return weights_now()

    def measure(name, fn, make_carry, step_batches, weights_of, call=None):
        """Times ``carry = (call or fn)(*carry, *step_batches[i])`` with the carry donated."""
        try:
            carry = make_carry()
            memory[name] = memory_of(fn, carry + step_batches[0], t * e * d)
            step, carry_box = threaded(call or fn, carry, step_batches)
            del carry
            try:
                times[name] = jax_time(step, c["iters"])
            finally:
                box["w"] = weights_of(carry_box[0])
        except Exception as err:  # noqa: BLE001  (out of memory, say: record it and go on)
            skipped[name] = f"{type(err).__name__}: {str(err)[:300]}"
        free()

    for name, mode in (("forward", "WARNING"), ("forward_bounds_check_none", "NONE")):
        lookup = jax.jit(lambda w, i, o, mode=mode: embedding_bag_lookup(w, i, o, layout=layout,
                                                                         bounds_check_mode=mode))
        try:
            times[name] = jax_time(lambda i, lookup=lookup: lookup(weights_now(), *batches[i]), c["iters"])
        except Exception as err:  # noqa: BLE001
            skipped[name] = f"{type(err).__name__}: {str(err)[:300]}"

    # XLA's sort of the row keys (the dense backward's; the fused update sorts in its handler).
    sort = jax.jit(lambda i, o: sort_by_row_reference(layout, i, o))
    try:
        times["sort_keys"] = jax_time(lambda i: sort(*batches[i]), c["iters"])
        hlo = sort.lower(*batches[0]).compile().as_text()
        print(f"  sort of {batches[0][0].shape[0]} keys: CUB radix sort in the HLO: {'cub' in hlo.lower()}")
    except Exception as err:  # noqa: BLE001
        skipped["sort_keys"] = f"{type(err).__name__}: {str(err)[:300]}"

    for opt in c["fused"]:
        config = OPTIMIZERS[opt]
        fn = jax.jit(lambda w, s, g, i, o, config=config: fused_update(
            w, s, g, i, o, layout=layout, config=config, bounds_check_mode="NONE"), donate_argnums=(0, 1))
        measure(f"fused_{opt}", fn, lambda config=config: (weights_now(), init_state(config, layout)),
                [(g, *batch) for g, batch in zip(grads, batches)], lambda carry: carry[0])

    def loss_fn(v, tables, ids, offs, mode="WARNING"):
        return dense_loss(fused_lookup(tables, ids, offs, bounds_check_mode=mode), v)

    # (optimizer, donated, bounds_check_mode): the default mode, and NONE beside it once.
    variants = [("rowwise_adagrad", True, "WARNING"), ("rowwise_adagrad", False, "WARNING")] if c["no_donation"] \
        else [(opt, True, "WARNING") for opt in c["steps"]] + [("rowwise_adagrad", True, "NONE")]
    for opt, donate, mode in variants:
        train = make_functional_train_step(functools.partial(loss_fn, mode=mode), optax.sgd(DENSE_LR), donate=donate)

        def make_carry(config=OPTIMIZERS[opt]):
            v = jnp.copy(v0)
            # Fresh weights: after the fused_* runs' random gradients, the steps' loss diverges.
            return v, optax.sgd(DENSE_LR).init(v), FusedEmbeddingTables.create(layout, config, weights=fresh_weights())

        measure(f"step_{opt}" + ("" if donate else "_not_donated") + ("_bounds_check_none" if mode == "NONE" else ""),
                train, make_carry, batches,
                lambda carry: carry[2].weights, call=lambda *args, train=train: train(*args)[:3])

    grouped = [(jnp.asarray(ids),) for ids in id_sets(c)]
    if "jax_exact_rowwise_adagrad" in c["peers"]:
        measure("jax_exact_rowwise_adagrad", jax.jit(jax_exact_rowwise_adagrad(t, e, d), donate_argnums=(0, 1, 2)),
                lambda: (weights_now(), jnp.zeros((t * e,), jnp.float32), jnp.copy(v0)), grouped,
                lambda carry: carry[0])
    if "xla_scatter_sgd" in c["peers"]:
        measure("xla_scatter_sgd", jax.jit(xla_scatter_sgd(t, e, d), donate_argnums=(0, 1)),
                lambda: (weights_now(), jnp.copy(v0)), grouped, lambda carry: carry[0])
    checks = None
    if t * e * d <= 2**28:  # the check keeps three tables alive at once
        try:
            checks = check_peers(c, layout, offsets, grouped, weights_now(), v0)
        except Exception as err:  # noqa: BLE001
            checks = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    box.clear()
    return times, skipped, memory, checks


def check_peers(c, layout, offsets, grouped, weights, v0):
    """Max |difference| of the tables after one step (same weights, same batch) between jaxrec's
    step and each XLA peer: they must compute the same update. Small cases only."""
    t, e, d = c["T"], c["E"], c["D"]
    ids = grouped[0][0]

    def loss_fn(v, tables, i, o):
        return dense_loss(fused_lookup(tables, i, o, bounds_check_mode="NONE"), v)

    def jaxrec_step(opt):
        tables = FusedEmbeddingTables.create(layout, OPTIMIZERS[opt], weights=weights)
        train = make_functional_train_step(loss_fn, optax.sgd(DENSE_LR), donate=False)
        return train(v0, optax.sgd(DENSE_LR).init(v0), tables, ids.reshape(-1), offsets)[2].weights

    exact = jax.jit(jax_exact_rowwise_adagrad(t, e, d))(weights, jnp.zeros((t * e,)), v0, ids)[0]
    scatter = jax.jit(xla_scatter_sgd(t, e, d))(weights, v0, ids)[0]
    diff = jax.jit(lambda a, b: jnp.max(jnp.abs(a - b)))
    return {"jax_exact_rowwise_adagrad_vs_step_rowwise_adagrad": float(diff(exact, jaxrec_step("rowwise_adagrad"))),
            "xla_scatter_sgd_vs_step_sgd": float(diff(scatter, jaxrec_step("sgd"))),
            "largest_update_rowwise_adagrad": float(diff(exact, weights))}


def run_case(c, torch_result):
    t, e, d, b, l = (c[k] for k in "TEDBL")
    layout = TableLayout.from_embedding_specs([(e, d)] * t)
    sets = id_sets(c)
    offsets = jnp.arange(0, t * b * l + 1, l, dtype=jnp.int32)
    batches = [(jnp.asarray(ids.reshape(-1)), offsets) for ids in sets]
    grads = [jax.random.normal(jax.random.key(10 + k), (b, t * d)) for k in range(SETS)]
    unique = float(np.mean([np.unique(ids + (np.arange(t, dtype=np.int64) * e)[:, None, None]).size for ids in sets]))
    weights = random_weights(t * e, d, 1 / np.sqrt(e), c["seed"])
    times, skipped, memory, checks = jax_measurements(c, layout, offsets, batches, grads, weights)
    del weights, batches, grads
    times.update(torch_result[0])
    skipped.update(torch_result[1])

    nbytes = {"forward": 4 * b * t * d + 4 * b * t * d * l}
    for opt in c["fused"]:
        nbytes[f"fused_{opt}"] = 4 * b * t * d + 2 * unique * d * 4 + 2 * unique * 4 * STATE_FLOATS_PER_ROW[opt](d)
    row = dict(config=c["config"], case=c["name"], **{k: c[k] for k in "TEDBL"}, weights="float32",
               ids="uniform", unique_rows_per_batch=unique, iters=c["iters"],
               ms={k: v * 1e3 for k, v in times.items()}, bytes=nbytes,
               GB_per_s={k: n / times[k] / 1e9 for k, n in nbytes.items() if k in times},
               ratios=ratios(times), skipped=skipped, buffer_plan=memory, max_abs_diff=checks)
    if c["no_donation"] and {"step_rowwise_adagrad", "step_rowwise_adagrad_not_donated"} <= set(times):
        row["ratios"]["step_rowwise_adagrad_not_donated / step_rowwise_adagrad"] = dict(
            value=times["step_rowwise_adagrad_not_donated"] / times["step_rowwise_adagrad"])
    return row


def ratios(times):
    out = {}
    for name, (num, den, cmp, target) in TARGETS.items():
        if num in times and den in times:
            value = times[num] / times[den]
            out[name] = dict(value=value, target=f"{cmp} {target}" if cmp else None,
                             met=(value <= target if cmp == "<=" else value >= target) if cmp else None)
    return out


def sweep_summary(rows):
    by_rows = {r["E"]: r for r in rows if r["config"] == "table_sweep"}
    summary = dict(config="table_sweep_summary", step_rowwise_adagrad_ms={
        sci(e): r["ms"].get("step_rowwise_adagrad") for e, r in sorted(by_rows.items())})
    small, large = min(by_rows, default=None), max(by_rows, default=None)
    if small is not None and small != large:
        a, z = by_rows[small]["ms"], by_rows[large]["ms"]
        if "step_rowwise_adagrad" in a and "step_rowwise_adagrad" in z:
            value = z["step_rowwise_adagrad"] / a["step_rowwise_adagrad"]
            summary[f"step_rowwise_adagrad({sci(large)}) / step_rowwise_adagrad({sci(small)})"] = dict(
                value=value, target="<= 1.25", met=value <= 1.25)
    return summary


def copy_ceiling(quick):
    x = jnp.asarray(np.random.default_rng(0).random(2**22 if quick else 2**29, dtype=np.float32))
    seconds = timed(jax.jit(lambda x: x * 1.5), [(x,)], 5 if quick else 50, jax.block_until_ready)
    return 2 * x.nbytes / seconds / 1e9


def _line(row):
    ms = ", ".join(f"{k} {v:.3f}" for k, v in row["ms"].items())
    rt = ", ".join(f"{k} = {v['value']:.2f}" + (f" ({v['target']}: {'met' if v['met'] else 'NOT met'})"
                                                  if v.get("target") else "") for k, v in row["ratios"].items())
    skipped = f" | skipped: {sorted(row['skipped'])}" if row["skipped"] else ""
    return f"{row['case']}: ms: {ms}\n    {rt}{skipped}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="tiny configs (a smoke test; runs on the CPU)")
    parser.add_argument("--only", nargs="+", help="configs to run: default, fbgemm_default, table_sweep, no_donation "
                        "(comma- or space-separated; they run largest table first whatever the order)")
    args = parser.parse_args()
    plan = cases(args.quick)
    wanted = [n for arg in (args.only or plan) for n in arg.split(",") if n]
    unknown = sorted(set(wanted) - set(plan))
    if unknown:
        parser.error(f"unknown configs {unknown}; choose among {list(plan)}")
    todo = [c for name in plan if name in wanted for c in plan[name]]  # largest tables first

    device = jax.devices()[0]  # JAX's GPU client first, while the GPU is empty
    results = []
    info = dict(device=device.device_kind, jax=jax.__version__, jaxlib=jaxlib.__version__,
                jaxrec=jaxrec.__version__, jaxrec_build=jaxrec.build_info(),
                torch=torch.__version__ if torch else None, driver=nvidia_driver(), quick=args.quick,
                method="median of 5 repeats of back-to-back calls after warm-up; requests rotate among "
                       "4 pre-generated id sets (uniform, with duplicates); donated buffers threaded "
                       "from call to call; jaxrec without bounds check; PyTorch peers measured first "
                       "for every case (memory), then jaxrec/XLA", results=results)

    start = time.perf_counter()

    def save():
        info["elapsed_s"] = time.perf_counter() - start
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1, default=str)

    tdev = torch_device(args.quick)
    info["torch_device"] = tdev
    torch_results = {}
    for c in todo:
        if not c["torch_opts"]:
            continue
        if tdev is None:
            torch_results[c["name"]] = ({}, {f"torch_sparse_{o}": "PyTorch is not installed or sees no GPU"
                                             for o in c["torch_opts"]})
            continue
        torch_results[c["name"]] = torch_peers(c, tdev)
        free()  # the tables of case c
        print(f"{c['name']}: torch ms {({k: round(v * 1e3, 3) for k, v in torch_results[c['name']][0].items()})}",
              flush=True)
        info["torch_phase"] = {n: dict(ms={k: v * 1e3 for k, v in r[0].items()}, skipped=r[1])
                               for n, r in torch_results.items()}
        save()
    info["copy_ceiling_GB_per_s"] = copy_ceiling(args.quick)
    print(f"device-to-device copy ceiling: {info['copy_ceiling_GB_per_s']:.0f} GB/s", flush=True)
    for name in (n for n in plan if n in wanted):
        for c in plan[name]:
            try:
                results.append(run_case(c, torch_results.get(c["name"], ({}, {}))))
            except Exception as err:  # noqa: BLE001  (out of memory, say: record it and go on)
                results.append(dict(config=c["config"], case=c["name"], **{k: c[k] for k in "TEDBL"}, ms={},
                                    ratios={}, skipped={"case": f"{type(err).__name__}: {str(err)[:300]}"}))
            print(_line(results[-1]), flush=True)
            save()
            free()
        if name == "table_sweep":
            results.append(sweep_summary(results))
            print(json.dumps(results[-1]), flush=True)
            save()
    print(f"wrote {args.out} after {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
