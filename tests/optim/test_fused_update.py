"""The fused update kernels (CPU, and CUDA on the device) against the jnp reference.

Every optimizer x weight dtype, and every pooling x weighted (a covering design: CASES),
on tables shared by two features, with duplicate ids, empty bags, odd dims and padding
after the last offset, over several consecutive steps from a random (non-zero) state.
Rows outside the batch must stay bit-identical.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optim_testing import LAYOUT, from_jax, make, random_batch, random_tables, to_jax

from jaxrec import optim
from jaxrec.fused import fused_update
from jaxrec.fused._update import _fused_update
from jaxrec.ops import PoolingMode, TableLayout, embedding_bag_lookup

# Features 0 and 2 share table 0: one dim, for pooling NONE.
SEQ_LAYOUT = TableLayout(rows=(23, 9), dims=(8, 8), feature_table_map=(0, 1, 0))
STEPS = 3

CONFIGS = {
    "sgd": make(optim.SGD),
    "sgd_clip_max_norm": make(optim.SGD, gradient_clipping=True, max_gradient=0.3, max_norm=0.4),
    "adagrad": make(optim.Adagrad),
    "rowwise_adagrad": make(optim.RowWiseAdagrad),
    "rowwise_adagrad_l2": make(optim.RowWiseAdagrad, weight_decay_mode="l2", max_norm=0.5),
    "rowwise_adagrad_decoupled": make(optim.RowWiseAdagrad, weight_decay_mode="decoupled",
                                      gradient_clipping=True, max_gradient=0.2),
    "adam": make(optim.Adam),
    "partial_rowwise_adam": make(optim.PartialRowWiseAdam),
    "lamb": make(optim.LAMB),
    "partial_rowwise_lamb": make(optim.PartialRowWiseLAMB),
    "lars_sgd": make(optim.LarsSGD),
}
# A covering design, not the full product (each case is two XLA compiles, ~1 s on CPU).
# The kernels are instantiated per optimizer x weight dtype x index type (csrc/cpu/
# tbe_fused_update.cc's UpdateItem<kKind, W, I>, the CUDA FusedUpdate<kKind, kChunks, W, I>);
# pooling and per-sample weights are runtime branches of the gradient gathering that every
# optimizer shares (and of embedding_bag_sparse_grad in the reference, before the
# optimizer-only update_reference). So every optimizer runs with every weight dtype, and the
# pooling/weighted combinations SUM-unweighted, MEAN-weighted and NONE rotate over the
# dtypes (each optimizer meets all three, each dtype meets all three); every optimizer also
# runs SUM-weighted in float32 (the programs test_a_row_whose_update_is_not_finite reuses),
# and three of them (no state; a per-row state; two per-element states) MEAN-unweighted,
# so those see all five pooling/weighted combinations.
DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
ROTATED = [(PoolingMode.SUM, False), (PoolingMode.MEAN, True), (PoolingMode.NONE, False)]
CASES = ([(name, jnp.float32, PoolingMode.SUM, True) for name in CONFIGS]
         + [(name, dtype, *ROTATED[(i + j) % len(ROTATED)])
            for i, name in enumerate(CONFIGS) for j, dtype in enumerate(DTYPES)]
         + [(name, jnp.float32, PoolingMode.MEAN, False) for name in ("sgd", "rowwise_adagrad", "adam")])
ULP = {jnp.float32: 1e-5, jnp.float16: 2.0**-10, jnp.bfloat16: 2.0**-7}


@functools.cache
def _step(config, layout, pooling, weighted, backend):
    """The jitted update. The kernel checks its (valid) ids under FATAL; the reference, the
    oracle, skips its jnp bounds check (NONE): a quarter of its compile time, and the
    reference's checks are tests/test_bounds_check.py's."""
    mode = "fatal" if backend == "kernel" else "none"

    @jax.jit
    def step(weights, state, grad_output, indices, offsets, psw):
        return _fused_update(weights, state, grad_output, indices, offsets, layout=layout,
                             config=config, hparams=None, pooling=pooling,
                             per_sample_weights=psw if weighted else None,
                             bounds_check_mode=mode, backend=backend)
    return step


def random_inputs(rng, config, layout, pooling, weighted, weight_dtype, state_dtype=None):
    """Random weights and non-zero state (squares positive), built in NumPy: few eager ops."""
    weights = np.concatenate([rng.normal(0.0, 0.3, size=r * d) for r, d in zip(layout.rows, layout.dims)])
    state = optim.init_state(config, layout, state_dtype)
    buffers = {}
    for name in config.state_type._fields[1:]:
        x = rng.normal(0.0, 0.1, size=getattr(state, name).shape)
        x = np.abs(x) if name in ("momentum1", "exp_avg_sq") else x
        buffers[name] = jnp.asarray(x.astype(np.float32), getattr(state, name).dtype)
    return (jnp.asarray(weights.astype(np.float32), weight_dtype),
            config.state_type(step=jnp.asarray(5, jnp.int32), **buffers))


def random_step_batch(rng, layout, pooling, weighted):
    indices, offsets, grad_output = random_batch(rng, layout)
    if pooling == PoolingMode.NONE:
        grad_output = rng.normal(size=(indices.shape[0], layout.dims[0])).astype(np.float32)
    psw = rng.normal(size=indices.shape).astype(np.float32)
    return grad_output, indices, offsets, psw


def assert_same_update(config, got, want, weighted, rtol):
    """The kernel's ``(weights, state, grad_psw, ...)`` against the reference's ``(weights,
    state, grad_psw)``: weights within ``rtol`` (atol ``rtol / 10``), every state buffer within
    ``rtol`` (atol 1e-6), and the per-sample weights' gradient when ``weighted``."""
    (wk, sk, gk, *_), (wr, sr, gr) = got, want
    np.testing.assert_allclose(wk, wr, rtol=rtol, atol=rtol / 10)
    for field in config.state_type._fields[1:]:
        np.testing.assert_allclose(getattr(sk, field), getattr(sr, field), rtol=rtol, atol=1e-6,
                                   err_msg=field)
    if weighted:
        np.testing.assert_allclose(gk, gr, rtol=1e-4, atol=1e-5)


