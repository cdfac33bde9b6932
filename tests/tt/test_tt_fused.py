"""TTEmbeddingTables: the fused SGD / Adagrad of the cores.

* Training through ``make_train_step`` equals plain training of the cores by the
  matching optimizer (optax.sgd; EXACT_ADAGRAD written out below) applied to
  ``jax.grad`` through ``tt_embedding_bag``.
* The fused lookup's output and per-sample-weight gradient are ``tt_embedding_bag``'s,
  ``full_weight`` is the cores' table, and a regression problem trains to a dense table.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tt_testing import (
    GARBAGE_ID,
    LAYOUTS,
    layout,
    pool_numpy,
    random_bags,
    random_cores,
    rows_numpy,
    zipf_ids,
)

from jaxrec import fused, optim
from jaxrec.ops import PoolingMode, tt_embedding_bag

SUM, MEAN = PoolingMode.SUM, PoolingMode.MEAN
LAY = LAYOUTS[3]  # n = 97, p = (3, 5, 7), q = (3, 1, 5), ranks (3, 5)
LR, EPS, DENSE_LR = 0.05, 1e-3, 0.1
CONFIGS = {"sgd": optim.SGD(learning_rate=LR), "adagrad": optim.Adagrad(learning_rate=LR, eps=EPS)}


def copy(tree):
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def adagrad(param, grad, m):
    """FBGEMM's EXACT_ADAGRAD, float32: ``m`` starts at 0 and ``eps`` is outside the sqrt.

    (optax.adagrad is another formula: ``g / sqrt(m + eps)``, 0 where ``m == 0``, and
    ``m`` starting at ``initial_accumulator_value``.)
    """
    m = m + grad * grad
    return param - LR * grad / (jnp.sqrt(m) + EPS), m


def batch_stream(seed, num_features, weighted, steps, below=None, num_bags=5):
    """Batches (indices, offsets, psw) with empty bags, duplicates, padding; ids < ``below``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        indices, offsets, psw = random_bags(rng, LAY, num_features * num_bags, max_len=4,
                                            long_bag=7, weighted=weighted, capacity=64)
        if below is not None:
            indices = np.where(indices == GARBAGE_ID, indices, indices % below).astype(np.int32)
        out.append((indices, offsets, psw))
    return out


# --- fused training == optax on the cores ----------------------------------------------


def _losses(pooling, num_features):
    def head(params, out, target):
        return jnp.mean((jnp.tanh(out) @ params["w"] - target) ** 2)

    def fused_loss(params, tables, indices, offsets, psw, target):
        out = fused.tt_fused_lookup(tables, indices, offsets, pooling=pooling, per_sample_weights=psw,
                                    num_features=num_features)
        return head(params, out, target)

    def plain(params, cores, indices, offsets, psw, target):
        out = tt_embedding_bag(cores, indices, offsets, layout=LAY, pooling=pooling,
                               per_sample_weights=psw, num_features=num_features)
        return head(params, out, target)

    return fused_loss, plain


@pytest.mark.parametrize("name, pooling, weighted, num_features", [
    ("sgd", SUM, False, 1), ("adagrad", MEAN, True, 2)])
