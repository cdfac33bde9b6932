"""Training NNX models: fused tables equal plain tables + the matching optax optimizer, and
DLRM / DLRM_DCN / TwoTower learn the synthetic click log and ratings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrec.data import SyntheticClickLog
from jaxrec.metrics import auc
from jaxrec.models import DLRM, DLRM_DCN, TwoTower
from jaxrec.nn import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    make_train_step,
)
from jaxrec.optim import SGD, Adagrad, RowWiseAdagrad

LR = 0.05


def click_log(rows=60, features=5, seed=0):
    return SyntheticClickLog(num_embeddings_per_feature=[rows] * features, num_dense=4, seed=seed)


def tables_of(log, dim, pooling="SUM"):
    return [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=n, embedding_dim=dim,
                               feature_names=[k], pooling=pooling)
            for k, n in zip(log.keys, log.table_sizes)]


def bce(model, batch):
    logits = model(batch.dense, batch.sparse)[:, 0]
    losses = optax.sigmoid_binary_cross_entropy(logits, batch.labels)
    return jnp.sum(losses * batch.mask) / jnp.sum(batch.mask)


def build(model_cls, log, optimizer, dim=8, **kwargs):
    ebc = EmbeddingBagCollection(tables_of(log, dim, kwargs.pop("pooling", "SUM")),
                                 optimizer=optimizer, rngs=nnx.Rngs(0))
    return model_cls(ebc, log.num_dense, [16, dim], [16, 1], rngs=nnx.Rngs(1), **kwargs)


# (fused config, optax optimizer of the same math for plain tables). optax.adagrad's eps sits
# inside the square root: a tiny one keeps untouched rows (0 / sqrt(0)) at 0 without
# changing touched ones in float32.
PAIRS = {
    "sgd": (SGD(learning_rate=LR), optax.sgd(LR)),
    "adagrad": (Adagrad(learning_rate=LR, eps=0.0),
                optax.adagrad(LR, initial_accumulator_value=0.0, eps=1e-30)),
}


@pytest.mark.parametrize("name", sorted(PAIRS))
@pytest.mark.parametrize("pooling", ["SUM", "MEAN"])
def test_fused_training_equals_plain_training(name, pooling):
    fused_config, tx = PAIRS[name]
    log = click_log()
    fused = build(DLRM, log, fused_config, pooling=pooling)
    plain = build(DLRM, log, None, pooling=pooling)
    initial = {k: np.asarray(v) for k, v in plain.sparse_arch.split_embedding_weights().items()}
    fused_opt, plain_opt = nnx.Optimizer(fused, tx, wrt=nnx.Param), nnx.Optimizer(plain, tx, wrt=nnx.Param)
    step = make_train_step(bce)
    for batch in log.batches(64, 4):
        np.testing.assert_allclose(step(fused, fused_opt, batch), step(plain, plain_opt, batch),
                                   rtol=1e-5)
    fused_tables = fused.sparse_arch.split_embedding_weights()
    plain_tables = plain.sparse_arch.split_embedding_weights()
    for t in fused_tables:
        assert np.any(np.asarray(fused_tables[t]) != initial[t])  # training moved the table
        np.testing.assert_allclose(fused_tables[t], plain_tables[t], rtol=2e-5, atol=1e-6)
    for arch in ("dense_arch", "over_arch"):
        for a, b in zip(jax.tree.leaves(nnx.state(getattr(fused, arch))),
                        jax.tree.leaves(nnx.state(getattr(plain, arch)))):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    assert int(fused_opt.step[...]) == int(plain_opt.step[...]) == 4
    assert int(fused.sparse_arch.tables[0].get_value().step) == 4


def test_tables_move_only_where_looked_up():
    log = click_log(rows=500)
    model = build(DLRM, log, RowWiseAdagrad(learning_rate=LR))
    before = {k: np.asarray(v) for k, v in model.sparse_arch.split_embedding_weights().items()}
    batch = next(log.batches(16))
    make_train_step(bce)(model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param), batch)
    after = model.sparse_arch.split_embedding_weights()
    for key in log.keys:
        ids = np.unique(np.asarray(batch.sparse[key].values())[:16])  # one id per bag
        changed = np.flatnonzero(np.any(np.asarray(after[f"t_{key}"]) != before[f"t_{key}"], 1))
        np.testing.assert_array_equal(changed, ids)


def evaluate_auc(model, log, start=10_000, batches=4):
    scores, labels = [], []
    for batch in log.batches(1024, batches, start=start):
        scores.append(np.asarray(model(batch.dense, batch.sparse)[:, 0]))
        labels.append(np.asarray(batch.labels))
    return auc(np.concatenate(labels), np.concatenate(scores))


@pytest.mark.parametrize("model_cls", [DLRM, DLRM_DCN])
def test_ctr_models_learn_the_synthetic_log(model_cls):
    log = click_log(rows=200, features=8, seed=3)
    kwargs = {"dcn_num_layers": 2, "dcn_low_rank_dim": 8} if model_cls is DLRM_DCN else {}
    model = build(model_cls, log, RowWiseAdagrad(learning_rate=0.1), **kwargs)
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    step = make_train_step(bce)
    before = evaluate_auc(model, log)
    for batch in log.batches(256, 150):
        step(model, optimizer, batch)
    after = evaluate_auc(model, log)
    ceiling = log.teacher_auc()
    assert after > 0.68 and after > before + 0.1, (before, after, ceiling)


@pytest.mark.parametrize("model_cls", [DLRM, DLRM_DCN])
def test_a_bfloat16_dense_part_tracks_the_float32_one(model_cls):
    """dtype=bfloat16: the MLPs, interaction and cross net compute in bfloat16 on float32
    parameters; logits, parameters and their gradients stay float32 and follow the float32
    model to bfloat16's precision; trained alike, the two losses stay close."""
    log = click_log(rows=50, features=4, seed=5)
    kwargs = {"dcn_num_layers": 2, "dcn_low_rank_dim": 8} if model_cls is DLRM_DCN else {}
    models = [build(model_cls, log, RowWiseAdagrad(learning_rate=0.1), **kwargs, dtype=dtype)
              for dtype in (None, jnp.bfloat16)]
    batches = list(log.batches(128, 4))
    logits = [nnx.jit(lambda m, b: m(b.dense, b.sparse))(m, batches[0]) for m in models]
    assert logits[1].dtype == jnp.float32 and float(jnp.std(logits[0])) > 0.01
    np.testing.assert_allclose(logits[1], logits[0], atol=0.03 * float(jnp.abs(logits[0]).max()))
    grads = [nnx.jit(nnx.grad(bce))(m, batches[0]) for m in models]
    for g32, g16 in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        assert g16.dtype == jnp.float32
        cosine = jnp.vdot(g32, g16) / (jnp.linalg.norm(g32) * jnp.linalg.norm(g16) + 1e-30)
        assert float(cosine) > 0.98, float(cosine)
    losses = []
    for model in models:
        optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
        step = make_train_step(bce)
        losses.append([float(step(model, optimizer, b)) for b in batches])
        assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    np.testing.assert_allclose(losses[1], losses[0], rtol=0.02)


