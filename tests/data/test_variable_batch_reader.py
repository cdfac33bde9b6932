"""A reader's variable batch per key (TorchRec's VBE): ``MovieLensReader(dedup_keys=...)``.

The deduplicated batch must mean the same as the plain one: each row's ids (expanded by
the inverse indices), the collections' output, and a fused training step (duplicate
users' gradients summed once per bag instead of once per row).
"""

import numpy as np
import optax
import pytest
from flax import nnx

from jaxrec.data import MOVIELENS_KEYS, MovieLensRatings, MovieLensReader
from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig, make_train_step
from jaxrec.optim import RowWiseAdagrad

BATCH = 32


def ratings(n=150, seed=0):
    rng = np.random.default_rng(seed)
    return MovieLensRatings(users=rng.integers(1, 12, n), items=rng.integers(1, 40, n),
                            ratings=rng.integers(1, 6, n).astype(np.float32),
                            timestamps=np.arange(n, dtype=np.int64))


def readers(**kwargs):
    data = ratings()
    return (MovieLensReader(data, batch_size=BATCH, shuffle_seed=3, **kwargs),
            MovieLensReader(data, batch_size=BATCH, shuffle_seed=3, dedup_keys=("user_id",), **kwargs))


def row_ids(kjt, key):
    """Each row's id of ``key`` (-1 for an empty bag), through the inverse indices if any."""
    k = list(kjt.keys()).index(key)
    lengths = np.asarray(kjt.lengths()).reshape(len(kjt.keys()), -1)
    starts = np.concatenate([[0], np.cumsum(lengths.reshape(-1))])[:-1].reshape(lengths.shape)
    values = np.asarray(kjt.values())
    bag_id = np.where(lengths[k] > 0, values[starts[k]], -1)
    inverse = kjt.inverse_indices_or_none()
    return bag_id[np.asarray(inverse[1])[k]] if inverse is not None else bag_id


@pytest.mark.parametrize("last_batch", ["pad", "drop"])
def test_rows_see_the_same_ids(last_batch):
    plain, dedup = readers(last_batch=last_batch)
    for a, b in zip(plain.one_pass(1), dedup.one_pass(1), strict=True):
        assert b.sparse.variable_stride_per_key() and b.sparse.stride_per_key() == [BATCH, BATCH]
        for key in MOVIELENS_KEYS:
            np.testing.assert_array_equal(row_ids(a.sparse, key), row_ids(b.sparse, key))
        users = row_ids(a.sparse, "user_id")[np.asarray(a.mask) > 0]
        lengths = np.asarray(b.sparse.lengths()).reshape(2, -1)
        assert lengths[0].sum() == len(set(users)) < len(users)  # one bag per distinct user
        np.testing.assert_array_equal(lengths[1], np.asarray(a.sparse.lengths()).reshape(2, -1)[1])
        np.testing.assert_array_equal(a.labels, b.labels)
        np.testing.assert_array_equal(a.mask, b.mask)


def model(seed=0):
    tables = [EmbeddingBagConfig(name=f"t_{key}", num_embeddings=n, embedding_dim=6, feature_names=[key])
              for key, n in zip(MOVIELENS_KEYS, (11, 39))]
    return EmbeddingBagCollection(tables, optimizer=RowWiseAdagrad(learning_rate=0.3), rngs=nnx.Rngs(seed))


def test_a_fused_step_on_the_deduplicated_batch_equals_the_plain_one():
    plain, dedup = readers()
    batches = list(zip(plain.one_pass(0), dedup.one_pass(0)))
    assert len(batches) >= 3 and np.asarray(batches[-1][0].mask).min() == 0  # a padded last batch

    class Scorer(nnx.Module):
        def __init__(self):
            self.ebc = model()
            self.w = nnx.Param(np.linspace(-1, 1, 12, dtype=np.float32).reshape(2, 6))

        def __call__(self, features):
            pooled = self.ebc(features).to_dict()
            return (pooled["user_id"] * self.w[0]).sum(1) + (pooled["item_id"] * self.w[1]).sum(1)

    def loss_fn(m, batch):
        err = (m(batch.sparse) - batch.labels) * batch.mask
        return (err ** 2).sum() / batch.mask.sum()

    results = []
    for which in (0, 1):
        m = Scorer()
        opt = nnx.Optimizer(m, optax.adam(0.05), wrt=nnx.Param)
        step = make_train_step(loss_fn)
        losses = [float(step(m, opt, pair[which])) for pair in batches]
        tables = [np.asarray(t) for t in m.ebc.split_embedding_weights().values()]
        results.append((losses, tables, np.asarray(m.w[...])))
    (loss_a, tables_a, w_a), (loss_b, tables_b, w_b) = results
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)
    for a, b in zip(tables_a, tables_b):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(w_a, w_b, rtol=1e-5, atol=1e-6)
    assert np.abs(tables_a[0] - np.asarray(model().split_embedding_weights()['t_user_id'])).max() > 1e-2  # trained


def test_unknown_dedup_keys_are_named():
    with pytest.raises(ValueError, match=r"dedup_keys=\['user'\] names \['user'\].*'user_id', 'item_id'"):
        MovieLensReader(ratings(), batch_size=BATCH, dedup_keys=("user",))