def test_fused_steps_equal_optax_on_the_cores(name, pooling, weighted, num_features):
    config = CONFIGS[name]
    rng = np.random.default_rng(1)
    cores = random_cores(rng, LAY)
    params = {"w": jnp.asarray(rng.normal(size=(num_features * LAY.embedding_dim, 2)), jnp.float32)}
    # ids < 70 never have digit 0 = 2: the slice cores[0][:, 2] gets no gradient.
    stream = batch_stream(2, num_features, weighted, steps=4, below=70)
    targets = [rng.normal(size=(5, 2)).astype(np.float32) for _ in stream]
    fused_loss, plain_loss = _losses(pooling, num_features)
    dense = optax.sgd(DENSE_LR)

    tables = fused.TTEmbeddingTables.create(LAY, config, cores=cores)
    step = fused.make_functional_train_step(fused_loss, dense)
    opt_state = dense.init(params)

    core_opt = optax.sgd(LR)

    @jax.jit
    def plain_step(params, cores, core_state, batch):
        loss, (gp, gc) = jax.value_and_grad(plain_loss, argnums=(0, 1))(params, cores, *batch)
        params = optax.apply_updates(params, dense.update(gp, dense.init(params))[0])
        if name == "sgd":
            updates, core_state = core_opt.update(gc, core_state)
            return params, optax.apply_updates(cores, updates), core_state, loss
        new = [adagrad(c, g, m) for c, g, m in zip(cores, gc, core_state)]
        return params, tuple(c for c, _ in new), tuple(m for _, m in new), loss

    want_p, want_c = copy(params), tuple(jnp.asarray(c) for c in cores)
    want_s = core_opt.init(want_c) if name == "sgd" else tuple(jnp.zeros_like(c) for c in want_c)
    for (indices, offsets, psw), target in zip(stream, targets):
        batch = (indices, offsets, psw, target)
        params, opt_state, tables, loss = step(params, opt_state, tables, *batch)
        want_p, want_c, want_s, want_loss = plain_step(want_p, want_c, want_s, batch)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)

    assert int(tables.step) == 4
    for got, want, start in zip(tables.cores, want_c, cores):
        assert rel_err(got, want) < 1e-5
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(np.abs(want).max()))
        assert rel_err(got, start) > 1e-3  # the cores did train
    np.testing.assert_allclose(params["w"], want_p["w"], rtol=1e-5, atol=1e-6)
    if name == "adagrad":
        for slot, m in zip(tables.slots, want_s):
            assert rel_err(slot["momentum1"], m) < 1e-5
    else:
        assert all(slot == {} for slot in tables.slots)
    # A core entry that gets no gradient is left exactly unchanged.
    np.testing.assert_array_equal(tables.cores[0][:, 2], cores[0][:, 2])


def test_a_lookup_that_does_not_reach_the_loss_changes_nothing():
    make = lambda name, seed: fused.TTEmbeddingTables.create(
        LAY, CONFIGS["adagrad"], cores=random_cores(np.random.default_rng(seed), LAY), name=name)
    tables = {"used": make("used", 4), "unused": make("unused", 5), "absent": make("absent", 6)}
    before = copy(tables)
    (indices, offsets, _), = batch_stream(7, 1, False, steps=1)

    def loss_fn(params, tables, indices, offsets):
        out = fused.tt_fused_lookup(tables["used"], indices, offsets)
        fused.tt_fused_lookup(tables["unused"], indices, offsets)  # computed, not used
        return jnp.sum(out**2) * params["s"]

    dense = optax.sgd(0.1)
    params = {"s": jnp.float32(1.5)}
    step = fused.make_functional_train_step(loss_fn, dense)
    _, _, after, _ = step(params, dense.init(params), tables, indices, offsets)
    assert int(after["used"].step) == 1
    assert rel_err(after["used"].cores[1], before["used"].cores[1]) > 1e-3
    for name in ("unused", "absent"):
        assert int(after[name].step) == 0
        for got, want in zip(jax.tree.leaves(after[name]), jax.tree.leaves(before[name])):
            np.testing.assert_array_equal(got, want)

    def twice(params, tables, indices, offsets):
        return jnp.sum(fused.tt_fused_lookup(tables["used"], indices, offsets)) + jnp.sum(
            fused.tt_fused_lookup(tables["used"], indices, offsets))

    with pytest.raises(ValueError, match="looked up"):
        jax.eval_shape(fused.fused_value_and_grad(twice), params, before, indices, offsets)


def test_create_errors():
    with pytest.raises(TypeError, match="SGD or Adagrad"):
        fused.TTEmbeddingTables.create(LAY, optim.RowWiseAdagrad(), key=jax.random.key(0))
    with pytest.raises(ValueError, match="key="):
        fused.TTEmbeddingTables.create(LAY, optim.SGD())
    with pytest.raises(ValueError, match=r"cores\[0\]"):
        fused.TTEmbeddingTables.create(LAY, optim.SGD(), cores=[np.ones((1, 2, 3, 4), np.float32)] * 3)
    with pytest.raises(RuntimeError, match="fused_value_and_grad"):
        tables = fused.TTEmbeddingTables.create(LAY, optim.SGD(), cores=random_cores(np.random.default_rng(0), LAY))
        jax.eval_shape(jax.grad(lambda t: jnp.sum(fused.tt_fused_lookup(
            t, np.array([1], np.int32), np.array([0, 1], np.int32))), allow_int=True), tables)