def touched_mask(layout, batches):
    """bool[num_weights]: the elements of every row some batch reads."""
    mask = np.zeros(layout.num_weights, bool)
    for _, indices, offsets, _ in batches:
        batch_size = (len(offsets) - 1) // layout.num_features
        for k in range(len(offsets) - 1):
            f = k // batch_size
            t = layout.feature_table_map[f]
            for p in range(offsets[k], offsets[k + 1]):
                start = layout.table_offsets[t] + int(indices[p]) * layout.dims[t]
                mask[start:start + layout.dims[t]] = True
    return mask


@pytest.mark.parametrize("name, weight_dtype, pooling, weighted", CASES,
                         ids=[f"{n}-{jnp.dtype(d).name}-{p.name}-{'w' if w else 'u'}" for n, d, p, w in CASES])
def test_kernel_equals_reference(platform, name, weight_dtype, pooling, weighted):
    config = CONFIGS[name]
    layout = SEQ_LAYOUT if pooling == PoolingMode.NONE else LAYOUT
    rng = np.random.default_rng(abs(hash((name, jnp.dtype(weight_dtype).name, int(pooling), weighted))) % 2**31)
    w0, s0 = random_inputs(rng, config, layout, pooling, weighted, weight_dtype)
    kernel = _step(config, layout, pooling, weighted, "kernel")
    reference = _step(config, layout, pooling, weighted, "reference")
    wk, sk, wr, sr = w0, s0, w0, s0
    batches = []
    for _ in range(STEPS):
        batch = random_step_batch(rng, layout, pooling, weighted)
        batches.append(batch)
        wk, sk, gk, _ = kernel(wk, sk, *batch)
        wr, sr, gr, _ = reference(wr, sr, *batch)
        if weighted:
            np.testing.assert_allclose(gk, gr, rtol=1e-4, atol=1e-5)
        # Compare step by step from the same point, so 16-bit rounding does not drift apart.
        tol = ULP[weight_dtype]
        np.testing.assert_allclose(np.asarray(wk, np.float32), np.asarray(wr, np.float32),
                                   rtol=2 * tol, atol=2 * tol * 1e-2)
        wk = wr
        assert int(sk.step) == int(sr.step)
        for field in config.state_type._fields[1:]:
            np.testing.assert_allclose(getattr(sk, field), getattr(sr, field), rtol=1e-5, atol=1e-6,
                                       err_msg=field)
        sk = sr
    assert int(sk.step) == 5 + STEPS
    untouched = ~touched_mask(layout, batches)
    assert untouched.any() and (~untouched).any()
    np.testing.assert_array_equal(np.asarray(wr)[untouched], np.asarray(w0)[untouched])
    moved = np.max(np.abs(np.asarray(wr, np.float32) - np.asarray(w0, np.float32)))
    assert moved > 1e-3


