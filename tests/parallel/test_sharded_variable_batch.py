"""A variable-batch KJT (VBE) in sharded collections: ``shard_batch`` gives each device the
bags its samples use, and the sharded lookup pools each bag once and expands it to the
device's samples. Outputs and training equal the unsharded collection on the global VBE
batch (itself tested against the batch expanded by hand, tests/nn/test_variable_batch.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from parallel_testing import KEYS, ROWS, N, build, mesh, plan

import jaxrec.parallel as par
from jaxrec.data import Batch
from jaxrec.nn import make_train_step
from jaxrec.optim import Adam, RowWiseAdagrad
from jaxrec.sparse import KeyedJaggedTensor

B = 6  # samples per device
DEDUP = {"user": 5, "geo": 3, "extra": 2}  # keys with fewer bags than samples (one per distinct value)
RTOL, ATOL = 2e-5, 1e-6


def vbe_batch(seed: int, weighted: bool = False, max_id: int = 7) -> Batch:
    """A global batch of N * B samples whose KJT holds DEDUP[key] bags for the deduplicated
    keys (used by several samples, on several devices) and one bag per sample otherwise.
    Bags hold 0-3 ids with duplicates, from each table's first ``max_id`` rows."""
    rng = np.random.default_rng(seed)
    full = N * B
    strides = [DEDUP.get(k, full) for k in KEYS]
    lengths = [rng.integers(0, 4, size=s) for s in strides]
    values = np.concatenate([rng.integers(0, min(ROWS[k], max_id), size=ls.sum()) for k, ls in zip(KEYS, lengths)])
    inverse = np.stack([rng.integers(0, s, size=full) if s < full else rng.permutation(full)
                        for s in strides]).astype(np.int32)
    weights = rng.uniform(0.5, 2.0, values.size).astype(np.float32) if weighted else None
    kjt = KeyedJaggedTensor(KEYS, values.astype(np.int32), lengths=np.concatenate(lengths), weights=weights,
                            stride_per_key_per_rank=[[s] for s in strides], inverse_indices=(KEYS, inverse),
                            capacity=1024)
    return Batch(jnp.asarray(rng.normal(size=(full, 2)), jnp.float32), kjt,
                 jnp.asarray(rng.normal(size=(full,)), jnp.float32), jnp.ones(full, jnp.float32))


def test_each_device_gets_the_bags_its_samples_use_once():
    kjt = vbe_batch(0).sparse
    lengths, inverse = np.asarray(kjt.lengths()), np.asarray(kjt.inverse_indices()[1])
    first_bag = np.concatenate([[0], np.cumsum(kjt.stride_per_key())])
    placed = par.shard_batch(kjt, mesh())
    assert placed.stride_per_key() == [B] * len(KEYS)
    for d in range(N):
        part = jax.tree.map(lambda x, d=d: np.asarray(x[d]), placed)
        part_lengths = part.lengths().reshape(len(KEYS), B)
        part_inverse = part.inverse_indices()[1]
        for k in range(len(KEYS)):
            used = np.unique(inverse[k, d * B:(d + 1) * B])
            # each used bag once, then empty bags; the samples point at their own bag's copy
            np.testing.assert_array_equal(part_lengths[k, :used.size], lengths[first_bag[k] + used])
            assert not part_lengths[k, used.size:].any()
            np.testing.assert_array_equal(used[part_inverse[k]], inverse[k, d * B:(d + 1) * B])
        # the device holds only its distinct bags' ids: fewer than its samples' for DEDUP keys
        want = sum(lengths[first_bag[k] + np.unique(inverse[k, d * B:(d + 1) * B])].sum()
                   for k in range(len(KEYS)))
        assert part_lengths.sum() == want