# --- the lookup, its weight gradient and full_weight ------------------------------------


@functools.cache
def _linear_step(pooling, num_features):
    """Jitted ``fused_value_and_grad`` of ``sum(g * lookup)``; ``params["psw"]`` are the weights."""

    def loss_fn(params, tables, indices, offsets, g):
        out = fused.tt_fused_lookup(tables, indices, offsets, pooling=pooling, num_features=num_features,
                                    per_sample_weights=params["psw"])
        return jnp.sum(out * g)

    return jax.jit(fused.fused_value_and_grad(loss_fn))


@functools.partial(jax.jit, static_argnames=("pooling", "num_features"))
def _tt_grads(cores, w, indices, offsets, g, *, pooling, num_features):
    """Gradients of ``sum(g * tt_embedding_bag)`` w.r.t. the cores and the weights."""
    return jax.grad(lambda c, w: jnp.sum(g * tt_embedding_bag(
        c, indices, offsets, layout=LAY, pooling=pooling, per_sample_weights=w,
        num_features=num_features)), argnums=(0, 1))(cores, w)


@pytest.mark.parametrize("name, pooling, num_features", [("adagrad", MEAN, 2), ("sgd", SUM, 1)])
def test_lookup_and_weight_gradient_are_the_tt_ops(name, pooling, num_features):
    """One fused step with per-sample weights: the output is ``tt_embedding_bag``'s, the
    weights' gradient is ``jax.grad`` of it, and ``full_weight`` is the cores' table."""
    rng = np.random.default_rng(8)
    tables = fused.TTEmbeddingTables.create(LAY, CONFIGS[name], cores=random_cores(rng, LAY))
    (indices, offsets, psw), = batch_stream(9, num_features, True, steps=1)
    g = rng.normal(size=(5, num_features * LAY.embedding_dim)).astype(np.float32)

    served = jax.jit(functools.partial(fused.tt_fused_lookup, pooling=pooling, num_features=num_features))(
        tables, indices, offsets, per_sample_weights=psw)
    want = jax.jit(functools.partial(tt_embedding_bag, layout=LAY, pooling=pooling,
                                     num_features=num_features))(
        tables.cores, indices, offsets, per_sample_weights=psw)
    np.testing.assert_allclose(served, want, rtol=1e-5, atol=1e-6)

    _, dense_grads, trained = _linear_step(pooling, num_features)(
        {"psw": psw}, tables, indices, offsets, g)
    _, want_gw = _tt_grads(tables.cores, psw, indices, offsets, g, pooling=pooling,
                           num_features=num_features)
    np.testing.assert_allclose(dense_grads["psw"], want_gw, rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(want_gw)).max() > 0
    assert int(trained.step) == 1

    full = jax.jit(lambda t: t.full_weight())(trained)
    np.testing.assert_allclose(full, rows_numpy(trained.cores, np.arange(LAY.num_embeddings), LAY),
                               rtol=1e-5, atol=1e-6)


