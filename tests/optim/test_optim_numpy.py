"""The fused update against a float64 NumPy implementation of FBGEMM's formulas.

Several steps in a row (state carried, step counter from a non-zero start), batches
with duplicate ids across features that share a table, gradient clipping, max_norm and
each weight-decay mode; rows not in a batch stay bit-identical, state included.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optim_testing import (
    LAYOUT,
    _reference_row,
    from_jax,
    jitted_update,
    make,
    merged_grads,
    random_batch,
    random_tables,
    reference_step,
    sparse_grad,
    to_jax,
)

from jaxrec import optim
from jaxrec.ops import SparseRowGrad

# Tolerance = K[state dtype] * steps * (eps of the state dtype) * (size of what it rounds):
# the state's own magnitude, and for the weights the distance they moved (plus float32
# rounding of the weights). Measured worst cases: 3.6 (float32: exp_avg_sq squares the
# float32-summed gradient) and 0.45 (bfloat16); K leaves a margin of 2-4x.
ULP = {jnp.float32: float(jnp.finfo(jnp.float32).eps), jnp.bfloat16: float(jnp.finfo(jnp.bfloat16).eps)}
K = {jnp.float32: 8, jnp.bfloat16: 2}
STEPS = 3

CASES = {
    "sgd": make(optim.SGD),
    "adagrad": make(optim.Adagrad),
    "rowwise_adagrad": make(optim.RowWiseAdagrad),
    "rowwise_adagrad_l2": make(optim.RowWiseAdagrad, weight_decay_mode="l2"),
    "rowwise_adagrad_decoupled": make(optim.RowWiseAdagrad, weight_decay_mode="decoupled"),
    "adam": make(optim.Adam),
    "partial_rowwise_adam": make(optim.PartialRowWiseAdam),
    "lamb": make(optim.LAMB),
    "partial_rowwise_lamb": make(optim.PartialRowWiseLAMB),
    "lars_sgd": make(optim.LarsSGD),
    "rowwise_adagrad_decoupled_max_norm": make(optim.RowWiseAdagrad, weight_decay_mode="decoupled",
                                               max_norm=1.0),
    "partial_rowwise_lamb_max_norm": make(optim.PartialRowWiseLAMB, max_norm=1.0),
}


def _assert_close(got_w, want_w, got_s, want_s, start_w, state_dtype, steps, what):
    ulp, k = ULP[state_dtype], K[state_dtype]
    for t, (gw, ww, w0) in enumerate(zip(got_w, want_w, start_w)):
        moved = np.max(np.abs(ww - w0))
        atol = k * steps * (ulp * moved + ULP[jnp.float32] * np.max(np.abs(ww)))
        np.testing.assert_allclose(gw, ww, rtol=0, atol=atol, err_msg=f"{what}: weights of table {t}")
    for t, (gs, ws) in enumerate(zip(got_s, want_s)):
        for name in ws:
            atol = k * steps * ulp * np.max(np.abs(ws[name]))
            np.testing.assert_allclose(gs[name], ws[name], rtol=0, atol=atol,
                                       err_msg=f"{what}: state {name} of table {t}")


def _run(config, seed, state_dtype=None, weight_dtype=jnp.float32):
    """STEPS fused steps vs the NumPy reference; returns how often max_norm acted.

    Gradient clipping is not update_rows' business (it clamps the output gradient before
    the backward): tests/optim/test_fused_update.py checks it.
    """
    rng = np.random.default_rng(seed)
    want_w, want_s = random_tables(config, rng)
    step0 = int(rng.integers(1, 5))
    weights, state = to_jax(config, want_w, want_s, step0, weight_dtype, state_dtype)
    # The reference starts from exactly what jaxrec holds (rounded to its dtypes).
    want_w, want_s = from_jax(config, weights, state)
    start_w = [w.copy() for w in want_w]
    update = jitted_update(config)
    hparams = config.hyperparams()
    renormed = 0
    for i in range(STEPS):
        batch = random_batch(rng)
        grads = merged_grads(batch)
        assert batch[1][-1] > len(grads), "the batch has no duplicate ids"
        before_w, before_s = from_jax(config, weights, state)
        weights, state = update(weights, state, sparse_grad(batch), hparams)
        renormed += reference_step(config, want_w, want_s, grads, step0 + i)
        assert int(state.step) == step0 + i + 1
        got_w, got_s = from_jax(config, weights, state)
        _assert_close(got_w, want_w, got_s, want_s, start_w, state_dtype or jnp.float32, i + 1,
                      f"step {i}")
        _assert_untouched(grads, before_w, before_s, got_w, got_s)
    return renormed


def _assert_untouched(grads, before_w, before_s, got_w, got_s):
    for t in range(LAYOUT.num_tables):
        untouched = np.ones(LAYOUT.rows[t], bool)
        untouched[[r for (tt, r) in grads if tt == t]] = False
        assert untouched.any()
        np.testing.assert_array_equal(got_w[t][untouched], before_w[t][untouched])
        for name in got_s[t]:
            np.testing.assert_array_equal(got_s[t][name][untouched], before_s[t][name][untouched])


@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference(case):
    config = CASES[case]
    renormed = _run(config, seed=abs(hash(case)) % 2**31)
    if config.max_norm > 0:
        assert renormed > 0, "max_norm never acted: the test would not see it"


@pytest.mark.parametrize("case", ["rowwise_adagrad_l2", "adam", "partial_rowwise_lamb"])
def test_bfloat16_state(case):
    config = dataclasses.replace(CASES[case], state_dtype=jnp.bfloat16)
    state = optim.init_state(config, LAYOUT)
    assert all(getattr(state, n).dtype == jnp.bfloat16 for n in state._fields[1:])
    _run(config, seed=7, state_dtype=jnp.bfloat16)


def test_bfloat16_weights_untouched_rows_bit_identical():
    config = CASES["rowwise_adagrad_l2"]
    rng = np.random.default_rng(3)
    w, s = random_tables(config, rng)
    weights, state = to_jax(config, w, s, 0, weight_dtype=jnp.bfloat16)
    batch = random_batch(rng)
    new_w, new_s = jitted_update(config)(weights, state, sparse_grad(batch), config.hyperparams())
    assert new_w.dtype == jnp.bfloat16
    before_w, before_s = from_jax(config, weights, state)
    got_w, got_s = from_jax(config, new_w, new_s)
    grads = merged_grads(batch)
    _assert_untouched(grads, before_w, before_s, got_w, got_s)
    reference_step(config, before_w, before_s, grads, 0)
    for gw, ww in zip(got_w, before_w):  # bf16 rounding of the stored weight
        np.testing.assert_allclose(gw, ww, rtol=2 * ULP[jnp.bfloat16], atol=1e-6)


def test_update_rows_leaves_columns_past_dim_alone():
    """Rows of a smaller table in a [n, max_dim] batch: extra columns are ignored, unchanged."""
    config = CASES["partial_rowwise_lamb"]
    rng = np.random.default_rng(11)
    n, width = 6, 8
    dims = np.array([8, 3, 5, 8, 1, 4], np.int32)
    w = rng.normal(size=(n, width)).astype(np.float32)
    g = rng.normal(size=(n, width)).astype(np.float32)
    m = rng.normal(0, 0.1, size=(n, width)).astype(np.float32)
    v = np.abs(rng.normal(0, 0.1, size=n)).astype(np.float32)
    state = optim.PartialRowWiseLAMBState(step=jnp.int32(2), exp_avg=m, exp_avg_sq=v)
    new_w, new_s = update_rows(config, config.hyperparams(), w, g, state, dims=dims)
    for i, d in enumerate(dims):
        s = {"exp_avg": m[i, :d].astype(np.float64), "exp_avg_sq": np.float64(v[i])}
        want_w, want_s = reference_row(config, w[i, :d], g[i, :d], s, t=3)
        np.testing.assert_allclose(new_w[i, :d], want_w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(new_s.exp_avg[i, :d], want_s["exp_avg"], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(new_s.exp_avg_sq[i], want_s["exp_avg_sq"], rtol=1e-5)
        np.testing.assert_array_equal(new_w[i, d:], w[i, d:])
        np.testing.assert_array_equal(new_s.exp_avg[i, d:], m[i, d:])
        assert not np.allclose(new_w[i, :d], w[i, :d])
    assert int(new_s.step) == 3


def test_lamb_zero_row_uses_ratio_one():
    """‖w‖ = 0: FBGEMM's unguarded ratio would be 0 (row stuck); jaxrec, like optax, uses 1."""
    config = CASES["lamb"]
    rng = np.random.default_rng(5)
    g = rng.normal(size=(2, 4)).astype(np.float32)
    w = np.stack([np.zeros(4, np.float32), rng.normal(size=4).astype(np.float32)])
    zeros = np.zeros((2, 4), np.float32)
    state = optim.LAMBState(step=jnp.int32(0), exp_avg=zeros, exp_avg_sq=zeros)
    new_w, _ = update_rows(config, config.hyperparams(), w, g, state)
    want = [reference_row(config, w[i], g[i])[0] for i in range(2)]
    np.testing.assert_allclose(new_w, np.stack(want), rtol=1e-5, atol=1e-7)
    assert np.all(new_w[0] != 0)


