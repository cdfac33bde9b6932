"""Dynamic-vocabulary tables in a collection (EmbeddingBagConfig(dynamic=DynamicVocab())).

Training on raw ids equals training an ordinary fused collection of the same rows on the
slots that a Python dict model of the hash table assigns (tests/test_hash_table.py's),
with each new id's row drawn anew (from a key of the table, the step and the id) and its
optimizer state zeroed before the step: the same losses, rows and optimizer state after
every step, evictions happening. Evaluation only looks up; the portable form carries the
index."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hash_table_testing import DictModel, fresh_row

import jaxrec.parallel as par
from jaxrec.nn import DynamicVocab, EmbeddingBagCollection, EmbeddingBagConfig, TTConfig, make_train_step
from jaxrec.optim import RowWiseAdagrad
from jaxrec.serving import quantize
from jaxrec.sparse import KeyedJaggedTensor

SLOTS, BUCKET, B = 16, 4, 8


def tables(dynamic: bool):
    user = EmbeddingBagConfig(name="t_user", num_embeddings=SLOTS, embedding_dim=4, feature_names=["user"],
                              dynamic=DynamicVocab(eviction="lru", bucket_size=BUCKET) if dynamic else None)
    item = EmbeddingBagConfig(name="t_item", num_embeddings=7, embedding_dim=4, feature_names=["item"])
    return [user, item]


class Model(nnx.Module):
    def __init__(self, ebc):
        self.ebc = ebc

    def __call__(self, kjt):
        return jnp.sum(jnp.tanh(self.ebc(kjt).values()), axis=1)


def batch(rng):
    """Raw user ids (repeats, new ones arriving, 40 distinct over the run: more than the 16
    slots), 1-3 per bag, and item ids in range."""
    lengths = rng.integers(1, 4, size=2 * B)
    users = rng.choice(np.arange(-20, 20) * 7919, size=lengths[:B].sum())
    items = rng.integers(0, 7, size=lengths[B:].sum())
    return lengths, users.astype(np.int32), items.astype(np.int32), jnp.asarray(rng.normal(size=B), jnp.float32)


def kjt(lengths, users, items):
    return KeyedJaggedTensor(["user", "item"], np.concatenate([users, items]), lengths=lengths, capacity=64)


def loss_fn(model, features, target):
    return jnp.mean((model(features) - target) ** 2)


def test_training_equals_an_ordinary_table_on_the_dict_models_slots():
    rng = np.random.default_rng(0)
    dynamic = Model(EmbeddingBagCollection(tables(True), optimizer=RowWiseAdagrad(learning_rate=0.3),
                                           rngs=nnx.Rngs(0)))
    plain = Model(EmbeddingBagCollection(tables(False), optimizer=RowWiseAdagrad(learning_rate=0.3),
                                         bounds_check_mode="NONE", rngs=nnx.Rngs(0)))
    model = DictModel(SLOTS // BUCKET, BUCKET, "lru", 32)
    config = tables(True)[0]
    step_dynamic, step_plain = make_train_step(loss_fn), make_train_step(loss_fn)
    opt = [nnx.Optimizer(m, optax.sgd(0.0), wrt=nnx.Param) for m in (dynamic, plain)]
    evicted = 0
    for step in range(12):
        lengths, users, items, target = batch(rng)
        slots, fresh, (_, out, _) = model.find_or_insert(users, np.ones(users.size, bool), step)
        evicted += out
        # the ordinary table: the new ids' rows drawn as the dynamic table draws them, state zeroed
        weights = np.asarray(plain.ebc.split_embedding_weights()["t_user"]).copy()
        states = {k: np.asarray(v).copy() for k, v in plain.ebc.split_optimizer_states()["t_user"].items()}
        for u in set(users.tolist()):
            if model.slot_of.get(u, -1) in fresh:  # a new id's row: drawn for that id
                weights[model.slot_of[u]] = fresh_row("t_user", step, u, 32, 4, *config.init_bounds())
                for v in states.values():
                    v[model.slot_of[u]] = 0
        plain.ebc.set_embedding_weights({"t_user": weights})
        item_states = {k: np.asarray(v) for k, v in plain.ebc.split_optimizer_states()["t_item"].items()}
        plain.ebc.set_optimizer_states({"t_user": states, "t_item": item_states})
        got = step_dynamic(dynamic, opt[0], kjt(lengths, users, items), target)
        want = step_plain(plain, opt[1], kjt(lengths, slots.astype(np.int32), items), target)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"step {step}")
        # The two collections group their tables differently (a dynamic table is a group of
        # its own), so gradients of repeated rows are summed in another order: float32 noise.
        for name in ("t_user", "t_item"):
            np.testing.assert_allclose(dynamic.ebc.split_embedding_weights()[name],
                                       plain.ebc.split_embedding_weights()[name], rtol=1e-5, atol=1e-5,
                                       err_msg=f"step {step}")
            for k, v in plain.ebc.split_optimizer_states()[name].items():
                np.testing.assert_allclose(dynamic.ebc.split_optimizer_states()[name][k], v, rtol=1e-5, atol=1e-6)
    stats = dynamic.ebc.dynamic_statistics()["t_user"]
    assert int(stats["size"]) == SLOTS and int(stats["evicted"]) == evicted > 0
    # what changed since step 9: the ids the last 3 steps saw, with their rows now
    changes = dynamic.ebc.dynamic_changes("t_user", 9)
    want = np.flatnonzero(model.used & (model.seen >= 9))
    np.testing.assert_array_equal(changes["ids"], model.keys[want])
    np.testing.assert_array_equal(changes["rows"], np.asarray(dynamic.ebc.split_embedding_weights()["t_user"])[want])
    with pytest.raises(ValueError, match="'t_item' is not a dynamic table"):
        dynamic.ebc.dynamic_changes("t_item", 0)


def test_evaluation_looks_up_only_and_counts_unknown_ids():
    ebc = EmbeddingBagCollection(tables(True), optimizer=RowWiseAdagrad(learning_rate=0.1), rngs=nnx.Rngs(0))
    model = Model(ebc)
    step = make_train_step(loss_fn)
    opt = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    lengths = np.array([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    users = np.arange(B, dtype=np.int32) * 1000
    items = np.zeros(B, np.int32)
    step(model, opt, kjt(lengths, users, items), jnp.ones(B))
    before = ebc.dynamic_statistics()["t_user"]
    model.eval()
    known = ebc(kjt(lengths, users, items)).values()[:, :4]
    unknown = ebc(kjt(lengths, users + 1, items)).values()[:, :4]
    after = ebc.dynamic_statistics()["t_user"]
    assert int(after["size"]) == int(before["size"]) == B  # nothing inserted
    assert int(after["unknown_lookups"]) == B
    assert float(jnp.abs(known).min()) > 0 and float(jnp.abs(unknown).max()) == 0.0
    model.train()  # training again: the unknown ids are inserted (evicting where a bucket is full)
    ebc(kjt(lengths, users + 1, items))
    stats = ebc.dynamic_statistics()["t_user"]
    assert int(stats["inserted"]) + int(stats["failed_inserts"]) == 2 * B and int(stats["size"]) > B


def test_the_portable_form_carries_the_index():
    rng = np.random.default_rng(1)
    ebc = EmbeddingBagCollection(tables(True), optimizer=RowWiseAdagrad(learning_rate=0.1), rngs=nnx.Rngs(0))
    model = Model(ebc)
    step = make_train_step(loss_fn)
    opt = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    for _ in range(3):
        lengths, users, items, target = batch(rng)
        step(model, opt, kjt(lengths, users, items), target)
    portable = ebc.portable_tables()
    assert (portable["t_user"]["index"]["digests"] != 0).sum() > 0
    restored = EmbeddingBagCollection(tables(True), optimizer=RowWiseAdagrad(learning_rate=0.1), rngs=nnx.Rngs(5))
    restored.load_portable_tables(portable)
    for a, b in zip(jax.tree.leaves(ebc.indices[0].get_value()), jax.tree.leaves(restored.indices[0].get_value())):
        np.testing.assert_array_equal(a, b)
    features = kjt(*batch(rng)[:3])
    np.testing.assert_array_equal(restored(features).values(), ebc(features).values())
    # a whole model's checkpoint form (what jaxrec train saves) carries it too
    again = Model(EmbeddingBagCollection(tables(True), optimizer=RowWiseAdagrad(learning_rate=0.1),
                                         rngs=nnx.Rngs(6)))
    par.load_portable_state(again, par.portable_state(model))
    for a, b in zip(jax.tree.leaves(ebc.indices[0].get_value()), jax.tree.leaves(again.ebc.indices[0].get_value())):
        np.testing.assert_array_equal(a, b)


def test_bad_dynamic_tables_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="must be a multiple of bucket_size=4"):
        EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=["f"],
                           dynamic=DynamicVocab(bucket_size=4))
    with pytest.raises(ValueError, match="eviction must be one of"):
        DynamicVocab(eviction="random")
    with pytest.raises(ValueError, match=r"bucket_size must be an int in \[1, 1024\], got 2048"):
        DynamicVocab(bucket_size=2048)
    with pytest.raises(ValueError, match="either TT or dynamic"):
        EmbeddingBagConfig(name="t", num_embeddings=128, embedding_dim=4, feature_names=["f"],
                           dynamic=DynamicVocab(), tt=TTConfig(tt_ranks=(2,)))
    with pytest.raises(ValueError, match="give the collection a fused optimizer"):
        EmbeddingBagCollection(tables(True), rngs=nnx.Rngs(0))
    ebc = EmbeddingBagCollection(tables(True), optimizer=RowWiseAdagrad(learning_rate=0.1), rngs=nnx.Rngs(0))
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices("cpu")[:2])
    plan = par.construct_plan(tables(True), {t.name: par.table_wise(0) for t in tables(True)}, 2)
    with pytest.raises(ValueError, match="sharded ROW_WISE over every device"):  # tests/parallel
        par.shard(ebc, plan, mesh)
    with pytest.raises(NotImplementedError, match="serving does not support yet"):
        quantize(Model(ebc))


@pytest.mark.parametrize("init_fn", [None, "normal"])
def test_a_new_rows_draw_depends_on_the_table_step_and_id_only(init_fn):
    """The same id gets the same row wherever it sits in the batch (so a sharded table draws
    what the whole table draws), another id or step another row; default rows lie in the
    table's bounds and look uniform."""
    from jaxrec.nn.dynamic import fresh_rows

    fn = None if init_fn is None else (lambda key, shape, dtype: jax.random.normal(key, shape, dtype))
    config = EmbeddingBagConfig(name="t", num_embeddings=128, embedding_dim=64, feature_names=["f"],
                                dynamic=DynamicVocab(), init_fn=fn)
    ids = jnp.asarray(np.random.default_rng(7).integers(-2**31, 2**31, 500), jnp.int32)
    first = jnp.zeros(ids.shape, jnp.int32)
    rows = np.asarray(fresh_rows([config], first, 3, ids))
    np.testing.assert_array_equal(np.asarray(fresh_rows([config], first, 3, ids[::-1])), rows[::-1])
    assert not np.allclose(np.asarray(fresh_rows([config], first, 4, ids)), rows)
    assert len({r.tobytes() for r in rows}) == np.unique(np.asarray(ids)).size
    if init_fn is None:
        low, high = config.init_bounds()
        assert rows.min() >= low and rows.max() < high
        assert abs(rows.mean()) < 0.02 * high and abs(rows.std() - high / np.sqrt(3)) < 0.02 * high