def test_two_tower_matrix_factorisation_fits_ratings():
    rng = np.random.default_rng(0)
    users, items, dim = 40, 30, 4
    u, v = rng.normal(size=(users, dim)), rng.normal(size=(items, dim))
    tables = [EmbeddingBagConfig(name="t_user", num_embeddings=users, embedding_dim=dim,
                                 feature_names=["user_id"]),
              EmbeddingBagConfig(name="t_item", num_embeddings=items, embedding_dim=dim,
                                 feature_names=["item_id"])]
    model = TwoTower(EmbeddingBagCollection(tables, optimizer=Adagrad(learning_rate=0.3),
                                            rngs=nnx.Rngs(0)),
                     ["user_id"], ["item_id"], bias=3.0, rngs=nnx.Rngs(1))
    from jaxrec.data._batch import batch_from_ids

    def batch(n, seed):
        r = np.random.default_rng(seed)
        ids = np.stack([r.integers(0, users, n), r.integers(0, items, n)], 1)
        ratings = 3.0 + (u[ids[:, 0]] * v[ids[:, 1]]).sum(1)
        return batch_from_ids(["user_id", "item_id"], ids, np.zeros((n, 0), np.float32),
                              ratings.astype(np.float32), n)

    def mse(model, b):
        return jnp.sum((model(b.sparse) - b.labels) ** 2 * b.mask) / jnp.sum(b.mask)

    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = make_train_step(mse)
    test = batch(2000, 99)
    start = float(mse(model, test))
    for i in range(300):
        step(model, optimizer, batch(256, i))
    end = float(mse(model, test))
    assert end < 0.25 * start, (start, end)


def test_train_step_rejects_a_plain_optax_state():
    log = click_log()
    model = build(DLRM, log, None)
    with pytest.raises(TypeError, match="nnx.Optimizer"):
        make_train_step(bce)(model, optax.sgd(0.1).init(nnx.state(model, nnx.Param)),
                             next(log.batches(8)))


def test_biased_matrix_factorisation_scores_global_plus_biases_plus_factors():
    rng = np.random.default_rng(1)
    users, items, dim = 7, 5, 4
    tables = [EmbeddingBagConfig(name="t_user", num_embeddings=users, embedding_dim=dim,
                                 feature_names=["user_id"]),
              EmbeddingBagConfig(name="t_item", num_embeddings=items, embedding_dim=dim,
                                 feature_names=["item_id"])]
    ebc = EmbeddingBagCollection(tables, rngs=nnx.Rngs(0))
    p, q = rng.normal(size=(users, dim)), rng.normal(size=(items, dim))
    ebc.set_embedding_weights({"t_user": p, "t_item": q})
    model = TwoTower(ebc, ["user_id"], ["item_id"], bias=3.5, biased=True, rngs=nnx.Rngs(1))
    from jaxrec.data._batch import batch_from_ids

    ids = np.stack([rng.integers(0, users, 11), rng.integers(0, items, 11)], 1)
    b = batch_from_ids(["user_id", "item_id"], ids, np.zeros((11, 0), np.float32),
                       np.zeros(11, np.float32), 11)
    pu, qi = p[ids[:, 0]], q[ids[:, 1]]
    want = 3.5 + pu[:, -1] + qi[:, -1] + np.sum(pu[:, :-1] * qi[:, :-1], axis=1)
    np.testing.assert_allclose(np.asarray(model(b.sparse)), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="biased=True needs layer_sizes=()"):
        TwoTower(ebc, ["user_id"], ["item_id"], (8,), biased=True, rngs=nnx.Rngs(1))
