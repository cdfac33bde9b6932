"""Retrieval losses against a float64 NumPy softmax written out per row, and a two-tower
model trained with in-batch negatives retrieving its held-out items."""

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.test_util import check_grads

from jaxrec import metrics
from jaxrec.models import TwoTower, bpr_loss, in_batch_softmax_loss
from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig, make_train_step
from jaxrec.ops import top_k_retrieval
from jaxrec.sparse import KeyedJaggedTensor


def softmax_reference(q, c, log_q, ids, mask, temperature):
    """Row i: -log of the positive's share of exp(logit) over the batch's valid negatives."""
    q, c = np.asarray(q, np.float64), np.asarray(c, np.float64)
    total, weight = 0.0, 0.0
    for i in range(len(q)):
        if mask[i] <= 0:
            continue
        terms = []
        for j in range(len(c)):
            if j != i and (mask[j] <= 0 or (ids is not None and ids[j] == ids[i])):
                continue
            logit = q[i] @ c[j] / temperature - (0.0 if log_q is None else log_q[j])
            terms.append((j == i, logit))
        top = max(t for _, t in terms)
        log_sum = top + math.log(sum(math.exp(t - top) for _, t in terms))
        positive = next(t for is_pos, t in terms if is_pos)
        total += mask[i] * (log_sum - positive)
        weight += mask[i]
    return total / weight


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("corrected", [False, True])
def test_in_batch_softmax_equals_the_reference(seed, corrected):
    rng = np.random.default_rng(seed)
    b, h = 9, 5
    q, c = rng.normal(size=(b, h)).astype(np.float32), rng.normal(size=(b, h)).astype(np.float32)
    ids = rng.integers(0, 5, size=b)  # repeated items: their copies are no negatives
    mask = np.ones(b, np.float32)
    mask[[2, 7]] = 0.0  # padding rows
    mask[4] = 2.0  # a row that counts twice
    log_q = np.log(rng.uniform(0.01, 0.5, size=b)).astype(np.float32) if corrected else None
    for kwargs in (dict(), dict(candidate_ids=ids, mask=mask, temperature=0.5)):
        got = float(in_batch_softmax_loss(q, c, log_q=log_q, **kwargs))
        want = softmax_reference(q, c, log_q, kwargs.get("candidate_ids"),
                                 kwargs.get("mask", np.ones(b)), kwargs.get("temperature", 1.0))
        assert got == pytest.approx(want, rel=2e-6), kwargs


def test_bpr_equals_the_reference():
    rng = np.random.default_rng(7)
    q, p, n = (rng.normal(size=(6, 4)).astype(np.float32) for _ in range(3))
    mask = np.array([1, 1, 0, 1, 2, 1], np.float32)
    margin = np.sum(q.astype(np.float64) * (p - n.astype(np.float64)), axis=1)
    want = np.sum(mask * np.log1p(np.exp(-margin))) / mask.sum()
    assert float(bpr_loss(q, p, n, mask=mask)) == pytest.approx(want, rel=1e-6)


def test_the_gradient_of_the_softmax_loss_matches_finite_differences():
    rng = np.random.default_rng(3)
    q, c = (jnp.asarray(rng.normal(size=(5, 3)), jnp.float32) for _ in range(2))
    log_q = jnp.asarray(np.log(rng.uniform(0.1, 0.9, 5)), jnp.float32)
    check_grads(lambda a, b: in_batch_softmax_loss(a, b, log_q=log_q), (q, c),
                              order=1, modes=["rev"], eps=1e-2, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("call, message", [
    (lambda: in_batch_softmax_loss(jnp.ones((3, 2)), jnp.ones((4, 2))), "one shape"),
    (lambda: in_batch_softmax_loss(jnp.ones((3, 2)), jnp.ones((3, 2)), log_q=jnp.ones(2)),
     r"log_q must have shape \(3,\)"),
    (lambda: in_batch_softmax_loss(jnp.ones((3, 2)), jnp.ones((3, 2)), candidate_ids=jnp.ones(4)),
     r"candidate_ids must have shape \(3,\)"),
    (lambda: bpr_loss(jnp.ones((3, 2)), jnp.ones((3, 2)), jnp.ones((3, 3))), "one shape"),
])
def test_bad_shapes_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_two_towers_trained_with_in_batch_negatives_retrieve_their_items():
    """Users like the items of their own cluster; after training, a user's top 10 items
    (exact, over all items, items seen in training excluded) hold many of its held-out
    ones: far above the 10 / 60 of a random ranking."""
    rng = np.random.default_rng(0)
    users, items, clusters = 40, 60, 4
    user_cluster, item_cluster = rng.integers(0, clusters, users), np.arange(items) % clusters
    liked = user_cluster[:, None] == item_cluster[None, :]
    pairs = np.argwhere(liked & (rng.random((users, items)) < 0.6))
    held = rng.random(len(pairs)) < 0.2
    train, test = pairs[~held], pairs[held]
    tables = [EmbeddingBagConfig(name="users", num_embeddings=users, embedding_dim=8, feature_names=["u"]),
              EmbeddingBagConfig(name="items", num_embeddings=items, embedding_dim=8, feature_names=["i"])]
    model = TwoTower(EmbeddingBagCollection(tables, rngs=nnx.Rngs(0)), ["u"], ["i"], (16, 8),
                     rngs=nnx.Rngs(1))
    optimizer = nnx.Optimizer(model, optax.adam(0.02), wrt=nnx.Param)

    def loss_fn(model, kjt, ids):
        return in_batch_softmax_loss(*model.embed(kjt), candidate_ids=ids)

    step = make_train_step(loss_fn)
    for _ in range(60):
        batch = train[rng.choice(len(train), 64, replace=False)]
        kjt = KeyedJaggedTensor(["u", "i"], jnp.asarray(batch.T.ravel(), jnp.int32),
                                lengths=jnp.ones(128, jnp.int32))
        step(model, optimizer, kjt, jnp.asarray(batch[:, 1]))

    user_vectors = _tower(model, np.arange(users), "u")
    item_vectors = _tower(model, np.arange(items), "i")
    seen = np.full((users, items), -1)
    for u in range(users):
        row = train[train[:, 0] == u, 1]
        seen[u, :len(row)] = row
    _, top = top_k_retrieval(user_vectors, item_vectors, 10, exclude=seen, chunk_size=16)
    relevant = np.zeros((users, items), bool)
    relevant[test[:, 0], test[:, 1]] = True
    scores = np.full((users, items), -np.inf)
    for u in range(users):  # the retrieved order as scores: rank r -> 10 - r
        scores[u, np.asarray(top)[u]] = 10 - np.arange(10)
    recall = metrics.recall_at_k(scores, relevant, 10, exclude=seen_mask(seen, items))
    assert recall > 0.5, recall


def _tower(model, ids, feature):
    """One tower's outputs for ``ids`` (the other tower gets id 0, unused)."""
    keys = ["u", "i"] if feature == "u" else ["i", "u"]
    kjt = KeyedJaggedTensor(keys, jnp.asarray(np.concatenate([ids, ids * 0]), jnp.int32),
                            lengths=jnp.ones(2 * len(ids), jnp.int32))
    query, candidate = model.embed(kjt)
    return np.asarray(query if feature == "u" else candidate)


def seen_mask(seen, items):
    mask = np.zeros((len(seen), items), bool)
    rows, cols = np.nonzero(seen >= 0)
    mask[rows, seen[rows, cols]] = True
    return mask
