"""Checkpoints across meshes: saved on 8 devices, restored on 4 and on 2, and back on 8.

Each mesh has its own plan (hand-written, planner-made, row-wise), so the tables' buffers
differ; ``portable_state`` / ``load_portable_state`` around ``jaxrec.checkpoint`` must
restore every table, the fused optimizer's state and step, the dense parameters and the
optax state bit for bit (random nonzero values everywhere: a restore that returned the
initial state would fail).
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from parallel_testing import TABLES, build, mesh, plan

import jaxrec.parallel as par
from jaxrec import checkpoint
from jaxrec.nn import TableCollection
from jaxrec.optim import RowWiseAdagrad

OPTIMIZER = RowWiseAdagrad(learning_rate=0.1)


def model_on(n: int, start: int, how: str):
    if how == "planner":
        p = par.EmbeddingShardingPlanner(par.Topology(world_size=n, hbm_cap=1 << 30),
                                         optimizer=OPTIMIZER).plan(TABLES)
    elif how == "row_wise":
        p = par.construct_plan(TABLES, {t.name: par.row_wise() for t in TABLES}, n)
    else:
        p = plan(how, n)
    model = par.shard(build(OPTIMIZER), p, mesh(n, start))
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def randomised(state, seed):
    """``state`` with random nonzero values; every table's step set to one random count."""
    rng = np.random.default_rng(seed)
    step = int(rng.integers(1, 1000))

    def leaf(path, x):
        if jax.tree_util.keystr(path).endswith("['step']"):
            value = np.full(x.shape, step, x.dtype)
        elif np.issubdtype(x.dtype, np.integer):
            value = rng.integers(1, 100, x.shape).astype(x.dtype)
        else:
            value = (rng.uniform(0.5, 2.0, x.shape) * rng.choice([-1, 1], x.shape)).astype(x.dtype)
        return jax.device_put(value, x.sharding)

    return jax.tree_util.tree_map_with_path(leaf, state)


def assert_bits_equal(actual, expected):
    flat_a, tree_a = jax.tree_util.tree_flatten_with_path(actual)
    flat_e, tree_e = jax.tree_util.tree_flatten_with_path(expected)
    assert tree_a == tree_e
    for (path, a), (_, e) in zip(flat_a, flat_e):
        a, e = np.asarray(a), np.asarray(e)
        assert a.dtype == e.dtype and a.shape == e.shape, jax.tree_util.keystr(path)
        bits = np.dtype(f"uint{8 * e.dtype.itemsize}")
        assert np.array_equal(a.view(bits), e.view(bits)), jax.tree_util.keystr(path)


def test_save_on_8_devices_restore_on_4_and_2_and_back(tmp_path):
    model8, opt8 = model_on(8, 0, "rows")
    par.load_portable_state(model8, randomised(par.portable_state(model8, opt8), 0), opt8)
    saved = par.portable_state(model8, opt8)
    assert saved["model"]["sparse_arch"]["tables"]["t_item"]["momentum1"].shape == (23,)
    checkpoint.save_checkpoint(tmp_path / "a", 1, saved, metadata={"devices": 8})

    for n, start, how in [(4, 4, "planner"), (2, 0, "row_wise")]:
        model, opt = model_on(n, start, how)
        assert model.sparse_arch.plan != model8.sparse_arch.plan
        restored, meta = checkpoint.restore_checkpoint(tmp_path / "a", par.portable_state(model, opt))
        assert meta == {"devices": 8}
        par.load_portable_state(model, restored, opt)
        assert_bits_equal(par.portable_state(model, opt), saved)
        table = model.sparse_arch.tables[0].get_value().weights
        assert table.sharding.mesh.devices.size == n  # placed on the target mesh

    # ... and from the last (2 devices) back onto 8 with yet another plan.
    checkpoint.save_checkpoint(tmp_path / "b", 2, par.portable_state(model, opt))
    back, back_opt = model_on(8, 0, "table_row_wise")
    restored, _ = checkpoint.restore_checkpoint(tmp_path / "b", par.portable_state(back, back_opt))
    par.load_portable_state(back, restored, back_opt)
    assert_bits_equal(par.portable_state(back, back_opt), saved)


def test_a_sharded_checkpoint_restores_into_the_unsharded_model(tmp_path):
    model8, opt8 = model_on(8, 0, "rows")
    par.load_portable_state(model8, randomised(par.portable_state(model8, opt8), 1), opt8)
    saved = par.portable_state(model8, opt8)
    checkpoint.save_checkpoint(tmp_path / "a", 1, saved)
    single = build(OPTIMIZER)  # the same model, not sharded: one device, plain collections
    single_opt = nnx.Optimizer(single, optax.adam(1e-3), wrt=nnx.Param)
    restored, _ = checkpoint.restore_checkpoint(tmp_path / "a", par.portable_state(single, single_opt))
    par.load_portable_state(single, restored, single_opt)
    assert_bits_equal(par.portable_state(single, single_opt), saved)
    for name, weights in model8.sparse_arch.split_embedding_weights().items():
        np.testing.assert_array_equal(single.sparse_arch.split_embedding_weights()[name], weights)


def test_stateful_optax_on_plain_sharded_tables_is_not_portable():
    model = par.shard(build(None), plan("row_wise"), mesh())
    with pytest.raises(NotImplementedError, match="not portable"):
        par.portable_state(model, nnx.Optimizer(model, optax.adagrad(0.1), wrt=nnx.Param))
    state = par.portable_state(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    assert state["model"]["sparse_arch"]["tables"]["t_x"]["weights"].shape == (50, 8)


@pytest.mark.parametrize("how", ["planner", "row_wise"])
def test_a_sharded_collection_sets_and_reads_tables_like_the_unsharded_one(how):
    """The jaxrec.nn.TableCollection interface on ShardedEmbeddingBagCollection (its
    defaults, built on the portable form): weights and optimizer state in and out."""
    model, _ = model_on(8, 0, how)
    single = build(OPTIMIZER)
    rng = np.random.default_rng(5)
    weights = {t.name: rng.normal(size=(t.num_embeddings, t.embedding_dim)).astype(np.float32)
               for t in TABLES}
    states = {name: {k: rng.uniform(0.1, 1.0, np.shape(v)).astype(np.float32) for k, v in s.items()}
              for name, s in single.sparse_arch.split_optimizer_states().items()}
    for ebc in (model.sparse_arch, single.sparse_arch):
        assert isinstance(ebc, TableCollection)
        ebc.set_embedding_weights(weights)
        ebc.set_optimizer_states(states, step=7)
    for ebc in (model.sparse_arch, single.sparse_arch):
        for name, w in ebc.split_embedding_weights().items():
            np.testing.assert_array_equal(np.asarray(w), weights[name])
        for name, s in ebc.split_optimizer_states().items():
            assert set(s) == set(states[name])
            for k, v in s.items():
                np.testing.assert_array_equal(np.asarray(v), states[name][k])
        assert all(int(t["step"]) == 7 for t in ebc.portable_tables().values())
    with pytest.raises(ValueError, match="no table"):
        model.sparse_arch.set_embedding_weights({"nope": weights[TABLES[0].name]})
    with pytest.raises(ValueError, match="has shape"):
        model.sparse_arch.set_embedding_weights({TABLES[0].name: np.zeros((1, 1), np.float32)})