def test_training_fits_a_dense_table():
    """SGD on pooled regression targets of a random dense table, Zipf-distributed ids.

    The TT (p = (3, 3, 3), q = (2, 2, 2), ranks (6, 6)) can represent any 27 x 8 table.
    Training must reduce the held-out loss below 10% of its start and fit the 6 hottest
    rows within 30% of their norm (measured: ~5% loss, ~16% rows).
    """
    lay = layout(27, (3, 3, 3), (2, 2, 2), (6, 6))
    rng = np.random.default_rng(0)
    target_table = rng.normal(size=(lay.num_embeddings, lay.embedding_dim))
    perm = rng.permutation(lay.num_embeddings)
    num_bags = 32

    def make_batch(rng):
        offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 4, num_bags))]).astype(np.int32)
        indices = zipf_ids(rng, lay.num_embeddings, 3 * num_bags, a=1.1, perm=perm).astype(np.int32)
        return indices, offsets, pool_numpy(target_table, indices, offsets, SUM).astype(np.float32)

    def loss_fn(params, tables, indices, offsets, target):
        out = fused.tt_fused_lookup(tables, indices, offsets)
        return jnp.mean(jnp.sum((out - target) ** 2, axis=1))

    batches = [make_batch(np.random.default_rng(i)) for i in range(150)]
    held_out = make_batch(np.random.default_rng(999))
    evaluate = jax.jit(lambda t: loss_fn(None, t, *held_out))
    step = fused.make_functional_train_step(loss_fn, optax.sgd(0.0))
    cores = random_cores(np.random.default_rng(7), lay, row_std=0.5)

    tables = fused.TTEmbeddingTables.create(lay, optim.SGD(learning_rate=0.1), cores=cores)
    start = float(evaluate(tables))
    params, opt_state = {}, optax.sgd(0.0).init({})
    for batch in batches:
        params, opt_state, tables, _ = step(params, opt_state, tables, *batch)
    full = np.asarray(tables.full_weight())
    counts = np.bincount(np.concatenate([i[: o[-1]] for i, o, _ in batches]), minlength=lay.num_embeddings)
    hot = np.argsort(-counts, kind="stable")[:6]
    assert np.all(np.isfinite(full))
    assert float(evaluate(tables)) / start < 0.1
    assert rel_err(full[hot], target_table[hot]) < 0.3


# --- CUDA: the fused update with backend="kernel" vs backend="reference" ---------------------


KERNEL_RTOL = 1e-4  # of each array's scale: float32 atomics reorder the sums
# The kernel computes only the core gradients; the update is the shared update_rows,
# tested against optax above. So the problem is kept well-conditioned, so that the
# comparison measures the kernel and not how fast three steps amplify rounding:
# * cores scaled by 0.15 (bags then stay below 0.1; unscaled, bags of 20 reach 30, a
#   step changes the cores by more than their size and tanh saturates), and lr = 0.005
#   (each step moves the cores by about 10% of their largest entry);
# * Adagrad's eps 0.1, not 1e-3: with a tiny eps the first step is about lr * sign(g),
#   and float32 reordering noise on gradient entries near zero would become update
#   differences of up to lr. With eps = 0.1 an update moves at most lr / eps times its
#   gradient's error.
KERNEL_LR, KERNEL_CORE_SCALE = 0.005, 0.15
KERNEL_CONFIGS = {"sgd": optim.SGD(learning_rate=KERNEL_LR),
                  "adagrad": optim.Adagrad(learning_rate=KERNEL_LR, eps=0.1)}


@pytest.fixture
def cuda():
    with jax.default_device(jax.devices("cuda")[0]):
        yield


@pytest.mark.gpu
@pytest.mark.parametrize("name, pooling, weighted", [("sgd", SUM, False), ("adagrad", MEAN, True),
                                                     ("adagrad", SUM, False), ("sgd", MEAN, True)])
