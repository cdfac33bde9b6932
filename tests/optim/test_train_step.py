"""The custom_vjp form: fused_lookup + make_train_step (the partitioned optimizer).

* One train step equals the explicit form (lookup, grad of the activations, fused_update)
  and optax on the dense parameters.
* The tables are updated in place: the same device buffer before and after, and no
  table-sized copy in the compiled step.
* Guards: a lookup that does not reach the loss leaves its tables and state exactly as
  they were; two lookups of one table raise; plain jax.grad raises.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optim_testing import make, random_batch

from jaxrec import fused, optim
from jaxrec.fused import fused_update
from jaxrec.ops import TableLayout, embedding_bag_lookup

LAYOUT = TableLayout(rows=(1031, 517), dims=(16, 8), feature_table_map=(0, 1, 0))
OTHER = TableLayout(rows=(211,), dims=(12,), feature_table_map=(0,))


def batch(seed, layout=LAYOUT):
    indices, offsets, _ = random_batch(np.random.default_rng(seed), layout, id_range=40)
    return jnp.asarray(indices), jnp.asarray(offsets)


def dense_params(layout=LAYOUT):
    return {"w": jax.random.normal(jax.random.key(1), (layout.total_dim,)), "b": jnp.float32(0.3)}


def loss_fn(params, tables, indices, offsets):
    acts = fused.fused_lookup(tables, indices, offsets, pooling="mean")
    return jnp.mean(jnp.tanh(acts @ params["w"] + params["b"]) ** 2)


def new_tables(config=None, name="tables", layout=LAYOUT, seed=0):
    config = config or make(optim.RowWiseAdagrad, learning_rate=0.5)
    return fused.FusedEmbeddingTables.create(layout, config, key=jax.random.key(seed), name=name)


def copy(tree):
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)


# The step (one jitted program) and the explicit form (op by op) round the dense path
# differently: a relative error of about total_dim float32 roundoffs in a row's gradient.
# Row-wise Adagrad scales the gradient by 1/sqrt(mean g^2) (at most sqrt(dim) per
# element), so each step's update may differ by lr * sqrt(dim) * total_dim * 2**-24.
WEIGHTS_ATOL = 3 * 0.5 * np.sqrt(max(LAYOUT.dims)) * LAYOUT.total_dim * 2.0**-24  # 3 steps, lr 0.5


def test_step_equals_the_explicit_form_and_optax(platform):
    tables, params, dense = new_tables(), dense_params(), optax.adam(0.01)
    opt_state = dense.init(params)
    step = fused.make_functional_train_step(loss_fn, dense)
    for seed in range(3):
        indices, offsets = batch(seed)
        # The explicit form, from copies (the step donates its arguments).
        w, s, p, o = copy((tables.weights, tables.state, params, opt_state))

        def dense_loss(p, acts):
            return jnp.mean(jnp.tanh(acts @ p["w"] + p["b"]) ** 2)

        acts = embedding_bag_lookup(w, indices, offsets, layout=LAYOUT, pooling="mean")
        loss, (dense_grad, act_grad) = jax.value_and_grad(dense_loss, argnums=(0, 1))(p, acts)
        want_w, want_s = fused_update(w, s, act_grad, indices, offsets, layout=LAYOUT,
                                      config=tables.config, pooling="mean")
        with jax.numpy_dtype_promotion("standard"):
            updates, want_o = dense.update(dense_grad, o, p)
        want_p = optax.apply_updates(p, updates)

        params, opt_state, tables, got_loss = step(params, opt_state, tables, indices, offsets)
        np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
        np.testing.assert_allclose(tables.weights, want_w, rtol=1e-5, atol=WEIGHTS_ATOL)
        np.testing.assert_allclose(tables.state.momentum1, want_s.momentum1, rtol=1e-5, atol=1e-9)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), params, want_p)
    assert int(tables.step) == 3


@pytest.mark.parametrize("config", [make(optim.RowWiseAdagrad), make(optim.Adam)],
                         ids=["rowwise_adagrad", "adam"])
def test_step_updates_tables_in_place(platform, config):
    tables, params, dense = new_tables(config), dense_params(), optax.sgd(0.1)
    opt_state = dense.init(params)
    step = fused.make_functional_train_step(loss_fn, dense)
    indices, offsets = batch(0)
    hlo = step.lower(params, opt_state, tables, indices, offsets).compile().as_text()
    table_shape = f"f32[{LAYOUT.num_weights}]"
    copies = [line for line in hlo.splitlines()
              if table_shape in line and re.search(r"= f32\[\d+\]\{?0?\}? copy\(", line)]
    assert not copies, copies
    assert "input_output_alias" in hlo

    buffers = [tables.weights.unsafe_buffer_pointer()] + [
        getattr(tables.state, f).unsafe_buffer_pointer() for f in tables.state._fields[1:]]
    params, opt_state, tables, _ = step(params, opt_state, tables, indices, offsets)
    after = [tables.weights.unsafe_buffer_pointer()] + [
        getattr(tables.state, f).unsafe_buffer_pointer() for f in tables.state._fields[1:]]
    assert after == buffers


def test_without_donation_the_step_copies_the_tables(platform):
    """What donation saves: the undonated step must keep the old tables and copies them."""
    tables, params, dense = new_tables(), dense_params(), optax.sgd(0.1)
    step = fused.make_functional_train_step(loss_fn, dense, donate=False)
    indices, offsets = batch(0)
    before = tables.weights.unsafe_buffer_pointer()
    _, _, updated, _ = step(params, dense.init(params), tables, indices, offsets)
    assert updated.weights.unsafe_buffer_pointer() != before
    assert not np.array_equal(updated.weights, tables.weights)  # the old tables are intact


def test_unused_lookup_leaves_tables_unchanged(platform):
    used, unused = new_tables(name="used"), new_tables(name="unused", layout=OTHER, seed=3)
    params, dense = dense_params(), optax.sgd(0.1)
    other_indices, other_offsets = batch(7, OTHER)

    def loss(params, tables, indices, offsets):
        dead = fused.fused_lookup(tables["unused"], other_indices, other_offsets)  # never reaches the loss
        del dead
        return loss_fn(params, tables["used"], indices, offsets)

    before = copy({"used": used, "unused": unused})
    step = fused.make_functional_train_step(loss, dense)
    _, _, after, _ = step(params, dense.init(params), {"used": used, "unused": unused}, *batch(0))
    np.testing.assert_array_equal(after["unused"].weights, before["unused"].weights)
    np.testing.assert_array_equal(after["unused"].state.momentum1, before["unused"].state.momentum1)
    assert int(after["unused"].step) == 0
    assert int(after["used"].step) == 1
    assert not np.array_equal(after["used"].weights, before["used"].weights)


def test_unused_lookup_with_adam_keeps_its_moments(platform):
    """A zero gradient would still decay Adam's moments and move the rows: it must not run."""
    tables = new_tables(make(optim.Adam), name="t")
    trained = fused.make_functional_train_step(loss_fn, optax.sgd(0.1))
    params = dense_params()
    params, _, tables, _ = trained(params, optax.sgd(0.1).init(params), tables, *batch(0))
    before = copy(tables)

    def ignores_tables(params, tables, indices, offsets):
        fused.fused_lookup(tables, indices, offsets)
        return jnp.sum(params["w"] ** 2)

    step = fused.make_functional_train_step(ignores_tables, optax.sgd(0.1))
    _, _, after, _ = step(params, optax.sgd(0.1).init(params), tables, *batch(1))
    for field in ("weights",):
        np.testing.assert_array_equal(getattr(after, field), getattr(before, field))
    np.testing.assert_array_equal(after.state.exp_avg, before.state.exp_avg)
    np.testing.assert_array_equal(after.state.exp_avg_sq, before.state.exp_avg_sq)
    assert int(after.step) == int(before.step) == 1


