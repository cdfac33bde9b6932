"""ShardedEmbeddingBagCollection equals the unsharded EmbeddingBagCollection, per device.

For every sharding type (and all of them at once), SUM and MEAN tables, a shared table,
weighted ids, empty bags and a device without any id: the pooled output of each device's
samples equals the unsharded module's output for those samples. Plus the tables and
their views, the per-sample weights' gradient, and the errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from parallel_testing import (
    KEYS,
    ROWS,
    TABLES,
    B,
    N,
    build,
    mesh,
    plan,
    random_batch,
    random_kjt,
)

import jaxrec.parallel as par
from jaxrec.nn import EmbeddingBagCollection, make_train_step
from jaxrec.optim import SGD, RowWiseAdagrad
from jaxrec.parallel._row_return import request_keys
from jaxrec.sparse import KeyedJaggedTensor

# Sums of at most a few float32 products: the error is a few ulps of the output.
RTOL, ATOL = 1e-6, 1e-7

pooled = par.make_forward(lambda model, kjt: model(kjt))  # KeyedTensors, stacked


def forget_failed_callbacks():
    """Every device raised (by design); JAX keeps the other devices' failed callback tokens
    and would raise them again at exit. Forget them (JAX's private token set)."""
    from jax._src import dispatch
    dispatch.runtime_tokens.clear()


def unsharded():
    return EmbeddingBagCollection(TABLES, rngs=nnx.Rngs(0))


# (sharding type, weighted ids, max_ids_per_bag): every type once, weighted and not among
# them, with and without the bound (which reads per-feature windows of the gathered ids;
# bags have up to 3 ids; "geo" unbounded leaves the groups that read it on the full path).
@pytest.mark.parametrize("kind, weighted, bound", [
    ("table_wise", True, None), ("row_wise", False, 3), ("column_wise", True, None),
    ("table_row_wise", False, 3), ("data_parallel", True, 3), ("mixed", True, None),
    ("mixed", False, {k: 3 + (k == "x") for k in KEYS if k not in ("extra", "geo")})])
def test_every_sharding_type_equals_the_unsharded_module(kind, weighted, bound):
    ebc = unsharded()
    sharded = par.ShardedEmbeddingBagCollection(TABLES, plan(kind), mesh(), rngs=nnx.Rngs(0),
                                                max_ids_per_bag=bound)
    for name, table in ebc.split_embedding_weights().items():  # same initial tables
        np.testing.assert_array_equal(sharded.split_embedding_weights()[name], table)
    kjt = random_kjt(np.random.default_rng(1), weighted=weighted, empty_device=2)
    out = pooled(sharded, par.shard_batch(kjt, mesh()))
    expected = ebc(kjt)
    assert out.keys() == expected.keys() == ["user", "item", "last_item", "geo", "x", "tiny"]
    assert out.length_per_key() == expected.length_per_key()
    assert out.values().shape == (N, B, expected.values().shape[1])
    np.testing.assert_allclose(np.asarray(out.values()).reshape(N * B, -1), expected.values(),
                               rtol=RTOL, atol=ATOL)
    if kind == "mixed":  # no id on any device, given per device (same shapes: no recompile)
        empty = [KeyedJaggedTensor.from_lengths_sync(KEYS, np.zeros(0, np.int32),
                                                     [0] * len(KEYS) * B, weights=[])] * N
        capacity = par.shard_batch(kjt, mesh()).values().shape[1]
        out = pooled(sharded, par.shard_batch(empty, mesh(), capacity=capacity, per_device=True))
        np.testing.assert_array_equal(out.values(), 0.0)


# (sharding type, weighted ids, max_ids_per_bag, ids from the first max_id rows or None:
# all rows): 3 samples per device ask fewer distinct rows than their bags only when the
# ids repeat (the table-wise case).
@pytest.mark.parametrize("kind, weighted, bound, max_id", [
    ("row_wise", True, 1, None), ("table_wise", False, 1, 2), ("mixed", False, 1, 2),
    ("row_wise", True, 3, None), ("mixed", True, 3, None)])
def test_rows_sent_back_equal_the_unsharded_module(kind, weighted, bound, max_id):
    """Bounded bags (one-hot, or up to 3 ids), sized by shard_batch(model=): the row-wise
    and table-wise (a2a: TW, CW, TWRW) groups ask the owners for the distinct rows of their
    bags and pool them (weights, MEAN)."""
    sharded = par.ShardedEmbeddingBagCollection(TABLES, plan(kind), mesh(), rngs=nnx.Rngs(0),
                                                max_ids_per_bag=bound)
    kjt = random_kjt(np.random.default_rng(4), weighted=weighted, empty_device=6,
                     one_hot=bound == 1, spread=max_id is None, max_id=max_id or 6)
    out = pooled(sharded, par.shard_batch(kjt, mesh(), model=sharded))
    on = [0 < k < B * g.num_slots  # the rows path (else the dense one)
          for k, g in zip(sharded.row_return_capacity, sharded.layout.groups) if g.kind != "dp"]
    assert all(on) if bound == 1 else any(on)
    np.testing.assert_allclose(np.asarray(out.values()).reshape(N * B, -1),
                               unsharded()(kjt).values(), rtol=RTOL, atol=ATOL)


def rows_past_capacity(sharded, kjt) -> int:
    """The ids of ``kjt`` whose rows do not fit the row return: per device and owner, the
    distinct (owner, virtual row) keys past the capacity, in key order, with their repeats."""
    lengths = np.asarray(kjt.lengths()).reshape(len(KEYS), N * B)
    start = np.concatenate([[0], np.cumsum(lengths.sum(1))])
    values = np.asarray(kjt.values())
    rows = [ROWS[f] for f in sharded.feature_names]
    total = 0
    for group, capacity in zip(sharded.layout.groups, sharded.row_return_capacity):
        if not 0 < capacity < B * group.num_slots:
            continue
        for d in range(N):
            ids = []
            for f in sharded.feature_names:
                k = KEYS.index(f)
                before = start[k] + lengths[k, :d * B].sum()
                ids.append(values[before:before + lengths[k, d * B:(d + 1) * B].sum()])
            keys = request_keys(group, rows, ids)
            distinct, repeats = np.unique(keys, return_counts=True)
            for owner in range(N):
                total += repeats[distinct // group.layout.rows[0] == owner][capacity:].sum()
    return int(total)


def test_a_batch_past_the_row_return_capacity_is_refused_or_counted():
    """A batch that did not pass through shard_batch(model=) may ask one owner for more
    distinct rows than the capacity holds: FATAL skips the train step's update on every
    device and raises after it; WARNING drops their ids and counts them in dropped_ids
    (never silently)."""
    kjt = random_kjt(np.random.default_rng(5), weighted=False, one_hot=True)
    ids = np.asarray(kjt.values())
    sizing = KeyedJaggedTensor.from_lengths_sync(KEYS, np.zeros_like(ids), kjt.lengths())
    crowded = KeyedJaggedTensor.from_lengths_sync(KEYS, ids % 2, kjt.lengths())
    # Inside a train step FATAL raises from no callback (the step guard records it), so no
    # device can leave the others waiting in a collective (docs/parallel.md, limits).
    for mode, kind in (("FATAL", "mixed"), ("FATAL", "row_wise"), ("WARNING", "mixed")):
        sharded = par.ShardedEmbeddingBagCollection(
            TABLES, plan(kind), mesh(), rngs=nnx.Rngs(0), max_ids_per_bag=1,
            bounds_check_mode=mode, optimizer=SGD(learning_rate=0.1))
        batch = par.shard_batch(sizing, mesh(), model=sharded)  # one distinct row per slot
        step = make_train_step(lambda m, k: jnp.sum(m(k).values() ** 2))
        opt = nnx.Optimizer(sharded, optax.sgd(0.0), wrt=nnx.Param)
        step(sharded, opt, batch)
        assert int(sharded.dropped_ids.get_value()) == 0
        crowded_batch = par.shard_batch(crowded, mesh())
        if mode == "FATAL":  # inside a train step: no update, raised after the step
            before = np.asarray(sharded.split_embedding_weights()["t_user"])
            step(sharded, opt, crowded_batch)
            with pytest.raises(ValueError, match="train step 1: .*asks one owner for more "
                                                 "distinct rows than the row return capacity"):
                step.check()
            np.testing.assert_array_equal(sharded.split_embedding_weights()["t_user"], before)
        else:
            step(sharded, opt, crowded_batch)
            assert int(sharded.dropped_ids.get_value()) == rows_past_capacity(sharded, crowded) > 0


@pytest.mark.parametrize("kind", ["mixed", "row_wise"])
def test_bfloat16_comms_round_the_pooled_values_only(kind):
    """comm_dtype=bfloat16 (TorchRec's quantized comms): the outputs are the float32-comms
    outputs rounded to bfloat16 once (all-to-all) or after a few bfloat16 additions
    (row-wise partial sums); their gradients also travel in bfloat16."""
    kjt = par.shard_batch(random_kjt(np.random.default_rng(6), weighted=True), mesh())
    cotangent = jax.device_put(np.random.default_rng(7).normal(size=(N, B, 44)).astype(np.float32))

    def out_and_weight_grad(model, kjt, ct):
        """The pooled output, and the weights' gradient through its cotangent, back over the
        wire: one program per dtype (the forward is the one the gradient differentiates)."""
        def loss(weights):
            again = KeyedJaggedTensor(kjt.keys(), kjt.values(), weights=weights, lengths=kjt.lengths())
            out = model(again).values()
            return jnp.sum(out * ct), out
        grad, out = jax.grad(loss, has_aux=True)(kjt.weights())
        return out, grad

    results = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        sharded = par.ShardedEmbeddingBagCollection(TABLES, plan(kind), mesh(), rngs=nnx.Rngs(0),
                                                    comm_dtype=dtype)
        out, grad = par.make_forward(out_and_weight_grad)(sharded, kjt, cotangent)
        results[dtype] = np.asarray(out), np.asarray(grad)
    (out32, g32), (out16, g16) = results[jnp.float32], results[jnp.bfloat16]
    assert out16.dtype == np.float32 and not np.array_equal(out16, out32)
    scale = np.abs(out32).max()
    np.testing.assert_allclose(out16, out32, rtol=2**-7, atol=2**-7 * scale)
    np.testing.assert_allclose(g16, g32, rtol=0, atol=2**-6 * np.abs(g32).max())
    with pytest.raises(ValueError, match="comm_dtype must be one of.*got int8"):
        par.ShardedEmbeddingBagCollection(TABLES, plan(kind), mesh(), rngs=nnx.Rngs(0),
                                          comm_dtype=jnp.int8)


def test_bags_longer_than_max_ids_per_bag_are_cut_or_refused():
    """WARNING (and IGNORE) cut a longer bag to its first ids, as if the input had been cut;
    FATAL raises when the step runs, naming the feature, the bag and the bound."""
    kjt = random_kjt(np.random.default_rng(8), weighted=True)  # bags of up to 3 ids
    lengths = np.asarray(kjt.lengths()).reshape(len(KEYS), N * B)
    assert (lengths == 3).any()
    starts = np.concatenate([[0], np.cumsum(lengths.ravel())[:-1]])
    first_two = np.concatenate([np.arange(s, s + min(n, 2)) for s, n in zip(starts, lengths.ravel())])
    cut = KeyedJaggedTensor.from_lengths_sync(KEYS, np.asarray(kjt.values())[first_two],
                                              np.minimum(lengths, 2).ravel(),
                                              weights=np.asarray(kjt.weights())[first_two])
    sharded = par.ShardedEmbeddingBagCollection(TABLES, plan("mixed"), mesh(), rngs=nnx.Rngs(0),
                                                max_ids_per_bag=2)
    out = pooled(sharded, par.shard_batch(kjt, mesh()))
    np.testing.assert_allclose(np.asarray(out.values()).reshape(N * B, -1),
                               unsharded()(cut).values(), rtol=RTOL, atol=ATOL)
    fatal = par.ShardedEmbeddingBagCollection(TABLES, plan("mixed"), mesh(), rngs=nnx.Rngs(0),
                                              max_ids_per_bag=2, bounds_check_mode="FATAL")
    with pytest.raises(Exception, match=r"ids, more than max_ids_per_bag=2\. Raise the bound"):
        jax.block_until_ready(pooled(fatal, par.shard_batch(kjt, mesh())).values())
    forget_failed_callbacks()
    for bad, message in ((0, "must be positive ints"), ({"nope": 1}, r"names features \['nope'\]")):
        with pytest.raises(ValueError, match=message):
            par.ShardedEmbeddingBagCollection(TABLES, plan("mixed"), mesh(), rngs=nnx.Rngs(0),
                                              max_ids_per_bag=bad)


def test_a_bad_id_on_one_device_fails_every_device_under_fatal():
    """One device's bad id raises (on every device: none waits alone in a collective);
    WARNING maps it to row 0 as the unsharded module does."""
    kjt = random_kjt(np.random.default_rng(9), weighted=False)
    values = np.asarray(kjt.values()).copy()
    lengths = np.asarray(kjt.lengths()).reshape(len(KEYS), N * B)
    user = KEYS.index("user")
    start = lengths.ravel()[:user * N * B + 5 * B].sum()  # device 5's first "user" id
    assert lengths[user, 5 * B:6 * B].sum() > 0
    values[start] = 37  # t_user has 37 rows
    bad = KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths.ravel())
    fatal = par.ShardedEmbeddingBagCollection(TABLES, plan("mixed"), mesh(), rngs=nnx.Rngs(0),
                                              bounds_check_mode="FATAL")
    with pytest.raises(Exception, match="device 5 has 1 ids out of their tables' range"):
        jax.block_until_ready(pooled(fatal, par.shard_batch(bad, mesh())).values())
    forget_failed_callbacks()
    warning = par.ShardedEmbeddingBagCollection(TABLES, plan("mixed"), mesh(), rngs=nnx.Rngs(0))
    np.testing.assert_allclose(
        np.asarray(pooled(warning, par.shard_batch(bad, mesh())).values()).reshape(N * B, -1),
        unsharded()(bad).values(), rtol=RTOL, atol=ATOL)


def test_per_sample_weight_gradient_equals_the_unsharded_one():
    ebc = unsharded()
    sharded = par.shard(unsharded(), plan("mixed"), mesh())
    kjt = random_kjt(np.random.default_rng(3), weighted=True)
    cotangent = np.random.default_rng(4).normal(size=(N * B, 44)).astype(np.float32)

    def loss(model, kjt, weights, ct):
        again = KeyedJaggedTensor(kjt.keys(), kjt.values(), weights=weights, lengths=kjt.lengths())
        return jnp.sum(model(again).values() * ct)

    def per_device(model, kjt, ct):
        return jax.grad(loss, argnums=2)(model, kjt, kjt.weights(), ct)

    grads = par.make_forward(per_device)(sharded, par.shard_batch(kjt, mesh()),
                                         jax.device_put(cotangent.reshape(N, B, -1)))
    expected = jax.grad(loss, argnums=2)(ebc, kjt, kjt.weights(), jnp.asarray(cotangent))
    local = par.shard_batch(KeyedJaggedTensor(kjt.keys(), kjt.values(), weights=expected,
                                              lengths=kjt.lengths()), mesh())
    np.testing.assert_allclose(grads, local.weights(), rtol=1e-5, atol=1e-6)


def test_split_embedding_weights_and_portable_tables_give_the_whole_tables():
    fused = EmbeddingBagCollection(TABLES, optimizer=RowWiseAdagrad(learning_rate=0.1),
                                   rngs=nnx.Rngs(0))
    sharded = par.shard(fused, plan("rows"), mesh())
    portable = sharded.portable_tables()
    for t in TABLES:
        np.testing.assert_array_equal(portable[t.name]["weights"],
                                      fused.split_embedding_weights()[t.name])
        assert portable[t.name]["momentum1"].shape == (t.num_embeddings,)
        assert int(portable[t.name]["step"]) == 0
    assert sharded.embedding_bag_configs() == TABLES
    assert sharded.feature_names == ("user", "item", "last_item", "geo", "x", "tiny")


def test_errors_say_how_to_fix_them():
    sharded = par.ShardedEmbeddingBagCollection(TABLES, plan("mixed"), mesh(), rngs=nnx.Rngs(0))
    kjt = random_kjt(np.random.default_rng(5), weighted=False)
    with pytest.raises(ValueError, match="inside shard_map.*make_forward"):
        sharded(kjt)
    with pytest.raises(ValueError, match="plan is for 8 devices but mesh axis 'data' has 4"):
        par.ShardedEmbeddingBagCollection(TABLES, plan("mixed"), mesh(4), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"\['t_geo'\] are COLUMN_WISE but RowWiseAdagrad"):
        par.ShardedEmbeddingBagCollection(TABLES, plan("mixed"), mesh(), rngs=nnx.Rngs(0),
                                          optimizer=RowWiseAdagrad(learning_rate=0.1))
    with pytest.raises(ValueError, match=r"missing \['t_tiny'\]"):
        par.ShardedEmbeddingBagCollection(TABLES, par.construct_plan(
            TABLES[:4], {t.name: par.row_wise() for t in TABLES[:4]}, N), mesh(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="lacks the features"):
        pooled(sharded, par.shard_batch(KeyedJaggedTensor.from_lengths_sync(
            ["user"], [1], [1] + [0] * (N * B - 1)), mesh()))
    with pytest.raises(ValueError, match="not a multiple of the 8 devices"):
        par.shard_batch(KeyedJaggedTensor.from_lengths_sync(KEYS, [], [0] * len(KEYS) * 5), mesh())
    model = par.shard(build(SGD(learning_rate=0.1)), plan("rows"), mesh())
    model.extra = EmbeddingBagCollection(TABLES, optimizer=SGD(learning_rate=0.1), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"unsharded collections with fused tables \['extra'\]"):
        make_train_step(lambda m, b: 0.0)(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),
                                              par.shard_batch(random_batch(0, weighted=False), mesh()))