# The CUDA kernel's row shapes (csrc/cuda/tbe_fused_update_kernels.cuh, LaunchFused): the
# widest table picks one for the whole layout. Rows of <= 32 and <= 128 columns go to groups
# of 8 lanes (four rows per warp), wider rows to a warp; each layout mixes a table at the
# shape's limit with narrower ones of odd dims (partial chunks, idle lanes).
WIDE_LAYOUTS = {
    "le128": TableLayout(rows=(19, 11, 7), dims=(128, 37, 5), feature_table_map=(0, 1, 0, 2)),
    "le512": TableLayout(rows=(13, 6), dims=(300, 129), feature_table_map=(0, 1, 1)),
    "le1024": TableLayout(rows=(9, 5), dims=(1024, 513), feature_table_map=(0, 1)),
}


@pytest.mark.parametrize("shape", WIDE_LAYOUTS)
@pytest.mark.parametrize("name, pooling, weighted", [("rowwise_adagrad_l2", PoolingMode.SUM, True),
                                                     ("lamb", PoolingMode.MEAN, False),
                                                     ("adagrad", PoolingMode.SUM, False)])
def test_every_row_shape_of_the_kernel(platform, shape, name, pooling, weighted):
    """Row sums (rowwise Adagrad's, LAMB's norms) and every column of rows of each width the
    kernel has a shape for, with duplicates and empty bags, over two steps."""
    layout, config = WIDE_LAYOUTS[shape], CONFIGS[name]
    rng = np.random.default_rng(len(shape) * 7 + len(name))
    wk, sk = random_inputs(rng, config, layout, pooling, weighted, jnp.float32)
    kernel = _step(config, layout, pooling, weighted, "kernel")
    reference = _step(config, layout, pooling, weighted, "reference")
    for _ in range(2):
        batch = random_step_batch(rng, layout, pooling, weighted)
        assert len(set(batch[1][:batch[2][-1]])) < batch[2][-1]  # duplicates
        wr, sr, gr, _ = reference(wk, sk, *batch)
        assert_same_update(config, kernel(wk, sk, *batch), (wr, sr, gr), weighted, rtol=1e-5)
        wk, sk = wr, sr