def test_dynamic_tables_of_one_group_train_as_tables_of_their_own():
    """Two dynamic tables of one group (one index of two bucket ranges, one lookup; the
    same raw ids in both) train as the same two tables in collections of their own:
    losses, rows, optimizer state, statistics and each table's portable index."""
    def config(name, feature, slots):
        return EmbeddingBagConfig(name=name, num_embeddings=slots, embedding_dim=4, feature_names=[feature],
                                  dynamic=DynamicVocab(eviction="lfu", bucket_size=BUCKET))

    a, b = config("t_a", "user", SLOTS), config("t_b", "item", 2 * SLOTS)
    grouped = EmbeddingBagCollection([a, b], optimizer=RowWiseAdagrad(learning_rate=0.3), rngs=nnx.Rngs(0))
    assert len(grouped.groups) == 1
    alone = [EmbeddingBagCollection([c], optimizer=RowWiseAdagrad(learning_rate=0.3), rngs=nnx.Rngs(1),
                                    name=f"ebc_{c.name}") for c in (a, b)]
    for ebc, name in zip(alone, ("t_a", "t_b")):
        ebc.set_embedding_weights({name: grouped.split_embedding_weights()[name]})

    class Pair(nnx.Module):
        def __init__(self, ebcs):
            self.ebcs = nnx.List(ebcs)

        def __call__(self, features):
            return jnp.sum(jnp.tanh(jnp.concatenate([e(features).values() for e in self.ebcs], axis=1)), axis=1)

    models = [Model(grouped), Pair(alone)]
    opts = [nnx.Optimizer(m, optax.sgd(0.0), wrt=nnx.Param) for m in models]
    steps = [make_train_step(loss_fn), make_train_step(loss_fn)]
    rng = np.random.default_rng(4)
    for step in range(10):
        lengths = rng.integers(1, 4, size=2 * B)
        ids = rng.choice(np.arange(-30, 30) * 7919, size=lengths.sum()).astype(np.int32)  # shared raw ids
        features = KeyedJaggedTensor(["user", "item"], ids, lengths=lengths, capacity=64)
        target = jnp.asarray(rng.normal(size=B), jnp.float32)
        losses = [float(s(m, o, features, target)) for s, m, o in zip(steps, models, opts)]
        np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6, err_msg=f"step {step}")
    for ebc, name in zip(alone, ("t_a", "t_b")):
        np.testing.assert_allclose(grouped.split_embedding_weights()[name], ebc.split_embedding_weights()[name],
                                   rtol=1e-5, atol=1e-6)
        for k, v in ebc.split_optimizer_states()[name].items():
            np.testing.assert_allclose(grouped.split_optimizer_states()[name][k], v, rtol=1e-5, atol=1e-6)
        for k, v in ebc.dynamic_statistics()[name].items():
            assert float(grouped.dynamic_statistics()[name][k]) == float(v), (name, k)
        want = ebc.portable_tables()[name]["index"]
        for k, v in grouped.portable_tables()[name]["index"].items():
            np.testing.assert_array_equal(v, want[k], err_msg=f"{name} {k}")
        np.testing.assert_array_equal(grouped.dynamic_changes(name, 5)["ids"], ebc.dynamic_changes(name, 5)["ids"])
        np.testing.assert_allclose(grouped.dynamic_changes(name, 5)["rows"], ebc.dynamic_changes(name, 5)["rows"],
                                   rtol=1e-5, atol=1e-6)
    assert int(grouped.dynamic_statistics()["t_a"]["evicted"]) > 0
    restored = EmbeddingBagCollection([a, b], optimizer=RowWiseAdagrad(learning_rate=0.3), rngs=nnx.Rngs(5))
    restored.load_portable_tables(grouped.portable_tables())
    for x, y in zip(jax.tree.leaves(nnx.state(restored.indices)), jax.tree.leaves(nnx.state(grouped.indices))):
        np.testing.assert_array_equal(x, y)
