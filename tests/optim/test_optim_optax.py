"""The fused update against optax on the touched rows, where optax has the same optimizer.

What is compared, and the differences (each tested below or in test_optim_numpy.py):

* ``optax.sgd``: identical.
* ``optax.adagrad``: optax starts the accumulator at 0.1 and puts eps inside the square
  root (``g / sqrt(m + eps)``); FBGEMM starts at 0 with eps outside
  (``g / (sqrt(m) + eps)``). Equal with ``eps=0`` and the same starting accumulator.
* ``optax.adam`` / ``optax.adamw`` (``eps_root=0``): FBGEMM's Adam *is* adamw, weight
  decay scaled by the learning rate: ``w -= lr * (m̂ / (sqrt(v̂) + eps) + wd * w)``.
* ``optax.lamb``: equal when each row is its own leaf (optax's norms are per leaf,
  FBGEMM's per row).
* ``optax.lars``: per-row leaves and ``weight_decay=0`` only: optax's trust-ratio
  denominator is ``‖g + wd·w‖``, FBGEMM's ``‖g‖ + wd·‖w‖``.
* All: the fused update is lazy (rows outside the batch keep their moments and get no
  weight decay), optax is dense, so multi-step comparisons touch the same rows each step.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optim_testing import HP, LAYOUT, jitted_update, make, merged_grads, random_batch, sparse_grad

from jaxrec import fused, optim

LR, B1, B2, EPS, WD, ETA, MOM = (HP[k] for k in ("learning_rate", "beta1", "beta2", "eps",
                                                  "weight_decay", "eta", "momentum"))
STEPS = 3
update_rows = jax.jit(optim.update_rows, static_argnums=0)

# name: (jaxrec config, optax optimizer, per-row leaves, accumulator start)
CASES = {
    "sgd": (make(optim.SGD), optax.sgd(LR), False, 0.0),
    "adagrad": (make(optim.Adagrad, eps=0.0),
                optax.adagrad(LR, initial_accumulator_value=0.0, eps=0.0), False, 0.0),
    "adagrad_optax_start": (make(optim.Adagrad, eps=0.0), optax.adagrad(LR, eps=0.0), False, 0.1),
    "adam": (make(optim.Adam, weight_decay=0.0), optax.adam(LR, B1, B2, EPS), False, 0.0),
    "adamw": (make(optim.Adam), optax.adamw(LR, B1, B2, EPS, weight_decay=WD), False, 0.0),
    "lamb": (make(optim.LAMB), optax.lamb(LR, B1, B2, EPS, weight_decay=WD), True, 0.0),
    "lars": (make(optim.LarsSGD, weight_decay=0.0),
             optax.lars(LR, weight_decay=0.0, trust_coefficient=ETA, momentum=MOM), True, 0.0),
}


@pytest.mark.parametrize("path", ["reference", "kernel"])
@pytest.mark.parametrize("case", list(CASES))
def test_touched_rows_match_optax(case, path, platform):
    """Over several steps; ``kernel``: the fused CPU/CUDA kernel (fused.fused_update)."""
    config, tx, per_row, start = CASES[case]
    rng = np.random.default_rng(abs(hash(case)) % 2**31)
    tables = [rng.normal(0.0, 0.3, size=(r, d)).astype(np.float32)
              for r, d in zip(LAYOUT.rows, LAYOUT.dims)]
    weights = LAYOUT.merge_embedding_weights([jnp.asarray(t) for t in tables])
    state = optim.init_state(config, LAYOUT)
    if start:
        state = state._replace(momentum1=jnp.full_like(state.momentum1, start))
    indices, offsets, _ = random_batch(rng)
    touched = sorted(merged_grads((indices, offsets, np.ones((4, LAYOUT.total_dim)))))

    def leaves(flat):  # optax's view of the tables: whole tables, or one leaf per touched row
        split = LAYOUT.split_embedding_weights(flat)
        return {key: split[key[0]][key[1]] for key in touched} if per_row else split

    params = leaves(weights)
    opt_state = tx.init(params)
    if path == "reference":
        update = jitted_update(config)
    else:
        kernel = jax.jit(functools.partial(fused.fused_update, layout=LAYOUT, config=config,
                                           backend="kernel"))

    @jax.jit
    def optax_step(params, opt_state, grad):
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes dtypes
            updates, opt_state = tx.update(leaves(grad.to_dense(LAYOUT)), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for _ in range(STEPS):
        grad_output = rng.normal(size=(4, LAYOUT.total_dim)).astype(np.float32)
        grad = sparse_grad((indices, offsets, grad_output))
        if path == "reference":
            weights, state = update(weights, state, grad, config.hyperparams())
        else:
            weights, state = kernel(weights, state, grad_output, indices, offsets)
        params, opt_state = optax_step(params, opt_state, grad)

    got = [np.asarray(t) for t in LAYOUT.split_embedding_weights(weights)]
    params = jax.tree.map(np.asarray, params)
    want = params if per_row else {key: params[key[0]][key[1]] for key in touched}
    moved = max(float(np.max(np.abs(want[k] - tables[k[0]][k[1]]))) for k in touched)
    assert moved > 10 * LR * 1e-3  # the rows really moved
    atol = 16 * STEPS * float(jnp.finfo(jnp.float32).eps) * max(1.0, moved)
    for key in touched:
        np.testing.assert_allclose(got[key[0]][key[1]], want[key], rtol=0, atol=atol,
                                   err_msg=f"{case}: table {key[0]} row {key[1]}")


def test_adagrad_eps_placement_differs_from_optax():
    """One step from a zero accumulator: FBGEMM g / (|g| + eps), optax g / sqrt(g² + eps)."""
    eps = 0.1
    config = make(optim.Adagrad, eps=eps)
    rng = np.random.default_rng(21)
    w = rng.normal(size=(3, 5)).astype(np.float32)
    g = rng.normal(size=(3, 5)).astype(np.float32)
    state = optim.AdagradState(step=jnp.int32(0), momentum1=jnp.zeros((3, 5)))
    ours, _ = update_rows(config, config.hyperparams(), w, g, state)
    tx = optax.adagrad(LR, initial_accumulator_value=0.0, eps=eps)
    theirs = optax.apply_updates(w, tx.update(g, tx.init(w))[0])
    g64, w64 = g.astype(np.float64), w.astype(np.float64)
    np.testing.assert_allclose(ours, w64 - LR * g64 / (np.abs(g64) + eps), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(theirs, w64 - LR * g64 / np.sqrt(g64 * g64 + eps), rtol=1e-6, atol=1e-7)
    assert np.max(np.abs(np.asarray(ours) - np.asarray(theirs))) > 1e-3


def test_lars_weight_decay_denominator_differs_from_optax():
    """Local rate: FBGEMM lr·eta·‖w‖ / (‖g‖ + wd·‖w‖); optax.lars lr·eta·‖w‖ / ‖g + wd·w‖."""
    config = make(optim.LarsSGD)
    rng = np.random.default_rng(22)
    w = rng.normal(size=(1, 6)).astype(np.float32)
    g = rng.normal(size=(1, 6)).astype(np.float32)
    state = optim.LarsSGDState(step=jnp.int32(0), momentum_buffer=jnp.zeros((1, 6)))
    ours, _ = update_rows(config, config.hyperparams(), w, g, state)
    tx = optax.lars(LR, weight_decay=WD, trust_coefficient=ETA, momentum=MOM)
    theirs = optax.apply_updates(w[0], tx.update(g[0], tx.init(w[0]), w[0])[0])
    w64, g64 = w[0].astype(np.float64), g[0].astype(np.float64)
    u = g64 + WD * w64
    wn = np.linalg.norm(w64)
    np.testing.assert_allclose(ours[0], w64 - LR * ETA * wn / (np.linalg.norm(g64) + WD * wn) * u,
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(theirs, w64 - LR * ETA * wn / np.linalg.norm(u) * u, rtol=1e-5, atol=1e-7)
    assert np.max(np.abs(np.asarray(ours[0]) - np.asarray(theirs))) > 1e-6