@pytest.mark.parametrize("state_dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_state(platform, state_dtype):
    config = make(optim.PartialRowWiseAdam, state_dtype=state_dtype)
    rng = np.random.default_rng(3)
    w, s = random_inputs(rng, config, LAYOUT, PoolingMode.SUM, False, jnp.float32)
    assert s.exp_avg.dtype == state_dtype
    batch = random_step_batch(rng, LAYOUT, PoolingMode.SUM, False)
    wk, sk, *_ = _step(config, LAYOUT, PoolingMode.SUM, False, "kernel")(w, s, *batch)
    wr, sr, *_ = _step(config, LAYOUT, PoolingMode.SUM, False, "reference")(w, s, *batch)
    np.testing.assert_allclose(wk, wr, rtol=1e-5, atol=1e-6)
    tol = float(jnp.finfo(state_dtype).eps)
    for field in ("exp_avg", "exp_avg_sq"):
        assert getattr(sk, field).dtype == state_dtype
        np.testing.assert_allclose(np.asarray(getattr(sk, field), np.float32),
                                   np.asarray(getattr(sr, field), np.float32), rtol=tol, atol=1e-6)


def test_matches_float64_numpy_over_steps(platform):
    """The kernel against optim_testing's float64 formulas (written from FBGEMM's definitions)."""
    from optim_testing import merged_grads, reference_step

    config = CONFIGS["rowwise_adagrad_l2"]
    rng = np.random.default_rng(11)
    weights, states = random_tables(config, rng)
    w, s = to_jax(config, weights, states, step=0)
    kernel = _step(config, LAYOUT, PoolingMode.SUM, False, "kernel")
    for step in range(STEPS):
        indices, offsets, grad_output = random_batch(rng)
        w, s, *_ = kernel(w, s, grad_output, indices, offsets, np.zeros(indices.shape, np.float32))
        reference_step(config, weights, states, merged_grads((indices, offsets, grad_output)), step)
    got_w, got_s = from_jax(config, w, s)
    for t in range(LAYOUT.num_tables):
        np.testing.assert_allclose(got_w[t], weights[t], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_s[t]["momentum1"], states[t]["momentum1"], rtol=1e-5, atol=1e-7)


def test_per_sample_weight_gradient_equals_autodiff(platform):
    config = CONFIGS["sgd"]
    rng = np.random.default_rng(5)
    w, s = random_inputs(rng, config, LAYOUT, PoolingMode.MEAN, True, jnp.float32)
    grad_output, indices, offsets, psw = random_step_batch(rng, LAYOUT, PoolingMode.MEAN, True)
    step = jax.jit(functools.partial(fused_update, layout=LAYOUT, config=config, pooling="mean",
                                     backend="kernel", return_per_sample_weights_grad=True))
    _, _, got = step(w, s, grad_output, indices, offsets, per_sample_weights=psw)  # the public form
    want = jax.grad(lambda p: jnp.sum(grad_output * embedding_bag_lookup(
        w, indices, offsets, layout=LAYOUT, pooling="mean", per_sample_weights=p)))(jnp.asarray(psw))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got)[offsets[-1]:] == 0)  # padding


@pytest.mark.parametrize("weight_dtype", [jnp.bfloat16, jnp.float16])
def test_stochastic_rounding(platform, weight_dtype):
    """Kernel bits = reference bits; deterministic for a seed; unbiased on average."""
    config = make(optim.SGD, learning_rate=1.0, stochastic_rounding=True, seed=7)
    layout = TableLayout(rows=(64,), dims=(128,), feature_table_map=(0,))
    n = 64
    indices = np.arange(n, dtype=np.int32)
    offsets = np.arange(n + 1, dtype=np.int32)
    w = jnp.ones((layout.num_weights,), weight_dtype)
    # A gradient of a third of the dtype's ulp at 1.0: round-to-nearest never moves a weight.
    ulp = float(jnp.finfo(weight_dtype).eps)
    grad_output = np.full((n, 128), -ulp / 3, np.float32)
    s = optim.init_state(config, layout)
    run = lambda backend, cfg: _step(cfg, layout, PoolingMode.SUM, False, backend)(
        w, s, grad_output, indices, offsets, np.zeros(n, np.float32))[0]
    kernel, again, reference = run("kernel", config), run("kernel", config), run("reference", config)
    np.testing.assert_array_equal(np.asarray(kernel, np.float32), np.asarray(reference, np.float32))
    np.testing.assert_array_equal(np.asarray(kernel, np.float32), np.asarray(again, np.float32))
    other_seed = run("kernel", make(optim.SGD, learning_rate=1.0, stochastic_rounding=True, seed=8))
    assert np.any(np.asarray(other_seed) != np.asarray(kernel))
    up = np.mean(np.asarray(kernel, np.float32) > 1.0)
    assert abs(up - 1 / 3) < 0.02, up  # 8192 draws: sd 0.005
    nearest = run("kernel", make(optim.SGD, learning_rate=1.0))
    assert np.all(np.asarray(nearest, np.float32) == 1.0)