def test_lars_zero_row_and_zero_gradient_stay_finite():
    config = make(optim.LarsSGD, weight_decay=0.0)
    rng = np.random.default_rng(9)
    w = np.stack([np.zeros(4), rng.normal(size=4), rng.normal(size=4)]).astype(np.float32)
    g = np.stack([rng.normal(size=4), np.zeros(4), rng.normal(size=4)]).astype(np.float32)
    mom = rng.normal(0, 0.1, size=(3, 4)).astype(np.float32)
    state = optim.LarsSGDState(step=jnp.int32(0), momentum_buffer=mom)
    new_w, new_s = update_rows(config, config.hyperparams(), w, g, state)
    assert np.all(np.isfinite(new_w)) and np.all(np.isfinite(new_s.momentum_buffer))
    # lr_local = 0 on both guarded rows: the momentum only decays.
    np.testing.assert_allclose(new_s.momentum_buffer[:2], 0.7 * mom[:2], rtol=1e-6)
    np.testing.assert_allclose(new_w[:2], w[:2] - 0.7 * mom[:2], rtol=1e-6, atol=1e-7)
    want, _ = reference_row(config, w[2], g[2], {"momentum_buffer": mom[2].astype(np.float64)})
    np.testing.assert_allclose(new_w[2], want, rtol=1e-5, atol=1e-7)


