"""The sharded train step never loses the model either: a bad id under FATAL on one device,
or a NaN on one device, skips the update on every device and raises after the step."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from parallel_testing import KEYS, B, N, build, mesh, plan, random_batch, squared_error

import jaxrec.parallel as par
from jaxrec import NonFiniteError
from jaxrec.data import Batch
from jaxrec.nn import make_train_step
from jaxrec.optim import SGD, RowWiseAdagrad
from jaxrec.sparse import KeyedJaggedTensor


def snapshot(model, optimizer):
    return [np.array(x) for x in jax.tree.leaves((nnx.state(model), optimizer.opt_state))]


def sharded(mode):
    model = build(RowWiseAdagrad(learning_rate=0.1))
    model.sparse_arch.bounds_check_mode = mode
    return par.shard(model, plan("rows"), mesh())


def with_bad_id(batch: Batch, device: int) -> Batch:
    kjt = batch.sparse
    lengths = np.asarray(kjt.lengths()).reshape(len(KEYS), N * B)
    values = np.asarray(kjt.values()).copy()
    user = KEYS.index("user")
    assert lengths[user, device * B:(device + 1) * B].sum() > 0
    values[lengths.ravel()[:user * N * B + device * B].sum()] = 37  # t_user has 37 rows
    bad = KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths.ravel(),
                                              weights=kjt.weights_or_none())
    return Batch(batch.dense, bad, batch.labels, batch.mask)


@pytest.mark.parametrize("case", ["fatal", "nan"])
def test_a_bad_device_skips_the_step_everywhere(case):
    model = sharded("FATAL" if case == "fatal" else "WARNING")
    optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
    step = make_train_step(lambda m, b: squared_error(m, b, N * B))
    step(model, optimizer, par.shard_batch(random_batch(1, weighted=True), mesh()))
    step.check()
    before = snapshot(model, optimizer)
    batch = random_batch(2, weighted=True)
    if case == "fatal":
        batch = with_bad_id(batch, device=5)
        error = pytest.raises(ValueError, match="train step 1: .*device 5 has 1 ids out of")
    else:
        dense = np.asarray(batch.dense).copy()
        dense[5 * B, 1] = np.nan  # one sample on device 5
        batch = Batch(dense, batch.sparse, batch.labels, batch.mask)
        error = pytest.raises(NonFiniteError, match="train step 1")
    step(model, optimizer, par.shard_batch(batch, mesh()))
    with error:
        step.check()
    for a, b in zip(before, snapshot(model, optimizer)):
        np.testing.assert_array_equal(a, b)
    step(model, optimizer, par.shard_batch(random_batch(3, weighted=True), mesh()))
    step.check()
    assert step.stats()["steps"] == 3


def test_corrected_ids_of_every_device_are_counted():
    """WARNING corrections on two devices add up in the step's stats (the guard sums each
    device's counts over the mesh)."""

    def corrected(devices):
        model = sharded("WARNING")
        optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
        step = make_train_step(lambda m, b: squared_error(m, b, N * B))
        batch = random_batch(4, weighted=False)
        for device in devices:
            batch = with_bad_id(batch, device)
        step(model, optimizer, par.shard_batch(batch, mesh()))
        return step.stats()["ids_corrected"]

    one = corrected([5])
    assert one > 0
    assert corrected([2, 5]) == 2 * one


def test_a_nan_loss_whose_cotangents_reach_no_shard_skips_every_shard():
    """Rows sent back (one-hot bags): device 5's samples read no rows, so its NaN loss
    sends its cotangents to no owner. The guard agrees on the loss before the backward
    (``_step_guard.seed``), so every device's shards skip all the same."""
    model = build(RowWiseAdagrad(learning_rate=0.1))
    model = par.shard(model, plan("row_wise"), mesh(), max_ids_per_bag=1)
    optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
    step = make_train_step(lambda m, b: squared_error(m, b, N * B))
    step(model, optimizer, par.shard_batch(random_batch(1, weighted=False, one_hot=True), mesh(),
                                           model=model))
    step.check()
    before = snapshot(model, optimizer)
    batch = random_batch(2, weighted=False, one_hot=True, empty_device=5)
    dense = np.asarray(batch.dense).copy()
    dense[5 * B, 1] = np.nan
    batch = par.shard_batch(Batch(dense, batch.sparse, batch.labels, batch.mask), mesh(), model=model)
    assert all(k > 0 for k in model.sparse_arch.row_return_capacity)  # the rows path
    step(model, optimizer, batch)
    with pytest.raises(NonFiniteError, match="train step 1"):
        step.check()
    for a, b in zip(before, snapshot(model, optimizer)):
        np.testing.assert_array_equal(a, b)


def dense_leaves(model, optimizer):
    return [x for x in jax.tree.leaves((nnx.state(model, nnx.Param), optimizer.opt_state))
            if isinstance(x, jax.Array)]


def test_rows_kept_on_some_devices_skip_the_dense_update_on_every_device():
    """Finite losses everywhere, but a rate so large that the fused updates keep rows whose
    update would overflow, on the devices that hold tables (0, 1, 3, 4 and 6: devices 2, 5
    and 7 hold none, so keep none): every device skips its dense update all the same (the
    guard sums the devices' checks over the mesh, ``_step_guard.finish``), and the kept
    rows are counted."""
    model = par.shard(build(SGD(learning_rate=1e38)), plan("table_wise"), mesh())
    optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
    step = make_train_step(lambda m, b: squared_error(m, b, 1e-4), on_nonfinite="skip")
    before = [np.array(x) for x in dense_leaves(model, optimizer)]
    step(model, optimizer, par.shard_batch(random_batch(6, weighted=False), mesh()))
    stats = step.stats()
    assert stats["nonfinite_steps"] == 1 and stats["nonfinite_rows"] > 0, stats
    for b, x in zip(before, dense_leaves(model, optimizer), strict=True):
        assert x.sharding.is_fully_replicated and len(x.addressable_shards) == N
        for shard in x.addressable_shards:  # every device's copy
            np.testing.assert_array_equal(np.asarray(shard.data), b)
