"""Top-K retrieval metrics against a per-query reference written with Python loops."""

import math

import numpy as np
import pytest

from jaxrec import metrics


def reference(scores, relevant, k, exclude=None):
    """Each query ranked by a Python sort on (-score, item), excluded items dropped."""
    out = {"recall": [], "ndcg": [], "hit": [], "mrr": []}
    for q in range(len(scores)):
        items = [i for i in range(len(scores[q])) if exclude is None or not exclude[q][i]]
        ranking = sorted(items, key=lambda i: (-float(scores[q][i]), i))
        wanted = {i for i in items if relevant[q][i]}
        if not wanted:
            continue
        top = ranking[:k]
        hits = [i for i in top if i in wanted]
        out["recall"].append(len(hits) / len(wanted))
        out["hit"].append(1.0 if hits else 0.0)
        dcg = sum(1 / math.log2(r + 2) for r, i in enumerate(top) if i in wanted)
        idcg = sum(1 / math.log2(r + 2) for r in range(min(k, len(wanted))))
        out["ndcg"].append(dcg / idcg)
        first = next(r for r, i in enumerate(ranking) if i in wanted)
        out["mrr"].append(1 / (first + 1))
    return {f"recall@{k}": np.mean(out["recall"]), f"ndcg@{k}": np.mean(out["ndcg"]),
            f"hit_rate@{k}": np.mean(out["hit"]), "mrr": np.mean(out["mrr"])}


def test_the_worked_example_of_the_module_doc():
    got = metrics.ranking_metrics([[0.9, 0.1, 0.5, 0.3]], [[False, True, True, False]], 2)
    assert got["recall@2"] == 0.5 and got["hit_rate@2"] == 1.0 and got["mrr"] == 0.5
    assert got["ndcg@2"] == pytest.approx((1 / math.log2(3)) / (1 + 1 / math.log2(3)))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 3, 10, 40])
def test_random_rankings_equal_the_reference(seed, k):
    rng = np.random.default_rng(seed)
    queries, items = 13, 29
    # Rounded scores: many ties, which rank by item index.
    scores = np.round(rng.normal(size=(queries, items)), 1)
    relevant = rng.random((queries, items)) < rng.uniform(0.02, 0.3, size=(queries, 1))
    relevant[0] = False  # a query with nothing relevant does not count
    relevant[1, :] = True  # one where everything is
    exclude = rng.random((queries, items)) < 0.2
    for ex in (None, exclude):
        got = metrics.ranking_metrics(scores, relevant, k, exclude=ex)
        want = reference(scores, relevant, k, ex)
        assert got.keys() == want.keys()
        for name in got:
            assert got[name] == pytest.approx(want[name], rel=1e-12), name
        assert metrics.recall_at_k(scores, relevant, k, exclude=ex) == got[f"recall@{k}"]
        assert metrics.ndcg_at_k(scores, relevant, k, exclude=ex) == got[f"ndcg@{k}"]
        assert metrics.hit_rate_at_k(scores, relevant, k, exclude=ex) == got[f"hit_rate@{k}"]
        assert metrics.mrr(scores, relevant, exclude=ex) == got["mrr"]


def test_excluded_items_never_count_and_never_push_kept_items_down():
    scores = np.array([[5.0, -np.inf, 4.0, 3.0]])
    relevant = np.array([[False, True, False, True]])
    exclude = np.array([[True, False, False, False]])  # item 0 (score 5) was seen in training
    got = metrics.ranking_metrics(scores, relevant, 2, exclude=exclude)
    # kept ranking: 2, 3, 1 (the -inf item is still ranked, after every finite score)
    assert got["recall@2"] == 0.5 and got["mrr"] == 0.5
    assert got == metrics.ranking_metrics(scores[:, 1:], relevant[:, 1:], 2)


def test_a_perfect_ranking_scores_one_and_a_reversed_one_scores_low():
    rng = np.random.default_rng(3)
    relevant = rng.random((8, 50)) < 0.1
    relevant[:, 0] = True
    perfect = metrics.ranking_metrics(relevant.astype(float), relevant, 5)
    assert perfect["ndcg@5"] == 1.0 and perfect["mrr"] == 1.0 and perfect["hit_rate@5"] == 1.0
    reversed_ = metrics.ranking_metrics(-relevant.astype(float), relevant, 5)
    assert reversed_["hit_rate@5"] == 0.0 and reversed_["ndcg@5"] == 0.0


@pytest.mark.parametrize("args, message", [
    (([[1.0, 2.0]], [[True]], 1), r"relevant must have the shape of scores \(1, 2\)"),
    (([1.0, 2.0], [True, False], 1), "scores must be \\[queries, items\\]"),
    (([[1.0, np.nan]], [[True, False]], 1), "1 NaN value"),
    (([[1.0, 2.0]], [[2, 0]], 1), "relevant must be boolean"),
    (([[1.0, 2.0]], [[False, False]], 1), "no query has a relevant item"),
    (([[1.0, 2.0]], [[True, False]], 0), "k must be an int >= 1, got 0"),
    (([[1.0, 2.0]], [[True, False]], 1.5), "k must be an int >= 1, got 1.5"),
])
def test_bad_input_is_refused_by_name(args, message):
    with pytest.raises(ValueError, match=message):
        metrics.ranking_metrics(*args)
    with pytest.raises(ValueError, match="exclude must have the shape"):
        metrics.ranking_metrics([[1.0, 2.0]], [[True, False]], 1, exclude=[[True]])