@pytest.mark.parametrize("name, pooling, weighted", [("rowwise_adagrad", PoolingMode.SUM, False),
                                                     ("adam", PoolingMode.MEAN, True)])
def test_hot_rows_longer_than_a_window(platform, name, pooling, weighted):
    """Zipf-like ids: the head row of each table is read about 1,700 times in a batch, so
    its run of the sorted ids spans several of the CUDA kernel's windows (64 entries for
    rowwise Adagrad's groups of 8 lanes, 256 for Adam's warps: the run's own group sums
    its first window and adds the others' head sums). Two steps, padding
    after the last offset (both steps padded to one capacity: one compile per backend).
    Sums of ~1,700 float32 terms in another order: rtol 1e-4."""
    config = CONFIGS[name]
    rng = np.random.default_rng(17)
    batch_size, capacity = 300, 6600  # ~6,000 ids in bags (sd ~100), then padding
    w0, s0 = random_inputs(rng, config, LAYOUT, pooling, weighted, jnp.float32)
    kernel = _step(config, LAYOUT, pooling, weighted, "kernel")
    reference = _step(config, LAYOUT, pooling, weighted, "reference")
    for _ in range(2):
        lengths = rng.integers(0, 9, size=LAYOUT.num_features * batch_size)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        ids = []
        for k, n in enumerate(lengths):
            rows = LAYOUT.feature_rows[k // batch_size]
            head = rng.random(n)
            ids.append(np.where(head < 0.7, 0, np.where(head < 0.85, 1, rng.integers(0, rows, n))))
        assert offsets[-1] < capacity
        indices = np.concatenate(ids + [rng.integers(0, 3, capacity - offsets[-1])]).astype(np.int32)
        assert np.sum(indices[:offsets[-1]] == 0) > 3 * 256
        grad_output = rng.normal(size=(batch_size, LAYOUT.total_dim)).astype(np.float32)
        psw = rng.normal(size=indices.shape).astype(np.float32)
        wr, sr, gr, _ = reference(w0, s0, grad_output, indices, offsets, psw)
        assert_same_update(config, kernel(w0, s0, grad_output, indices, offsets, psw), (wr, sr, gr),
                           weighted, rtol=1e-4)
        assert np.max(np.abs(np.asarray(wr) - np.asarray(w0))) > 1e-3
        w0, s0 = wr, sr


@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "adam"])
def test_runs_of_every_length_around_the_long_run_and_window_bounds(platform, name):
    """The CUDA kernels of rows in groups of lanes (SGD, rowwise Adagrad at D <= 128) leave
    the runs of at least 5 sorted entries (kLongRun) to warps; windows cut runs at
    multiples of 64 entries (256 for Adam's warps). Each table's rows get runs of 1-9,
    31-33, 63-65 and 130 entries, spread over the bags of the table's features in random
    order, so that runs begin everywhere relative to the windows; two steps, padding after
    the last offset."""
    config = CONFIGS[name]
    rng = np.random.default_rng(23)
    counts = [1, 2, 3, 4, 5, 6, 7, 8, 9, 31, 32, 33, 63, 64, 65, 130]
    batch_size, capacity = 64, 1600
    w0, s0 = random_inputs(rng, config, LAYOUT, PoolingMode.SUM, False, jnp.float32)
    kernel = _step(config, LAYOUT, PoolingMode.SUM, False, "kernel")
    reference = _step(config, LAYOUT, PoolingMode.SUM, False, "reference")
    for _ in range(2):
        ids = [[] for _ in range(LAYOUT.num_features)]
        for t, rows in enumerate(LAYOUT.rows):
            features = [f for f, table in enumerate(LAYOUT.feature_table_map) if table == t]
            for row, count in zip(rng.permutation(rows), rng.permutation(counts)):
                for f in rng.choice(features, size=count):
                    ids[f].append(row)
        lengths, indices = [], []
        for feature_ids in ids:
            feature_ids = rng.permutation(np.asarray(feature_ids))
            cuts = np.sort(rng.integers(0, len(feature_ids) + 1, batch_size - 1))
            lengths.extend(np.diff(np.concatenate([[0], cuts, [len(feature_ids)]])))
            indices.append(feature_ids)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        assert offsets[-1] <= capacity
        indices = np.concatenate(indices + [rng.integers(0, 9, capacity - offsets[-1])]).astype(np.int32)
        grad_output = rng.normal(size=(batch_size, LAYOUT.total_dim)).astype(np.float32)
        psw = np.zeros(capacity, np.float32)
        wr, sr, gr, _ = reference(w0, s0, grad_output, indices, offsets, psw)
        assert_same_update(config, kernel(w0, s0, grad_output, indices, offsets, psw), (wr, sr, gr),
                           False, rtol=1e-4)
        assert np.max(np.abs(np.asarray(wr) - np.asarray(w0))) > 1e-3
        w0, s0 = wr, sr


