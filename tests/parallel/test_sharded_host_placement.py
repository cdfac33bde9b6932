"""Sharded tables in host memory: each device's shards live in its host memory, and each
lookup reads the batch's rows (``placement="host"``, jaxrec.nn.host_tables) or maps them
to the device's own cache (``"host_cached"``, jaxrec.parallel._host_cache).

Training a sharded model whose TABLE_WISE, ROW_WISE, COLUMN_WISE and TABLE_ROW_WISE
tables are in host memory (by their configs, or by the plan) equals training the
unsharded model with every table on the device: losses, tables, optimizer state and
step, with evictions from each device's cache. The tables stay in host memory through the
steps and come back whole in their portable form, which loads into either placement. A
data-parallel table, a plan placing a table host-cached and several processes are
refused."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from parallel_testing import TABLES, B, Model, N, build, mesh, plan, random_batch, squared_error

import jaxrec.parallel as par
from jaxrec.data import Batch
from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig, make_train_step
from jaxrec.ops.host_cache import in_host_memory
from jaxrec.optim import Adam, RowWiseAdagrad
from jaxrec.parallel._sharded_ebc import portable_from_collection

RTOL, ATOL = 2e-5, 1e-6  # as tests/parallel/test_sharded_training.py: sums in another order
HOSTED = {"t_user", "t_item", "t_geo", "t_x"}  # every table but the data-parallel t_tiny


def train_side_by_side(reference, model, *, weighted: bool) -> None:
    """Three steps of the unsharded ``reference`` on the global batch and of the sharded
    ``model`` on its shards (Adam on the dense part); their losses agree at each step."""
    tx = optax.adam(1e-2)
    ref_opt, opt = nnx.Optimizer(reference, tx, wrt=nnx.Param), nnx.Optimizer(model, tx, wrt=nnx.Param)
    ref_step = make_train_step(lambda m, b: squared_error(m, b, N * B))
    step = make_train_step(lambda m, b: squared_error(m, b, B))
    for i in range(3):
        batch = random_batch(i, weighted=weighted)
        np.testing.assert_allclose(step(model, opt, par.shard_batch(batch, mesh())),
                                   ref_step(reference, ref_opt, batch), rtol=RTOL)


def host_placed(optimizer) -> Model:
    tables = [dataclasses.replace(t, placement="host") if t.name in HOSTED else t for t in TABLES]
    return Model(EmbeddingBagCollection(tables, optimizer=optimizer, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))


def by_plan(kind: str) -> par.ShardingPlan:
    """The plan of ``kind`` placing HOSTED in host memory itself (configs on the device)."""
    base = plan(kind)
    return par.ShardingPlan({name: dataclasses.replace(ps, placement="host") if name in HOSTED else ps
                             for name, ps in base.items()}, base.world_size, base.local_world_size)


@pytest.mark.parametrize("optimizer,kind,placed_by,bound", [
    (Adam(learning_rate=0.05), "mixed", "configs", None), (RowWiseAdagrad(learning_rate=0.1), "rows", "plan", 3)])
def test_sharded_host_placed_training_equals_unsharded_training(optimizer, kind, placed_by, bound):
    """``bound``: max_ids_per_bag (the ids read from per-feature windows)."""
    reference = build(optimizer)
    if placed_by == "configs":
        model = par.shard(host_placed(optimizer), plan(kind), mesh(), max_ids_per_bag=bound)
    else:
        model = par.shard(build(optimizer), by_plan(kind), mesh(), max_ids_per_bag=bound)
    ebc = model.sparse_arch
    hosted = [g for g in ebc.layout.groups if g.in_host_memory]
    assert hosted and not any(g.in_host_memory for g in ebc.layout.groups if g.kind == "dp")
    train_side_by_side(reference, model, weighted=True)
    for g, var in zip(ebc.layout.groups, ebc.tables):  # the host groups' buffers stayed in host memory
        tables = var.get_value()
        assert in_host_memory(tables.weights) == g.in_host_memory, g
    want = portable_from_collection(reference.sparse_arch)
    got = ebc.portable_tables()
    for name, fields in got.items():
        assert int(fields["step"]) == 3
        for field, value in fields.items():
            np.testing.assert_allclose(value, want[name][field], rtol=RTOL, atol=ATOL, err_msg=f"{name}.{field}")
    # the portable form loads into either placement
    device = par.shard(build(optimizer), plan(kind), mesh())
    device.sparse_arch.load_portable_tables(got)
    again = par.shard(host_placed(optimizer), plan(kind), mesh())
    again.sparse_arch.load_portable_tables(device.sparse_arch.portable_tables())
    for name, fields in again.sparse_arch.portable_tables().items():
        for field, value in fields.items():
            np.testing.assert_array_equal(np.asarray(value), np.asarray(got[name][field]), err_msg=name)


def test_what_cannot_be_in_host_memory_is_refused(monkeypatch):
    """A data-parallel table, a plan placing a table host-cached, several processes."""
    tables = [dataclasses.replace(t, placement="host") for t in TABLES]
    ebc = EmbeddingBagCollection(tables, optimizer=Adam(learning_rate=0.05), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="table 't_tiny' is placed in host memory, which its DATA_PARALLEL"):
        par.shard(ebc, plan("mixed"), mesh())
    with pytest.raises(ValueError, match="placement must be None"):
        dataclasses.replace(plan("mixed")["t_user"], placement="host_cached")
    with monkeypatch.context() as patch:  # several processes: not yet
        patch.setattr(jax, "process_count", lambda: 2)
        with pytest.raises(NotImplementedError, match=r"placed in host memory, which is sharded over the devices "
                                                      r"of one process only so far"):
            par.shard(host_placed(Adam(learning_rate=0.05)), plan("mixed"), mesh())


def test_sharded_host_cached_training_equals_unsharded_training():
    """Each device's shards host-cached with a cache of its own (128 rows: the tables here
    are small, so each device caches all its rows; the unsharded tests evict)."""
    optimizer = RowWiseAdagrad(learning_rate=0.1)
    tables = [dataclasses.replace(t, placement="host_cached", cache_rows=128) if t.name in HOSTED else t
              for t in TABLES]

    def placed():
        return Model(EmbeddingBagCollection(tables, optimizer=optimizer, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))

    reference = build(optimizer)
    model = par.shard(placed(), plan("rows"), mesh())
    ebc = model.sparse_arch
    cached = [g for g in ebc.layout.groups if g.placement == "host_cached"]
    assert cached and all(g.cache_rows == 128 for g in cached) and len(ebc.caches) == len(cached)
    train_side_by_side(reference, model, weighted=False)
    batch = par.shard_batch(random_batch(0, weighted=False), mesh())
    with pytest.raises(NotImplementedError, match="prefetch= is built for unsharded collections only"):
        make_train_step(lambda m, b: squared_error(m, b, B))(
            model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param), batch, prefetch=batch.sparse)
    stats = ebc.cache_statistics()
    assert stats and all(int(s["inserted"]) > 0 for s in stats.values())
    assert all(in_host_memory(c.get_value().rows.weights) for c in ebc.caches)
    want = portable_from_collection(reference.sparse_arch)
    got = ebc.portable_tables()  # the cached rows over the host rows
    for name, fields in got.items():
        for field, value in fields.items():
            np.testing.assert_allclose(value, want[name][field], rtol=RTOL, atol=ATOL, err_msg=f"{name}.{field}")
    again = par.shard(build(optimizer), plan("rows"), mesh())  # into device placement
    again.sparse_arch.load_portable_tables(got)
    back = par.shard(placed(), plan("rows"), mesh())
    back.sparse_arch.load_portable_tables(again.sparse_arch.portable_tables())
    for name, fields in back.sparse_arch.portable_tables().items():
        for field, value in fields.items():
            np.testing.assert_array_equal(np.asarray(value), np.asarray(got[name][field]), err_msg=name)


class Pooled(nnx.Module):
    def __init__(self, ebc):
        self.sparse_arch = ebc

    def __call__(self, kjt):
        return jnp.sum(jnp.tanh(self.sparse_arch(kjt).values()), axis=1)


def test_each_device_evicts_from_its_own_cache():
    """Two tables of 1000 rows, TABLE_WISE on devices 0 and 1 of two, each cached in 128
    rows and looked up over all its rows: every step evicts, and training equals the
    unsharded device-placed collection."""
    from jaxrec.sparse import KeyedJaggedTensor

    def tables(**placed):
        return [EmbeddingBagConfig(name=f"t{k}", num_embeddings=1000, embedding_dim=8, feature_names=[f"f{k}"],
                                   **placed) for k in range(2)]

    optimizer = RowWiseAdagrad(learning_rate=0.2)
    reference = Pooled(EmbeddingBagCollection(tables(), optimizer=optimizer, rngs=nnx.Rngs(0)))
    cached = Pooled(EmbeddingBagCollection(tables(placement="host_cached", cache_rows=128), optimizer=optimizer,
                                           rngs=nnx.Rngs(0)))
    two = mesh(2)
    model = par.shard(cached, par.construct_plan(tables(), {"t0": par.table_wise(0), "t1": par.table_wise(1)}, 2),
                      two)
    ref_step, step = (make_train_step(lambda m, b, d=d: jnp.sum((m(b.sparse) - b.labels) ** 2) / d)
                      for d in (16, 8))
    ref_opt, opt = (nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in (reference, model))
    rng = np.random.default_rng(0)
    evicted = 0
    for s in range(6):
        lengths = rng.integers(1, 4, size=2 * 16)
        ids = rng.integers(0, 1000, size=lengths.sum()).astype(np.int32)
        kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], ids, lengths, capacity=128)
        batch = Batch(jnp.zeros((16, 1)), kjt, jnp.asarray(rng.normal(size=16), jnp.float32), jnp.ones(16))
        np.testing.assert_allclose(step(model, opt, par.shard_batch(batch, two)), ref_step(reference, ref_opt, batch),
                                   rtol=RTOL)
        now = int(model.sparse_arch.cache_statistics()["t0+t1"]["evicted"])
        if s >= 3:
            assert now > evicted, s
        evicted = now
    want = reference.sparse_arch.split_embedding_weights()
    for name, table in model.sparse_arch.split_embedding_weights().items():
        np.testing.assert_allclose(table, want[name], rtol=RTOL, atol=ATOL, err_msg=name)
