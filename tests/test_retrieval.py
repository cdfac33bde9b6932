"""top_k_retrieval against NumPy's full sort, and against jaxrec.metrics' ranking order."""

import numpy as np
import pytest

from jaxrec import metrics
from jaxrec.ops import top_k_retrieval


def numpy_top_k(queries, items, k, exclude=None):
    """Full scores in float64, excluded ids dropped, sorted by (-score, id)."""
    scores = np.asarray(queries, np.float64) @ np.asarray(items, np.float64).T
    out_s = np.full((len(scores), k), -np.inf)
    out_i = np.full((len(scores), k), -1)
    for q, row in enumerate(scores):
        banned = set() if exclude is None else {int(e) for e in exclude[q] if e >= 0}
        order = sorted((i for i in range(len(row)) if i not in banned), key=lambda i: (-row[i], i))[:k]
        out_s[q, :len(order)], out_i[q, :len(order)] = row[order], order
    return out_s, out_i


def data(seed, queries=7, items=53, dim=6):
    rng = np.random.default_rng(seed)
    # Small integers: exact float32 dot products, and many ties between items.
    return (rng.integers(-2, 3, size=(queries, dim)).astype(np.float32),
            rng.integers(-2, 3, size=(items, dim)).astype(np.float32))


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 53, 1000])
@pytest.mark.parametrize("k", [1, 4, 17, 53])
def test_chunked_top_k_equals_a_full_sort(chunk_size, k):
    q, items = data(k * 31 + chunk_size)
    scores, ids = top_k_retrieval(q, items, k, chunk_size=chunk_size)
    want_s, want_i = numpy_top_k(q, items, k)
    np.testing.assert_array_equal(np.asarray(ids), want_i)  # ties by id, lowest first
    np.testing.assert_array_equal(np.asarray(scores), want_s.astype(np.float32))


@pytest.mark.parametrize("chunk_size", [4, 53])
def test_excluded_ids_are_never_returned(chunk_size):
    q, items = data(5)
    rng = np.random.default_rng(6)
    exclude = np.full((len(q), 9), -1)
    for r in range(len(q)):
        seen = rng.choice(len(items), size=rng.integers(0, 9), replace=False)
        exclude[r, :len(seen)] = seen
    exclude[0, :] = np.arange(9)  # a full row
    scores, ids = top_k_retrieval(q, items, 10, exclude=exclude, chunk_size=chunk_size)
    want_s, want_i = numpy_top_k(q, items, 10, exclude)
    np.testing.assert_array_equal(np.asarray(ids), want_i)
    np.testing.assert_array_equal(np.asarray(scores), want_s.astype(np.float32))


def test_slots_past_the_items_left_are_empty():
    q, items = data(8, items=6)
    scores, ids = top_k_retrieval(q, items, 6, exclude=np.tile(np.arange(4), (len(q), 1)), chunk_size=4)
    assert (np.asarray(ids)[:, 2:] == -1).all() and np.isneginf(np.asarray(scores)[:, 2:]).all()
    assert set(np.asarray(ids)[0, :2]) == {4, 5}


def test_the_order_is_the_one_ranking_metrics_credits():
    q, items = data(9)
    _, ids = top_k_retrieval(q, items, 5, chunk_size=8)
    relevant = np.zeros((len(q), len(items)), bool)
    relevant[np.arange(len(q)), np.asarray(ids)[:, 0]] = True  # each query's first result
    got = metrics.ranking_metrics(q @ items.T, relevant, 1)
    assert got["mrr"] == 1.0 and got["recall@1"] == 1.0


def test_approximate_mode_finds_the_top_items_without_ties():
    rng = np.random.default_rng(10)
    q, items = rng.normal(size=(5, 8)).astype(np.float32), rng.normal(size=(300, 8)).astype(np.float32)
    _, ids = top_k_retrieval(q, items, 10, chunk_size=64, approximate=True, recall_target=0.99)
    _, want = numpy_top_k(q, items, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(np.asarray(ids), want)])
    assert recall >= 0.9


@pytest.mark.parametrize("kwargs, message", [
    (dict(k=0), r"k must be an int in \[1, 53\]"),
    (dict(k=54), r"k must be an int in \[1, 53\]"),
    (dict(k=2, chunk_size=0), "chunk_size must be an int >= 1"),
    (dict(k=2, exclude=np.zeros((3, 2), np.int32)), r"exclude must be integer ids \[Q = 7, E\]"),
    (dict(k=2, exclude=np.zeros((7, 2), np.float32)), "exclude must be integer ids"),
])
def test_bad_arguments_are_refused(kwargs, message):
    q, items = data(1)
    with pytest.raises(ValueError, match=message):
        top_k_retrieval(q, items, **kwargs)
    with pytest.raises(ValueError, match="one D"):
        top_k_retrieval(q, items[:, :3], 2)
