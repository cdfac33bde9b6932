"""Top-K retrieval metrics: Recall@K, NDCG@K, HitRate@K and MRR, exact, on the host.

Input: ``scores [Q, I]`` (a score per query and item, e.g. the dot products of the query
tower with every item) and ``relevant [Q, I]`` (bool: the held-out items of each query).
``exclude [Q, I]`` (bool, optional) removes items from a query's ranking altogether, e.g.
the items it interacted with in training, which a recommender must not be credited for
retrieving again. Each query's items are ranked by score, highest first; equal scores
rank by item index, lowest first (a fixed, documented order, so results never depend on
the sort). Queries with no relevant item left after ``exclude`` do not count; every
metric is the mean over the queries that do, in float64::

    # scores  [[.9, .1, .5, .3]]   -> ranking 0, 2, 3, 1
    # relevant [[F,  T,  T,  F]]   -> relevant at ranks 2 and 4 (1-based)
    # recall@2 = 1/2   hit_rate@2 = 1   mrr = 1/2
    # ndcg@2 = (1/log2(3)) / (1/log2(2) + 1/log2(3))

Definitions (binary relevance): Recall@K = relevant items in the top K / relevant items;
HitRate@K = 1 when any relevant item is in the top K; NDCG@K = sum over the top K of
``1 / log2(rank + 1)`` for each relevant item, divided by its best possible value
(``min(K, relevant items)`` hits at the top); MRR = ``1 / rank`` of the first relevant
item in the whole ranking.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def ranking_metrics(scores: ArrayLike, relevant: ArrayLike, k: int, *,
                    exclude: ArrayLike | None = None) -> dict[str, float]:
    """``{"recall@k", "ndcg@k", "hit_rate@k", "mrr"}`` (with ``k`` spelled out, e.g.
    ``"recall@10"``) of one ranking (module doc). ``mrr`` has no ``@k``: it ranks every
    item, while ``jaxrec train --task retrieval`` reports ``mrr@k``, which counts a first
    relevant item only within the top ``k`` (0 otherwise), since it retrieves only those."""
    ranks, counts = _relevant_ranks(scores, relevant, k, exclude)
    in_top = ranks <= k  # [Q, I]: relevant and ranked within the top k
    discounts = np.where(in_top, 1.0 / np.log2(ranks + 1.0), 0.0)
    ideal = np.cumsum(1.0 / np.log2(np.arange(2, k + 2)))[np.minimum(counts, k) - 1]
    first = np.min(ranks, axis=1)
    return {f"recall@{k}": float(np.mean(in_top.sum(1) / counts)),
            f"ndcg@{k}": float(np.mean(discounts.sum(1) / ideal)),
            f"hit_rate@{k}": float(np.mean(in_top.any(1))),
            "mrr": float(np.mean(1.0 / first))}


def recall_at_k(scores: ArrayLike, relevant: ArrayLike, k: int, *,
                exclude: ArrayLike | None = None) -> float:
    """Mean over queries of the share of their relevant items ranked in the top ``k``."""
    return ranking_metrics(scores, relevant, k, exclude=exclude)[f"recall@{k}"]


def ndcg_at_k(scores: ArrayLike, relevant: ArrayLike, k: int, *,
              exclude: ArrayLike | None = None) -> float:
    """Mean over queries of the normalised discounted cumulative gain of the top ``k``."""
    return ranking_metrics(scores, relevant, k, exclude=exclude)[f"ndcg@{k}"]


def hit_rate_at_k(scores: ArrayLike, relevant: ArrayLike, k: int, *,
                  exclude: ArrayLike | None = None) -> float:
    """Share of queries with at least one relevant item in the top ``k``."""
    return ranking_metrics(scores, relevant, k, exclude=exclude)[f"hit_rate@{k}"]


def mrr(scores: ArrayLike, relevant: ArrayLike, *, exclude: ArrayLike | None = None) -> float:
    """Mean over queries of ``1 / rank`` of their first relevant item."""
    return ranking_metrics(scores, relevant, 1, exclude=exclude)["mrr"]


def _relevant_ranks(scores, relevant, k, exclude) -> tuple[np.ndarray, np.ndarray]:
    """Per query and item, the 1-based rank of a relevant item (inf elsewhere), and the
    number of relevant items per query, for the queries that have any."""
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    scores = np.asarray(scores, np.float64)
    if scores.ndim != 2 or scores.shape[1] == 0:
        raise ValueError(f"scores must be [queries, items] with at least one item, got shape "
                         f"{scores.shape}")
    if np.isnan(scores).any():
        raise ValueError(f"scores holds {int(np.isnan(scores).sum())} NaN value(s); check the "
                         "model for divergence")
    relevant = _bool_matrix("relevant", relevant, scores.shape)
    keep = np.ones_like(relevant)
    if exclude is not None:
        keep = ~_bool_matrix("exclude", exclude, scores.shape)
    relevant = relevant & keep
    counts = relevant.sum(1)
    queries = counts > 0
    if not queries.any():
        raise ValueError("no query has a relevant item (after exclude): nothing to measure")
    scores, relevant, keep, counts = scores[queries], relevant[queries], keep[queries], counts[queries]
    # Sort keys, most significant last: kept before excluded (whose ranks never count),
    # then the score, highest first, then the item index.
    index = np.broadcast_to(np.arange(scores.shape[1]), scores.shape)
    order = np.lexsort((index, -scores, ~keep), axis=1)
    ranks = np.empty(order.shape, np.float64)
    np.put_along_axis(ranks, order, np.arange(1, scores.shape[1] + 1, dtype=np.float64)[None, :], axis=1)
    return np.where(relevant, ranks, np.inf), counts


def _bool_matrix(name: str, x, shape) -> np.ndarray:
    x = np.asarray(x)
    if x.shape != shape:
        raise ValueError(f"{name} must have the shape of scores {shape}, got {x.shape}")
    if x.dtype != np.bool_:
        if not np.isin(x, (0, 1)).all():
            raise ValueError(f"{name} must be boolean (or 0/1), got values other than 0 and 1")
        x = x.astype(bool)
    return x