def test_two_lookups_of_one_table_raise(platform):
    tables, params = new_tables(), dense_params()

    def twice(params, tables, indices, offsets):
        return loss_fn(params, tables, indices, offsets) + loss_fn(params, tables, indices, offsets)

    step = fused.make_functional_train_step(twice, optax.sgd(0.1), donate=False)
    with pytest.raises(ValueError, match="looked up .* times in one loss"):
        step(params, optax.sgd(0.1).init(params), tables, *batch(0))


def test_duplicate_table_names_raise(platform):
    a, b = new_tables(name="same"), new_tables(name="same", seed=1)
    vg = fused.fused_value_and_grad(lambda p, t: jnp.sum(fused.fused_lookup(t[0], *batch(0))))
    with pytest.raises(ValueError, match="names must be unique"):
        vg(dense_params(), (a, b))


def test_plain_grad_raises():
    tables = new_tables()
    with pytest.raises(RuntimeError, match="outside jaxrec.fused.fused_value_and_grad"):
        jax.grad(loss_fn, argnums=1, allow_int=True)(dense_params(), tables, *batch(0))


def test_learning_rate_changes_without_recompiling(platform):
    tables, params, dense = new_tables(make(optim.SGD)), dense_params(), optax.sgd(0.0)
    step = fused.make_functional_train_step(loss_fn, dense)
    opt_state = dense.init(params)
    params, opt_state, tables, _ = step(params, opt_state, tables, *batch(0))
    tables = fused.set_learning_rate(tables, 0.0)
    before = tables.weights.copy()
    params, opt_state, tables, _ = step(params, opt_state, tables, *batch(1))
    np.testing.assert_array_equal(tables.weights, before)  # lr 0: nothing moves
    assert step._cache_size() == 1


def test_committed_state_compiles_the_step_once():
    # A restored model's arrays are committed to their device; the step's first latch
    # must be too, or the second step (all inputs committed) compiles again.
    device = jax.devices()[0]
    tables, params = jax.device_put((new_tables(make(optim.SGD)), dense_params()), device)
    dense = optax.sgd(0.1)
    step = fused.make_functional_train_step(loss_fn, dense)
    opt_state = jax.device_put(dense.init(params), device)
    for k in range(3):
        params, opt_state, tables, _ = step(params, opt_state, tables, *batch(k))
    assert step._cache_size() == 1


def test_state_access_like_fbgemm():
    tables = new_tables()
    per_table = tables.split_embedding_weights()
    assert [t.shape for t in per_table] == [(1031, 16), (517, 8)]
    states = tables.split_optimizer_states()
    assert states[1]["momentum1"].shape == (517,)
    assert float(tables.set_hyperparams(eps=0.5).hparams.eps) == 0.5
    with pytest.raises(ValueError, match="unknown hyperparameters"):
        tables.set_hyperparams(epsilon=1.0)


def test_create_from_the_callers_weights_leaves_them_alive_after_a_donating_step():
    mine = jax.random.normal(jax.random.key(4), (LAYOUT.num_weights,))
    kept = np.asarray(jax.random.normal(jax.random.key(4), (LAYOUT.num_weights,)))  # no view of mine
    tables = fused.FusedEmbeddingTables.create(LAYOUT, make(optim.SGD, learning_rate=0.1), weights=mine)
    params, dense = dense_params(), optax.sgd(0.0)
    step = fused.make_functional_train_step(loss_fn, dense)
    step(params, dense.init(params), tables, *batch(0))
    np.testing.assert_array_equal(np.asarray(mine), kept)  # reading a donated array would raise
