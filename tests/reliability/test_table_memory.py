"""Tables that cannot fit are refused before anything is allocated."""

from __future__ import annotations

import time

import pytest
from flax import nnx

from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig
from jaxrec.nn._memory import check_fits, free_bytes
from jaxrec.optim import Adam


def test_a_table_of_raw_ids_is_refused_at_once():
    tables = [EmbeddingBagConfig(name="t_user", num_embeddings=1_500_000_000_000, embedding_dim=16,
                                 feature_names=["user"]),
              EmbeddingBagConfig(name="t_item", num_embeddings=37, embedding_dim=16,
                                 feature_names=["item"])]
    start = time.perf_counter()
    for optimizer in (None, Adam(learning_rate=0.1)):
        with pytest.raises(ValueError, match=r"collection 'ebc' needs .* GiB .* table 't_user' "
                                             r"alone takes .* Cap num_embeddings"):
            EmbeddingBagCollection(tables, optimizer=optimizer, rngs=nnx.Rngs(0))
    assert time.perf_counter() - start < 5


def test_the_check_counts_the_weights_the_drawing_and_the_state():
    check_fits("c", {"a": 40, "b": 10}, 20, 50, available=120)  # 50 + 50 + 20 fits exactly
    with pytest.raises(ValueError, match=r"table 'a' alone"):
        check_fits("c", {"a": 40, "b": 10}, 21, 50, available=120)
    assert free_bytes() is None or free_bytes() > 0


def test_large_groups_are_counted_once_plus_their_largest_table(monkeypatch):
    """From IN_PLACE_BYTES on a group is drawn into its buffer: weights + the largest table,
    not twice the weights; a small group is still counted twice."""
    from jaxrec.nn import _tables
    from jaxrec.ops import tbe_layout
    seen = []
    monkeypatch.setattr(_tables, "check_fits", lambda name, sizes, state, drawing: seen.append(drawing))
    tables = [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=n, embedding_dim=4, feature_names=[k])
              for k, n in (("a", 100), ("b", 30))]
    EmbeddingBagCollection(tables, rngs=nnx.Rngs(0))
    monkeypatch.setattr(tbe_layout, "IN_PLACE_BYTES", 0)
    EmbeddingBagCollection(tables, rngs=nnx.Rngs(0))
    assert seen == [130 * 16, 100 * 16]