@pytest.mark.parametrize("kind", ["mixed", "row_wise", "table_wise"])
def test_sharded_lookup_equals_the_unsharded_one(kind):
    kjt = vbe_batch(1, weighted=True).sparse
    reference = build(Adam(learning_rate=0.1))
    sharded = par.shard(build(Adam(learning_rate=0.1)), plan(kind), mesh())
    want = np.asarray(reference.sparse_arch(kjt).values())
    got = par.make_forward(lambda m, k: m.sparse_arch(k).values())(sharded, par.shard_batch(kjt, mesh()))
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("optimizer, kind, bound", [
    (RowWiseAdagrad(learning_rate=0.1), "rows", None),
    (None, "mixed", None),
    # bags of at most 3 ids read from windows, and the distinct rows sent back (row return)
    (RowWiseAdagrad(learning_rate=0.1), "table_wise", 3),
], ids=["fused_rowwise_adagrad", "plain_optax", "fused_table_wise_row_return"])
def test_sharded_training_equals_unsharded_training(optimizer, kind, bound):
    tx = optax.adagrad(0.1) if optimizer is None else optax.adam(1e-2)
    reference = build(optimizer)
    model = par.shard(build(optimizer), plan(kind), mesh(), max_ids_per_bag=bound)
    sized = None if bound is None else model
    max_id = 7 if bound is None else 2  # few distinct rows: fewer on the wire than pooled bags
    ref_opt, opt = nnx.Optimizer(reference, tx, wrt=nnx.Param), nnx.Optimizer(model, tx, wrt=nnx.Param)

    def squared_error(model, batch, denominator):
        out = model(batch.dense, batch.sparse)
        return jnp.sum((out - batch.labels) ** 2 * batch.mask) / denominator

    ref_step = make_train_step(lambda m, b: squared_error(m, b, N * B))
    step = make_train_step(lambda m, b: squared_error(m, b, B))
    initial = {k: np.asarray(v) for k, v in reference.sparse_arch.split_embedding_weights().items()}
    for i in range(3):
        batch = vbe_batch(10 + i, max_id=max_id)
        np.testing.assert_allclose(step(model, opt, par.shard_batch(batch, mesh(), model=sized)),
                                   ref_step(reference, ref_opt, batch), rtol=RTOL)
    if sized is not None:
        ebc = model.sparse_arch
        assert all(0 < k < B * g.num_slots for k, g in zip(ebc.row_return_capacity, ebc.layout.groups))
        assert int(model.sparse_arch.dropped_ids.get_value()) == 0
    expected = reference.sparse_arch.split_embedding_weights()
    for name, table in model.sparse_arch.split_embedding_weights().items():
        assert np.any(np.asarray(table) != initial[name]), name
        np.testing.assert_allclose(table, expected[name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_a_variable_batch_not_placed_by_shard_batch_is_refused():
    kjt = vbe_batch(2).sparse
    sharded = par.shard(build(None), plan("mixed"), mesh())
    per_device = jax.tree.map(lambda x: jnp.stack([x] * N), kjt)  # every key's bags as given
    with pytest.raises(ValueError, match=rf"as jaxrec.parallel.shard_batch places it.*stride_per_key=\[3, 2, {N * B}"):
        par.make_forward(lambda m, k: m.sparse_arch(k).values())(sharded, per_device)
    with pytest.raises(ValueError, match="not a multiple of the 7 devices"):
        par.shard_batch(vbe_batch(3).sparse, mesh(7))


def test_per_device_variable_batches_of_fewer_bags_than_samples():
    """shard_batch(per_device=True) pads each device's VBE KJT to B bags per key, also when
    every key holds fewer (its stride is then below B); each device's output is the
    unsharded collection's on that device's batch."""
    rng = np.random.default_rng(7)
    parts = []
    for _ in range(N):
        strides = [int(rng.integers(1, B)) for _ in KEYS]  # every key deduplicated
        lengths = [rng.integers(0, 4, size=s) for s in strides]
        values = np.concatenate([rng.integers(0, ROWS[k], size=ls.sum()) for k, ls in zip(KEYS, lengths)])
        inverse = np.stack([rng.integers(0, s, size=B) for s in strides]).astype(np.int32)
        parts.append(KeyedJaggedTensor(KEYS, values.astype(np.int32), lengths=np.concatenate(lengths),
                                       stride_per_key_per_rank=[[s] for s in strides],
                                       inverse_indices=(KEYS, inverse), capacity=256))
    assert all(p.stride() < B for p in parts)
    reference = build(Adam(learning_rate=0.1))
    sharded = par.shard(build(Adam(learning_rate=0.1)), plan("mixed"), mesh())
    got = par.make_forward(lambda m, k: m.sparse_arch(k).values())(
        sharded, par.shard_batch(parts, mesh(), per_device=True))
    for d, part in enumerate(parts):
        want = np.asarray(reference.sparse_arch(part).values())
        assert want.shape[0] == B and np.abs(want).max() > 0
        np.testing.assert_allclose(np.asarray(got[d]), want, rtol=RTOL, atol=ATOL)
