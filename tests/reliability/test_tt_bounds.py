"""Fused TT tables: a bad id under NONE trains nothing, and ``gradient_clipping`` clamps
the lookup's output gradient as FBGEMM does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrec.fused import TTEmbeddingTables, make_functional_train_step, tt_fused_lookup
from jaxrec.ops import TTLayout
from jaxrec.optim import SGD, Adagrad

LAYOUT = TTLayout.create(60, 8, [4], [4, 15], [2, 4])


def bags(rng):
    lengths = rng.integers(1, 4, 5)
    values = rng.integers(0, 60, lengths.sum()).astype(np.int32)
    return values, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def train(config, loss_of_acts, batches):
    tables = TTEmbeddingTables.create(LAYOUT, config, key=jax.random.key(0))

    def loss_fn(params, tables, indices, offsets):
        acts = tt_fused_lookup(tables, indices, offsets, bounds_check_mode="NONE")
        return loss_of_acts(acts) + 0.0 * params["x"]

    params, dense = {"x": jnp.ones(())}, optax.sgd(0.0)
    step, opt_state = make_functional_train_step(loss_fn, dense), dense.init(params)
    for indices, offsets in batches:
        params, opt_state, tables, _ = step(params, opt_state, tables, indices, offsets)
    step.check()
    return tables


def test_bad_ids_under_none_train_as_if_absent():
    rng = np.random.default_rng(0)
    bad = np.array([60, 60 + 2**20, -3] * 2, np.int32)
    clean = [bags(rng) for _ in range(4)]
    # The same batches with the bad ids added to the first bag: NONE drops them (no row, no
    # gradient), so SUM pooling and the fused Adagrad steps see the clean batches.
    dirty = [(np.concatenate([bad, values]), np.concatenate([[0], offsets[1:] + len(bad)]).astype(np.int32))
             for values, offsets in clean]
    loss = lambda a: jnp.sum(a ** 2)
    want = train(Adagrad(learning_rate=0.1), loss, clean)
    got = train(Adagrad(learning_rate=0.1), loss, dirty)
    start = TTEmbeddingTables.create(LAYOUT, Adagrad(), key=jax.random.key(0)).cores
    for a, b, c in zip(got.cores, want.cores, start):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
        assert not np.allclose(np.asarray(b), np.asarray(c))  # the cores did train


def test_gradient_clipping_clamps_the_output_gradient():
    rng = np.random.default_rng(1)
    batches = [bags(rng) for _ in range(2)]
    scale = jnp.asarray(rng.normal(0, 3.0, (5, 8)), jnp.float32)  # many entries beyond +-1
    clipped = train(SGD(learning_rate=0.1, gradient_clipping=True, max_gradient=1.0),
                    lambda a: jnp.sum(a * scale), batches)
    manual = train(SGD(learning_rate=0.1), lambda a: jnp.sum(a * jnp.clip(scale, -1.0, 1.0)),
                   batches)
    for a, b in zip(clipped.cores, manual.cores):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    unclipped = train(SGD(learning_rate=0.1), lambda a: jnp.sum(a * scale), batches)
    assert not np.allclose(np.asarray(unclipped.cores[0]), np.asarray(clipped.cores[0]))
