"""Learning-rate schedules: a fused optimizer's ``learning_rate`` may be an optax schedule,
evaluated at the tables' step count inside the jitted step (no recompilation)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optim_testing import make, random_batch

from jaxrec import fused, optim
from jaxrec.fused import fused_update
from jaxrec.ops import TableLayout, embedding_bag_lookup

LAYOUT = TableLayout(rows=(311, 97), dims=(8, 4), feature_table_map=(0, 1, 0))
SCHEDULE = optax.linear_schedule(init_value=0.5, end_value=0.05, transition_steps=3)


def batch(seed):
    indices, offsets, _ = random_batch(np.random.default_rng(seed), LAYOUT, id_range=20)
    return jnp.asarray(indices), jnp.asarray(offsets)


@pytest.mark.parametrize("cls", [optim.SGD, optim.RowWiseAdagrad, optim.Adam])
def test_train_step_follows_the_schedule_with_one_compilation(platform, cls):
    traces = []

    def loss_fn(params, tables, indices, offsets):
        traces.append(1)  # runs once per trace: one trace, one compilation
        acts = fused.fused_lookup(tables, indices, offsets)
        return jnp.mean(jnp.tanh(acts @ params) ** 2)

    tables = fused.FusedEmbeddingTables.create(LAYOUT, make(cls, learning_rate=SCHEDULE),
                                               key=jax.random.key(0))
    params = jax.random.normal(jax.random.key(1), (LAYOUT.total_dim,))
    dense = optax.sgd(0.0)  # the dense part stays put: the tables' update is under test
    opt_state = dense.init(params)
    step = fused.make_functional_train_step(loss_fn, dense)
    rates = []
    for k in range(5):
        indices, offsets = batch(k)
        # The same update by hand, at the schedule's rate for this step, from copies.
        w, s = tables.weights.copy(), jax.tree.map(lambda x: x.copy(), tables.state)
        acts = embedding_bag_lookup(w, indices, offsets, layout=LAYOUT)
        grad = jax.grad(lambda a, p: jnp.mean(jnp.tanh(a @ p) ** 2))(acts, params)
        rate = float(SCHEDULE(k))
        rates.append(rate)
        want_w, _ = fused_update(w, s, grad, indices, offsets, layout=LAYOUT,
                                 config=make(cls, learning_rate=rate))
        params, opt_state, tables, _ = step(params, opt_state, tables, indices, offsets)
        # The step's gradient and the one by hand round differently on a GPU (about 4e-5 of
        # a row after Adagrad's division); a rate off by one step moves rows by ~1e-2.
        np.testing.assert_allclose(tables.weights, want_w, rtol=1e-4, atol=1e-5, err_msg=f"step {k}")
    assert len(traces) == 1
    assert int(tables.step) == 5
    assert len(set(rates)) == 4  # 0.5 ... 0.05, then held: the rate did move


def test_functional_fused_update_reads_the_rate_at_state_step(platform):
    config = make(optim.RowWiseAdagrad, learning_rate=SCHEDULE)
    rng = np.random.default_rng(3)
    indices, offsets, grad = random_batch(rng, LAYOUT, id_range=20)
    weights = jax.random.normal(jax.random.key(2), (LAYOUT.num_weights,))
    state = optim.init_state(config, LAYOUT)._replace(step=jnp.int32(2))
    got, _ = fused_update(weights, state, grad, indices, offsets, layout=LAYOUT, config=config)
    fixed = make(optim.RowWiseAdagrad, learning_rate=float(SCHEDULE(2)))
    want, _ = fused_update(weights, state, grad, indices, offsets, layout=LAYOUT, config=fixed)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_a_scheduled_config_is_static_and_refuses_set_learning_rate():
    config = optim.RowWiseAdagrad(learning_rate=SCHEDULE)
    assert hash(config) == hash(optim.RowWiseAdagrad(learning_rate=SCHEDULE))
    np.testing.assert_allclose(config.hyperparams().learning_rate, 0.5)
    tables = fused.FusedEmbeddingTables.create(LAYOUT, config, key=jax.random.key(0))
    with pytest.raises(ValueError, match="follows the schedule"):
        fused.set_learning_rate({"t": tables}, 0.1)
    with pytest.raises(TypeError, match="schedule"):
        optim.RowWiseAdagrad(learning_rate="0.1x")