def test_kernel_fused_steps_match_reference(cuda, name, pooling, weighted):
    """Three steps on the benchmark-like layout (B = 64, up to 20 ids a bag).
    Tolerance 1e-4 of each array's scale (atomics)."""
    from jaxrec.ops import TTLayout

    lay = TTLayout.create(11_000_000, 64, [32, 32])
    rng = np.random.default_rng(41)
    cores = [c * KERNEL_CORE_SCALE for c in random_cores(rng, lay)]
    perm = rng.permutation(lay.num_embeddings)[:5000]  # a Zipf stream over 5000 ids
    batches = []
    for _ in range(3):
        indices, offsets, psw = random_bags(rng, lay, 64, max_len=20, long_bag=20, weighted=weighted,
                                            capacity=1024)
        indices[: offsets[-1]] = zipf_ids(rng, 5000, int(offsets[-1]), a=1.2, perm=perm)
        g = rng.normal(size=(64, lay.embedding_dim)).astype(np.float32)
        batches.append((indices, offsets, psw, g))

    results = {}
    for backend in ("kernel", "reference"):
        def loss_fn(params, tables, indices, offsets, psw, g, backend=backend):
            out = fused.tt_fused_lookup(tables, indices, offsets, pooling=pooling, per_sample_weights=psw,
                                        backend=backend)
            return jnp.sum(jnp.tanh(out) * g)

        tables = fused.TTEmbeddingTables.create(lay, KERNEL_CONFIGS[name], cores=cores)
        step = fused.make_functional_train_step(loss_fn, optax.sgd(0.0))
        params, opt_state, losses = {}, optax.sgd(0.0).init({}), []
        for batch in batches:
            params, opt_state, tables, loss = step(params, opt_state, tables, *batch)
            losses.append(float(loss))
        results[backend] = (losses, jax.tree.map(np.asarray, (tables.cores, tables.slots)))

    (losses_k, state_k), (losses_r, state_r) = results["kernel"], results["reference"]
    np.testing.assert_allclose(losses_k, losses_r, rtol=KERNEL_RTOL)
    cores_k, slots_k = state_k
    cores_r, slots_r = state_r
    for a, b, start in zip(cores_k, cores_r, cores):
        np.testing.assert_allclose(a, b, rtol=0, atol=KERNEL_RTOL * float(np.abs(b).max()))
        assert rel_err(b, start) > 1e-4  # the cores did train
    for a, b in zip(jax.tree.leaves(slots_k), jax.tree.leaves(slots_r)):
        np.testing.assert_allclose(a, b, rtol=0, atol=KERNEL_RTOL * float(np.abs(b).max()))


def test_a_scheduled_rate_trains_the_cores_as_optax_sgd_with_the_schedule():
    """TT tables read ``learning_rate=<schedule>`` at their step, as optax.sgd(schedule) does."""
    schedule = optax.linear_schedule(init_value=2 * LR, end_value=LR / 4, transition_steps=3)
    rng = np.random.default_rng(5)
    cores = random_cores(rng, LAY)
    params = {"w": jnp.asarray(rng.normal(size=(LAY.embedding_dim, 2)), jnp.float32)}
    stream = batch_stream(6, 1, False, steps=4)
    targets = [rng.normal(size=(5, 2)).astype(np.float32) for _ in stream]
    fused_loss, plain_loss = _losses(SUM, 1)
    dense = optax.sgd(0.0)
    tables = fused.TTEmbeddingTables.create(LAY, optim.SGD(learning_rate=schedule), cores=cores)
    step = fused.make_functional_train_step(fused_loss, dense)
    opt_state = dense.init(params)
    core_opt = optax.sgd(schedule)
    want_c = tuple(jnp.asarray(c) for c in cores)
    core_state = core_opt.init(want_c)
    core_grads = jax.jit(jax.grad(plain_loss, argnums=1))
    for (indices, offsets, psw), target in zip(stream, targets):
        grads = core_grads(params, want_c, indices, offsets, psw, target)
        updates, core_state = core_opt.update(grads, core_state)
        want_c = optax.apply_updates(want_c, updates)
        params, opt_state, tables, _ = step(params, opt_state, tables, indices, offsets, psw, target)
    for got, want, start in zip(tables.cores, want_c, cores):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(np.abs(want).max()))
        assert rel_err(got, start) > 1e-3


def test_create_from_the_callers_cores_leaves_them_alive_after_a_donating_step():
    rng = np.random.default_rng(9)
    kept = random_cores(rng, LAY)  # host copies: no view of the device arrays below
    mine = tuple(jnp.asarray(c) for c in kept)
    tables = fused.TTEmbeddingTables.create(LAY, optim.SGD(learning_rate=LR), cores=mine)
    fused_loss, _ = _losses(SUM, 1)
    params = {"w": jnp.ones((LAY.embedding_dim, 2), jnp.float32)}
    dense = optax.sgd(0.0)
    step = fused.make_functional_train_step(fused_loss, dense)
    (indices, offsets, psw), = batch_stream(3, 1, False, steps=1)
    step(params, dense.init(params), tables, indices, offsets, psw, np.zeros((5, 2), np.float32))
    for c, k in zip(mine, kept):
        np.testing.assert_array_equal(np.asarray(c), k)  # reading a donated array would raise
