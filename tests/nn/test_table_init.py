"""Tables drawn in place (``merge_drawn_tables`` from ``IN_PLACE_BYTES`` on, how MLPerf-sized
tables fit one GPU) hold the same values as tables drawn whole and concatenated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrec.fused import FusedEmbeddingTables
from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig
from jaxrec.ops import TableLayout, init_weights, tbe_layout
from jaxrec.optim import RowWiseAdagrad


def _tables(dtype):
    # dims 8, 12, 4: tables start on multiples of 4 elements, so the in-place buffer is
    # written as rows of 4; odd row counts; a custom initialiser and custom bounds.
    return [
        EmbeddingBagConfig(name="t_a", num_embeddings=13, embedding_dim=8, feature_names=["a"], dtype=dtype),
        EmbeddingBagConfig(name="t_b", num_embeddings=7, embedding_dim=12, feature_names=["b"], dtype=dtype,
                           weight_init_min=-2.0, weight_init_max=3.0),
        EmbeddingBagConfig(name="t_c", num_embeddings=5, embedding_dim=4, feature_names=["c"], dtype=dtype,
                           init_fn=lambda key, shape, dt: jax.random.normal(key, shape, dt) * 5),
    ]


def _weights(dtype, optimizer):
    ebc = EmbeddingBagCollection(_tables(dtype), optimizer=optimizer, rngs=nnx.Rngs(3))
    return {k: np.asarray(v.astype(jnp.float32)) for k, v in ebc.split_embedding_weights().items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("optimizer", [None, RowWiseAdagrad(learning_rate=0.1)], ids=["plain", "fused"])
def test_collection_drawn_in_place_equals_drawn_whole(monkeypatch, dtype, optimizer):
    whole = _weights(dtype, optimizer)
    monkeypatch.setattr(tbe_layout, "IN_PLACE_BYTES", 0)
    in_place = _weights(dtype, optimizer)
    assert whole.keys() == in_place.keys()
    for name in whole:
        assert np.std(whole[name]) > 0.05, name  # drawn, not zeros
        np.testing.assert_array_equal(in_place[name], whole[name], err_msg=name)


def test_init_weights_drawn_in_place_equals_drawn_whole(monkeypatch):
    # offsets 0, 54, 62: written as rows of 2
    layout = TableLayout(rows=(9, 4, 6), dims=(6, 2, 10), feature_table_map=(0, 1, 2))
    whole = init_weights(jax.random.key(7), layout, jnp.float16)
    monkeypatch.setattr(tbe_layout, "IN_PLACE_BYTES", 0)
    in_place = init_weights(jax.random.key(7), layout, jnp.float16)
    assert in_place.dtype == whole.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(in_place), np.asarray(whole))
    for table, rows in zip(layout.split_embedding_weights(in_place), layout.rows):
        bound = np.sqrt(1.0 / rows)
        assert np.abs(np.asarray(table, np.float32)).max() <= bound * (1 + 1e-3)


def test_create_keeps_or_hands_over_the_given_weights():
    layout = TableLayout(rows=(5,), dims=(4,), feature_table_map=(0,))
    weights = jax.random.normal(jax.random.key(0), (20,))
    copied = FusedEmbeddingTables.create(layout, RowWiseAdagrad(learning_rate=0.1), weights=weights)
    assert copied.weights is not weights
    handed = FusedEmbeddingTables.create(layout, RowWiseAdagrad(learning_rate=0.1), weights=weights, copy=False)
    assert handed.weights is weights