def test_int64_ids(platform, x64):
    config = CONFIGS["rowwise_adagrad"]
    rng = np.random.default_rng(9)
    w, s = random_inputs(rng, config, LAYOUT, PoolingMode.SUM, False, jnp.float32)
    grad_output, indices, offsets, psw = random_step_batch(rng, LAYOUT, PoolingMode.SUM, False)
    args = (grad_output, indices.astype(np.int64), offsets.astype(np.int64), psw)
    wk, sk, *_ = _step(config, LAYOUT, PoolingMode.SUM, False, "kernel")(w, s, *args)
    wr, sr, *_ = _step(config, LAYOUT, PoolingMode.SUM, False, "reference")(w, s, *args)
    np.testing.assert_allclose(wk, wr, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sk.momentum1, sr.momentum1, rtol=1e-5, atol=1e-7)


def test_the_handler_sorts_the_ids_itself(platform):
    """No sort runs before the handler: on the GPU XLA does not record its sort in command
    buffers (CUDA graphs), so a sort there split a train step's graphs (docs/fused.md)."""
    config = CONFIGS["rowwise_adagrad"]
    rng = np.random.default_rng(12)
    w, s = random_inputs(rng, config, LAYOUT, PoolingMode.SUM, False, jnp.float32)
    args = random_step_batch(rng, LAYOUT, PoolingMode.SUM, False)
    step = _step(config, LAYOUT, PoolingMode.SUM, False, "kernel")
    hlo = step.lower(w, s, *args).compile().as_text()
    assert "jaxrec_tbe_fused_update" in hlo
    assert not re.search(r"\bsort\(|DeviceRadixSort|jaxrec_sort_by_row", hlo)


def test_bad_ids_are_corrected_like_the_lookup(platform):
    """WARNING mode: the update sees the ids the lookup saw (bad ones read as row 0)."""
    config = CONFIGS["sgd"]
    rng = np.random.default_rng(4)
    w, s = random_inputs(rng, config, LAYOUT, PoolingMode.SUM, False, jnp.float32)
    grad_output, indices, offsets, _ = random_step_batch(rng, LAYOUT, PoolingMode.SUM, False)
    bad = indices.copy()
    bad[offsets[1]] = 10**6 if offsets[2] > offsets[1] else bad[offsets[1]]
    fixed = bad.copy()
    fixed[offsets[1]] = 0 if offsets[2] > offsets[1] else fixed[offsets[1]]
    got = fused_update(w, s, grad_output, bad, offsets, layout=LAYOUT, config=config)[0]
    want = fused_update(w, s, grad_output, fixed, offsets, layout=LAYOUT, config=config,
                        bounds_check_mode="none")[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(config=optim.NoOptimizer()), ValueError, "NoOptimizer has no fused update"),
    (dict(grad_output=np.zeros((3, 3), np.float32)), ValueError, "grad_output must have"),
    (dict(state=optim.init_state(optim.Adam(), LAYOUT)), TypeError, "needs a SGDState"),
    (dict(pooling="none", per_sample_weights=np.ones(128, np.float32)), ValueError, "pooling"),
    (dict(backend="gpu"), ValueError, "backend"),
])
def test_bad_arguments_get_clear_errors(kwargs, error, message):
    rng = np.random.default_rng(0)
    indices, offsets, grad_output = random_batch(rng)
    args = dict(weights=jnp.zeros(LAYOUT.num_weights) + 0.5, state=optim.init_state(optim.SGD(), LAYOUT),
                grad_output=grad_output, indices=indices, offsets=offsets, layout=LAYOUT,
                config=optim.SGD())
    args.update(kwargs)
    with pytest.raises(error, match=message):
        fused_update(**args)