update_rows = jax.jit(optim.update_rows, static_argnums=0)


def reference_row(config, w, g, state=None, t=1):
    """(weights, state) of one row after one float64 step."""
    s = state or {n: np.zeros(w.shape) for n in config.state_type._fields[1:]}
    w, s, _ = _reference_row(config, w.astype(np.float64), g.astype(np.float64), s, t)
    return w, s


def test_under_x64_with_padding_entries(x64):
    """int64 offsets when jax_enable_x64 is on; entries past num_unique are ignored.

    The SparseRowGrad is built on the host here, with junk in its padding entries
    (a valid table id, a row, non-zero gradients) that must not be applied.
    """
    config = CASES["partial_rowwise_adam"]
    rng = np.random.default_rng(13)
    weights, state = to_jax(config, *random_tables(config, rng), step=2)
    want_w, want_s = from_jax(config, weights, state)
    grads = merged_grads(random_batch(rng))
    keys = list(grads)
    n, width = len(keys) + 3, max(LAYOUT.dims)
    tables = np.array([t for t, _ in keys] + [0, -1, 0], np.int64)
    rows = np.array([r for _, r in keys] + [7, 2, 20], np.int64)
    g = rng.normal(size=(n, width)).astype(np.float32)
    for i, key in enumerate(keys):
        g[i, :grads[key].size] = grads[key]
    grad = SparseRowGrad(jnp.asarray(tables), jnp.asarray(rows), jnp.asarray(g), jnp.int32(len(keys)))
    before_w, before_s = want_w, want_s
    weights, state = jitted_update(config)(weights, state, grad, config.hyperparams())
    want_w, want_s = [w.copy() for w in before_w], [{k: v.copy() for k, v in s.items()} for s in before_s]
    reference_step(config, want_w, want_s, grads, 2)
    got_w, got_s = from_jax(config, weights, state)
    _assert_close(got_w, want_w, got_s, want_s, before_w, jnp.float32, 1, "x64")
    _assert_untouched(grads, before_w, before_s, got_w, got_s)
