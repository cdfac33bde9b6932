"""Shared by tests/parallel: the tables, plans of every sharding type, random batches, a model.

Tables (odd sizes; t_item is shared by two features and MEAN-pooled; t_tiny has fewer
rows than there are devices, so ROW_WISE leaves some devices without rows)::

    t_user (37 x 8, SUM)   ["user"]          t_item (23 x 8, MEAN)  ["item", "last_item"]
    t_geo  (11 x 4, SUM)   ["geo"]           t_x    (50 x 8, MEAN)  ["x"]
    t_tiny ( 3 x 8, SUM)   ["tiny"]

Batches: 8 devices x 3 samples; lengths 0..3 (empty bags), ids from a few rows
(duplicates), the keys in another order than the tables' plus a key no table reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrec.data import Batch
from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig
from jaxrec.parallel import (
    column_wise,
    construct_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from jaxrec.sparse import KeyedJaggedTensor

N, B, LOCAL = 8, 3, 4  # devices, samples per device, devices per host
TABLES = [
    EmbeddingBagConfig(name="t_user", num_embeddings=37, embedding_dim=8, feature_names=["user"]),
    EmbeddingBagConfig(name="t_item", num_embeddings=23, embedding_dim=8,
                       feature_names=["item", "last_item"], pooling="MEAN"),
    EmbeddingBagConfig(name="t_geo", num_embeddings=11, embedding_dim=4, feature_names=["geo"]),
    EmbeddingBagConfig(name="t_x", num_embeddings=50, embedding_dim=8, feature_names=["x"],
                       pooling="MEAN"),
    EmbeddingBagConfig(name="t_tiny", num_embeddings=3, embedding_dim=8, feature_names=["tiny"]),
]
TOTAL_DIM = 8 + 8 + 8 + 4 + 8 + 8
KEYS = ["geo", "extra", "x", "item", "tiny", "user", "last_item"]
ROWS = {"user": 37, "item": 23, "last_item": 23, "geo": 11, "x": 50, "tiny": 3, "extra": 5}

# Every table of one type; "mixed" has every type at once.
PLANS = {
    "table_wise": lambda: {t.name: table_wise(i % N * 3 % N) for i, t in enumerate(TABLES)},
    "row_wise": lambda: {t.name: row_wise() for t in TABLES},
    "column_wise": lambda: {t.name: column_wise([i % N, (i + 5) % N]) for i, t in enumerate(TABLES)},
    "table_row_wise": lambda: {t.name: table_row_wise(i % 2) for i, t in enumerate(TABLES)},
    "data_parallel": lambda: {t.name: data_parallel() for t in TABLES},
    "mixed": lambda: {"t_user": table_wise(5), "t_item": row_wise(), "t_geo": column_wise([2, 6]),
                      "t_x": table_row_wise(1), "t_tiny": data_parallel()},
    # every type but COLUMN_WISE, for optimizers that read whole rows
    "rows": lambda: {"t_user": table_wise(5), "t_item": row_wise(), "t_geo": table_wise(5),
                     "t_x": table_row_wise(1), "t_tiny": data_parallel()},
}


def mesh(n: int = N, start: int = 0) -> jax.sharding.Mesh:
    return jax.make_mesh((n,), ("data",), devices=jax.devices("cpu")[start:start + n])


def plan(kind: str, n: int = N):
    local = LOCAL if n == N else n
    gens = PLANS[kind]()
    if n != N:  # re-aim the hand-written devices at a smaller mesh
        gens = {name: (row_wise() if kind != "data_parallel" else data_parallel()) for name in gens}
    return construct_plan(TABLES, gens, n, local_world_size=local)


# Room for the most ids a global batch can hold (7 keys x 24 samples x 3 ids = 504): every
# batch of random_batch has one shape, so an unsharded train step compiles once.
CAPACITY = 512


def random_kjt(rng, *, weighted: bool, n: int = N, empty_device: int | None = None,
               max_id: int = 6, one_hot: bool = False, spread: bool = False,
               capacity: int | None = None) -> KeyedJaggedTensor:
    """A global KJT of ``n * B`` samples; device ``empty_device``'s samples have no ids.
    ``spread``: ids from all of each table's rows (not the first ``max_id``); ``one_hot``:
    bags of 0 or 1 id; ``capacity``: the KJT's (default: the ids' bucket)."""
    lengths = rng.integers(0, 2 if one_hot else 4, size=(len(KEYS), n * B))
    lengths[:, rng.integers(0, n * B)] = 0
    if empty_device is not None:
        lengths[:, empty_device * B:(empty_device + 1) * B] = 0
    values = np.concatenate([rng.integers(0, ROWS[k] if spread else min(max_id, ROWS[k]),
                                          lengths[i].sum())
                             for i, k in enumerate(KEYS)])
    weights = rng.uniform(0.5, 2.0, values.shape[0]).astype(np.float32) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths.ravel(), weights=weights,
                                               capacity=capacity)


def random_batch(seed: int, *, weighted: bool, n: int = N, empty_device: int | None = None,
                 padded_rows: int = 0, one_hot: bool = False, max_id: int | None = None
                 ) -> Batch:
    """A global batch; the last ``padded_rows`` samples are padding (mask 0, no ids).
    One-hot ids spread over all rows, unless ``max_id`` keeps them to the first rows.
    Its KJT has capacity CAPACITY."""
    rng = np.random.default_rng(seed)
    kjt = random_kjt(rng, weighted=weighted, n=n, empty_device=empty_device, one_hot=one_hot,
                     spread=one_hot and max_id is None, max_id=max_id or 6, capacity=CAPACITY)
    if padded_rows:
        lengths = np.asarray(kjt.lengths()).reshape(len(KEYS), n * B)
        keep = np.ones_like(lengths, bool)
        keep[:, -padded_rows:] = False
        values = np.asarray(kjt.values())[:lengths.sum()]
        weights = None if not weighted else np.asarray(kjt.weights())[:lengths.sum()]
        per_bag = np.repeat(keep.ravel(), lengths.ravel())
        lengths = np.where(keep, lengths, 0)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            KEYS, values[per_bag], lengths.ravel(),
            weights=None if weights is None else weights[per_bag], capacity=CAPACITY)
    mask = np.ones(n * B, np.float32)
    if padded_rows:
        mask[-padded_rows:] = 0
    return Batch(jnp.asarray(rng.normal(size=(n * B, 2)), jnp.float32), kjt,
                 jnp.asarray(rng.normal(size=(n * B,)), jnp.float32), jnp.asarray(mask))


class Model(nnx.Module):
    """A collection and a linear head on [pooled, dense]. A learned scale multiplies the
    per-sample weights, so its gradient flows through the weights' gradient."""

    def __init__(self, ebc, *, rngs: nnx.Rngs):
        self.sparse_arch = ebc
        self.head = nnx.Linear(TOTAL_DIM + 2, 1, rngs=rngs)
        self.weight_scale = nnx.Param(jnp.ones(()))

    def __call__(self, dense, kjt):
        if kjt.weights_or_none() is not None:
            kjt = KeyedJaggedTensor(kjt.keys(), kjt.values(), lengths=kjt.lengths(),
                                    weights=kjt.weights() * self.weight_scale[...])
        x = jnp.concatenate([self.sparse_arch(kjt).values(), dense], axis=1)
        return self.head(x)[:, 0]


def build(optimizer) -> Model:
    return Model(EmbeddingBagCollection(TABLES, optimizer=optimizer, rngs=nnx.Rngs(0)),
                 rngs=nnx.Rngs(1))


def squared_error(model, batch, denominator):
    out = model(batch.dense, batch.sparse)
    return jnp.sum((out - batch.labels) ** 2 * batch.mask) / denominator