@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.MEAN])
def test_gradient_clipping_clamps_grad_output_like_fbgemm(platform, pooling):
    """FBGEMM clamps grad_output element-wise before the backward; the per-sample-weight
    gradient uses the clamped values too. Duplicates make a row-sum clip differ."""
    layout = TableLayout(rows=(7, 5), dims=(4, 3), feature_table_map=(0, 1))
    rng = np.random.default_rng(21)
    tables = [rng.uniform(-1, 1, (r, d)) for r, d in zip(layout.rows, layout.dims)]
    weights = jnp.asarray(np.concatenate([t.ravel() for t in tables]), jnp.float32)
    # f0: b0 [3, 3, 1], b1 [3];  f1: b0 [2, 2], b1 []
    indices = np.array([3, 3, 1, 3, 2, 2, 0, 0], np.int32)
    offsets = np.array([0, 3, 4, 6, 6], np.int32)
    psw = rng.uniform(0.5, 1.5, 8).astype(np.float32)
    grad_output = rng.normal(scale=2.0, size=(2, 7)).astype(np.float32)
    bound, lr = 0.6, 0.5
    config = optim.SGD(learning_rate=lr, gradient_clipping=True, max_gradient=bound)
    got_w, _, got_psw, _ = _fused_update(
        weights, optim.init_state(config, layout), grad_output, indices, offsets, layout=layout,
        config=config, hparams=None, pooling=pooling, per_sample_weights=psw,
        bounds_check_mode="FATAL", backend="kernel")

    g = np.clip(grad_output.astype(np.float64), -bound, bound)
    want = [t.copy() for t in tables]
    want_psw = np.zeros(8)
    row_sums = [np.zeros(t.shape) for t in tables]
    cols = ((0, 4), (4, 7))
    for k in range(4):
        f, b = divmod(k, 2)
        length = offsets[k + 1] - offsets[k]
        scale = 1.0 / length if pooling == PoolingMode.MEAN and length else 1.0
        for p in range(offsets[k], offsets[k + 1]):
            gb = g[b, cols[f][0]:cols[f][1]]
            row_sums[f][indices[p]] += scale * psw[p] * gb
            want_psw[p] = scale * gb @ tables[f][indices[p]]
    for t in range(2):
        want[t] -= lr * row_sums[t]
    got = np.asarray(got_w, np.float64)
    np.testing.assert_allclose(got, np.concatenate([w.ravel() for w in want]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_psw, want_psw, rtol=1e-5, atol=1e-6)
    assert np.abs(row_sums[0][3]).max() > bound  # a row-sum clip would have given another row 3
    unclipped_psw = [grad_output[0, :4] @ tables[0][3]]
    assert not np.isclose(want_psw[0] / (1 / 3 if pooling == PoolingMode.MEAN else 1.0), unclipped_psw[0])


def unique_rows(layout, indices, offsets, bags):
    """The (table, row) pairs that the positions of ``bags`` read."""
    batch_size = (len(offsets) - 1) // layout.num_features
    return {(layout.feature_table_map[k // batch_size], int(indices[p]))
            for k in bags for p in range(offsets[k], offsets[k + 1])}


def row_slices(layout, rows):
    return [slice(layout.table_offsets[t] + r * layout.dims[t],
                  layout.table_offsets[t] + (r + 1) * layout.dims[t]) for t, r in rows]


@pytest.mark.parametrize("name", CONFIGS)
def test_a_row_whose_update_is_not_finite_keeps_its_values(platform, name):
    """NaN in some bags' gradient: the rows they read keep weights and state (clipping
    keeps a NaN), counted; every other row is updated as the reference does."""
    config = CONFIGS[name]
    rng = np.random.default_rng(11)
    w0, s0 = random_inputs(rng, config, LAYOUT, PoolingMode.SUM, True, jnp.float32)
    grad_output, indices, offsets, psw = random_step_batch(rng, LAYOUT, PoolingMode.SUM, True)
    batch_size = grad_output.shape[0]
    bad_samples = [1]  # of the batch of 4
    grad_output[bad_samples, :] = np.nan  # every feature's bag of these samples
    bad_bags = [f * batch_size + b for f in range(LAYOUT.num_features) for b in bad_samples
                if offsets[f * batch_size + b + 1] > offsets[f * batch_size + b]]
    kept = unique_rows(LAYOUT, indices, offsets, bad_bags)
    updated = unique_rows(LAYOUT, indices, offsets, range(len(offsets) - 1)) - kept
    assert kept and updated

    batch = (grad_output, indices, offsets, psw)
    wk, sk, _, nk = _step(config, LAYOUT, PoolingMode.SUM, True, "kernel")(w0, s0, *batch)
    wr, sr, _, nr = _step(config, LAYOUT, PoolingMode.SUM, True, "reference")(w0, s0, *batch)
    assert int(nk) == int(nr) == len(kept)
    if name == "rowwise_adagrad":  # the public form's count, once (it compiles anew)
        *_, public = fused_update(w0, s0, grad_output, indices, offsets, layout=LAYOUT,
                                  config=config, per_sample_weights=psw,
                                  return_per_sample_weights_grad=True, return_nonfinite_rows=True)
        assert int(public) == len(kept)
    for w in (wk, wr):
        assert np.isfinite(np.asarray(w)).all()
        for s in row_slices(LAYOUT, kept):
            np.testing.assert_array_equal(np.asarray(w)[s], np.asarray(w0)[s])
    np.testing.assert_allclose(wk, wr, rtol=1e-5, atol=1e-6)
    for field in config.state_type._fields[1:]:
        np.testing.assert_array_equal(np.isfinite(getattr(sk, field)), True)
        np.testing.assert_allclose(getattr(sk, field), getattr(sr, field), rtol=1e-5, atol=1e-6)
    moved = [np.abs(np.asarray(wr)[s] - np.asarray(w0)[s]).max() for s in row_slices(LAYOUT, updated)]
    assert max(moved) > 1e-3


@pytest.mark.parametrize("weight_dtype, kept", [(jnp.float16, True), (jnp.bfloat16, False)])
def test_an_update_past_the_weight_dtypes_range_is_kept(platform, weight_dtype, kept):
    """1e5 is finite in float32 and bfloat16 but not in float16 (max 65504): the check sees
    the value as stored."""
    layout = TableLayout(rows=(5,), dims=(4,), feature_table_map=(0,))
    config = optim.SGD(learning_rate=1.0)
    w0 = jnp.asarray(np.random.default_rng(2).uniform(-1, 1, 20), weight_dtype)
    indices, offsets = np.array([1, 3], np.int32), np.array([0, 1, 2], np.int32)
    grad_output = np.array([[1e5, 1, 1, 1], [1, 2, 3, 4]], np.float32)
    s0 = optim.init_state(config, layout)
    for backend in ("kernel", "reference"):
        w, _, _, count = _step(config, layout, PoolingMode.SUM, False, backend)(
            w0, s0, grad_output, indices, offsets, np.zeros(2, np.float32))
        w = np.asarray(w, np.float32)
        assert int(count) == int(kept), backend
        assert np.isfinite(w).all(), backend
        row1 = np.asarray(w0, np.float32)[4:8]
        np.testing.assert_array_equal(w[4:8] == row1, [kept] * 4, err_msg=backend)
        assert (w[12:16] != np.asarray(w0, np.float32)[12:16]).all(), backend  # row 3: updated
