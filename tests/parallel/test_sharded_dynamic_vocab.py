"""A dynamic-vocabulary table sharded by key hash over 8 devices is the unsharded table.

Tables: t_user, dynamic (64 slots in buckets of 4: 16 buckets, 2 per device, 8 slots per
device), read by two features; t_item, ordinary (MEAN). The planner makes t_user ROW_WISE
in equal blocks; ``jaxrec.parallel.shard`` turns the unsharded model into the sharded one.
Trained on the same batches of raw user ids (about 150 distinct over the run, more than
the 64 slots: evictions every step), both give, step by step, the same losses and, after
the run, the same index (slot for slot: each device's part is the whole table's bucket
range), rows, optimizer state, statistics and changes, with LRU and LFU eviction, bags
bounded or not. Evaluation looks up only (unknown ids: zeros), alike. The portable form
restores a sharded table into an unsharded collection and back. Plans a dynamic table
cannot take are refused with the fix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxrec.parallel as par
from jaxrec.nn import DynamicVocab, EmbeddingBagCollection, EmbeddingBagConfig, make_train_step
from jaxrec.optim import RowWiseAdagrad
from jaxrec.sparse import KeyedJaggedTensor

N, B, SLOTS, BUCKET, DIM = 8, 2, 64, 4, 4
KEYS = ["item", "user", "last_user"]
STEPS = 6
RTOL, ATOL = 2e-5, 1e-6  # sums of repeated rows' gradients in another order: float32 noise


def tables(eviction: str = "lru", slots: int = SLOTS):
    user = EmbeddingBagConfig(name="t_user", num_embeddings=slots, embedding_dim=DIM,
                              feature_names=["user", "last_user"],
                              dynamic=DynamicVocab(eviction=eviction, bucket_size=BUCKET))
    item = EmbeddingBagConfig(name="t_item", num_embeddings=10, embedding_dim=DIM, feature_names=["item"],
                              pooling="MEAN")
    return [user, item]


class Model(nnx.Module):
    def __init__(self, ebc):
        self.ebc = ebc

    def __call__(self, kjt):
        return jnp.sum(jnp.tanh(self.ebc(kjt).values()), axis=1)


def unsharded(eviction: str = "lru", seed: int = 0) -> Model:
    return Model(EmbeddingBagCollection(tables(eviction), optimizer=RowWiseAdagrad(learning_rate=0.3),
                                        rngs=nnx.Rngs(seed)))


def mesh():
    return jax.make_mesh((N,), ("data",), devices=jax.devices("cpu")[:N])


def plan(eviction: str = "lru"):
    return par.EmbeddingShardingPlanner(par.Topology(world_size=N, hbm_cap=1 << 30)).plan(tables(eviction))


def batch(rng, pool: np.ndarray):
    """A global KJT of N * B samples: raw user ids from ``pool`` (0-3 a bag, repeats), items."""
    lengths = rng.integers(0, 4, size=(len(KEYS), N * B))
    values = [rng.integers(0, 10, lengths[0].sum())] + [rng.choice(pool, lengths[k].sum()) for k in (1, 2)]
    kjt = KeyedJaggedTensor(KEYS, np.concatenate(values).astype(np.int32), lengths=lengths.ravel(),
                            capacity=len(KEYS) * N * B * 3)
    return kjt, jnp.asarray(rng.normal(size=N * B), jnp.float32)


def loss_fn(model, kjt, target, denominator):
    return jnp.sum((model(kjt) - target) ** 2) / denominator


POOL = (np.arange(150) - 75) * 7919  # more distinct ids than slots, negative ones too


# lfu: bounded bags too (every id read from per-feature windows, _dist.window_input)
@pytest.mark.parametrize(("eviction", "max_ids_per_bag"), [("lru", None), ("lfu", 3)])
def test_sharded_training_equals_the_unsharded_table(eviction, max_ids_per_bag):
    assert plan(eviction)["t_user"].sharding_type == par.ShardingType.ROW_WISE
    reference = unsharded(eviction)
    model = par.shard(unsharded(eviction), plan(eviction), mesh(), max_ids_per_bag=max_ids_per_bag)
    ref_opt, opt = (nnx.Optimizer(m, optax.sgd(0.0), wrt=nnx.Param) for m in (reference, model))
    ref_step = make_train_step(lambda m, k, t: loss_fn(m, k, t, N * B))
    step = make_train_step(lambda m, k, t: loss_fn(m, k, t, B))  # the mean of the device means
    rng = np.random.default_rng(0)
    for i in range(STEPS):
        kjt, target = batch(rng, POOL)
        np.testing.assert_allclose(step(model, opt, *par.shard_batch((kjt, target), mesh())),
                                   ref_step(reference, ref_opt, kjt, target), rtol=RTOL, err_msg=f"step {i}")

    got, want = model.ebc.portable_tables(), reference.ebc.portable_tables()
    for name in want:
        for field, value in want[name].items():
            if field != "index":  # rows and optimizer state, slot by slot
                np.testing.assert_allclose(got[name][field], value, rtol=RTOL, atol=ATOL,
                                           err_msg=f"{name}.{field}")
    assert model.ebc.split_optimizer_states()["t_user"].keys() == \
        reference.ebc.split_optimizer_states()["t_user"].keys()
    for field, value in want["t_user"]["index"].items():  # placed alike: the same index exactly
        np.testing.assert_array_equal(got["t_user"]["index"][field], value, err_msg=field)
    stats, ref_stats = model.ebc.dynamic_statistics()["t_user"], reference.ebc.dynamic_statistics()["t_user"]
    assert {k: float(v) for k, v in stats.items()} == {k: float(v) for k, v in ref_stats.items()}
    assert int(stats["evicted"]) > 0 and int(stats["size"]) > SLOTS // 2
    changes, ref_changes = model.ebc.dynamic_changes("t_user", STEPS - 2), \
        reference.ebc.dynamic_changes("t_user", STEPS - 2)
    np.testing.assert_array_equal(changes["ids"], ref_changes["ids"])
    np.testing.assert_allclose(changes["rows"], ref_changes["rows"], rtol=RTOL, atol=ATOL)
    assert changes["ids"].size > 0
    with pytest.raises(ValueError, match="'t_item' is not a dynamic table"):
        model.ebc.dynamic_changes("t_item", 0)

    # evaluation: find only, in both; ids never seen look up nothing
    reference.eval()
    model.eval()
    kjt, _ = batch(rng, np.concatenate([POOL, POOL + 1]))
    got = par.make_forward(lambda m, k: m(k))(model, par.shard_batch(kjt, mesh()))
    np.testing.assert_allclose(np.asarray(got).reshape(-1), reference(kjt), rtol=RTOL, atol=ATOL)
    assert int(reference.ebc.dynamic_statistics()["t_user"]["unknown_lookups"]) > 0
    assert model.ebc.dynamic_statistics()["t_user"]["size"] == stats["size"]  # nothing inserted


def test_the_portable_form_restores_sharded_into_unsharded_and_back():
    model = par.shard(unsharded(), plan(), mesh())
    opt = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    step = make_train_step(lambda m, k, t: loss_fn(m, k, t, B))
    rng = np.random.default_rng(1)
    for _ in range(3):
        step(model, opt, *par.shard_batch(batch(rng, POOL), mesh()))
    portable = model.ebc.portable_tables()
    assert (portable["t_user"]["index"]["digests"] != 0).sum() > 0
    restored = unsharded(seed=5)  # through a whole model's checkpoint form (what jaxrec train saves)
    par.load_portable_state(restored, par.portable_state(model))
    again = par.ShardedEmbeddingBagCollection(tables(), plan(), mesh(), optimizer=RowWiseAdagrad(learning_rate=0.3),
                                              initial=restored.ebc.portable_tables())
    for other in (restored.ebc.portable_tables(), again.portable_tables()):
        assert flat(other).keys() == flat(portable).keys()
        for key, value in flat(portable).items():
            np.testing.assert_array_equal(flat(other)[key], value, err_msg=str(key))
    restored.eval()
    sharded_again = Model(again)
    sharded_again.eval()
    kjt, _ = batch(rng, POOL)
    got = par.make_forward(lambda m, k: m(k))(sharded_again, par.shard_batch(kjt, mesh()))
    np.testing.assert_allclose(np.asarray(got).reshape(-1), restored(kjt), rtol=RTOL, atol=ATOL)


def flat(portable) -> dict[tuple[str, ...], np.ndarray]:
    """``{(table, field) or (table, "index", field): array}`` of a portable form."""
    out = {}
    for name, fields in portable.items():
        for field, value in fields.items():
            items = value.items() if field == "index" else [(None, value)]
            for sub, x in items:
                out[(name, field) + ((sub,) if sub else ())] = np.asarray(x)
    return out


def test_plans_that_a_dynamic_table_cannot_take_are_refused():
    ebc = EmbeddingBagCollection(tables(), optimizer=RowWiseAdagrad(learning_rate=0.1), rngs=nnx.Rngs(0))
    table_wise = par.construct_plan(tables(), {"t_user": par.table_wise(0), "t_item": par.table_wise(1)}, N)
    with pytest.raises(ValueError, match="sharded ROW_WISE over every device.*row_wise()"):
        par.shard(ebc, table_wise, mesh())
    few = par.construct_plan(tables(), {"t_user": par.row_wise(range(4)), "t_item": par.row_wise()}, N)
    with pytest.raises(ValueError, match="in equal blocks"):
        par.shard(ebc, few, mesh())
    constrained = par.EmbeddingShardingPlanner(
        par.Topology(world_size=N, hbm_cap=1 << 30),
        constraints={"t_user": par.ParameterConstraints(sharding_types=["table_wise"])})
    with pytest.raises(ValueError, match="allow 'row_wise'"):
        constrained.plan(tables())
    odd = tables(slots=48)  # 12 buckets over 8 devices
    with pytest.raises(ValueError, match="must be a multiple of the 8 devices.*multiple of 32"):
        par.ShardedEmbeddingBagCollection(odd, par.construct_plan(odd, {"t_user": par.row_wise(),
                                                                        "t_item": par.row_wise()}, N),
                                          mesh(), optimizer=RowWiseAdagrad(learning_rate=0.1), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="give the collection a fused optimizer"):
        par.ShardedEmbeddingBagCollection(tables(), plan(), mesh(), rngs=nnx.Rngs(0))


def test_sharding_a_trained_model_carries_each_dynamic_tables_index():
    """An unsharded collection whose two dynamic tables share one index (one group): sharded
    after training, each table's index is its own part of the group's, slot for slot."""
    configs = [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=SLOTS, embedding_dim=DIM, feature_names=[k],
                                  dynamic=DynamicVocab(bucket_size=BUCKET)) for k in ("user", "last_user")]
    model = Model(EmbeddingBagCollection(configs, optimizer=RowWiseAdagrad(learning_rate=0.3), rngs=nnx.Rngs(0)))
    assert len(model.ebc.groups) == 1
    opt = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    step = make_train_step(lambda m, k, t: loss_fn(m, k, t, N * B))
    rng = np.random.default_rng(2)
    for _ in range(2):
        kjt, target = batch(rng, POOL)
        step(model, opt, KeyedJaggedTensor(KEYS[1:], kjt.values()[kjt.lengths()[:N * B].sum():],
                                           lengths=kjt.lengths()[N * B:]), target)
    want = model.ebc.portable_tables()
    plan = par.EmbeddingShardingPlanner(par.Topology(world_size=N, hbm_cap=1 << 30)).plan(configs)
    sharded = par.shard(model, plan, mesh()).ebc.portable_tables()
    for name in ("t_user", "t_last_user"):
        assert (want[name]["index"]["digests"] != 0).sum() > 0
        for field, value in want[name]["index"].items():
            np.testing.assert_array_equal(sharded[name]["index"][field], value, err_msg=f"{name} {field}")
