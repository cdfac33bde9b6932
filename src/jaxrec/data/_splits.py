"""Splits of a ratings set into train / validation / test: random, k-fold, per-user
leave-last-out and temporal. Each returns ``MovieLensRatings`` parts that are disjoint and
together hold every rating once, in file order within each part.

- ``random_split(r, (0.8, 0.1, 0.1), seed)``: a permutation by seed, cut by the fractions
  (each part's size rounds its cumulative share; the same seed gives the same parts).
- ``k_fold(r, k, seed)``: ``k`` ``(train, test)`` pairs whose tests partition the ratings.
- ``leave_last_out(r, n=1)``: each user's ``n`` latest ratings (by timestamp; a tie goes
  by file order, the later line being the later rating) are the test part; a user with
  ``n`` ratings or fewer stays in train whole, so no user is unknown at training time.
- ``temporal_split(r, test_fraction)``: the latest ratings of all users are the test part
  (by timestamp, ties by file order): the past predicts the future.

ML-100K's own ``u1..u5`` / ``ua``/``ub`` files: ``movielens_100k_split``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxrec.data._movielens import MovieLensRatings


def random_split(ratings: MovieLensRatings, fractions: Sequence[float] = (0.8, 0.2), *,
                 seed: int = 0) -> tuple[MovieLensRatings, ...]:
    """Parts of ``ratings`` of the given ``fractions`` (summing to 1), drawn by ``seed``."""
    fractions = np.asarray(fractions, np.float64)
    if fractions.ndim != 1 or len(fractions) < 2 or (fractions <= 0).any() or not np.isclose(
            fractions.sum(), 1.0):
        raise ValueError(f"fractions must be two or more positive shares summing to 1, got "
                         f"{fractions.tolist()}")
    n = _check(ratings, len(fractions))
    order = np.random.default_rng(seed).permutation(n)
    cuts = np.round(np.cumsum(fractions)[:-1] * n).astype(np.int64)
    return tuple(_take(ratings, part) for part in np.split(order, cuts))


def k_fold(ratings: MovieLensRatings, k: int = 5, *,
           seed: int = 0) -> list[tuple[MovieLensRatings, MovieLensRatings]]:
    """``k`` ``(train, test)`` pairs; the tests partition the ratings into near-equal folds."""
    if not isinstance(k, (int, np.integer)) or k < 2:
        raise ValueError(f"k must be an int >= 2, got {k!r}")
    n = _check(ratings, k)
    folds = np.array_split(np.random.default_rng(seed).permutation(n), k)
    return [(_take(ratings, np.concatenate(folds[:i] + folds[i + 1:])), _take(ratings, fold))
            for i, fold in enumerate(folds)]


def leave_last_out(ratings: MovieLensRatings, n: int = 1) -> tuple[MovieLensRatings, MovieLensRatings]:
    """``(train, test)``: each user's ``n`` latest ratings in test (module doc)."""
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    size = _check(ratings, 1)
    # By user, then time, then line: each user's ratings end with its latest.
    order = np.lexsort((np.arange(size), ratings.timestamps, ratings.users))
    users = ratings.users[order]
    change = users[1:] != users[:-1]  # a new user starts after this position
    group = np.cumsum(np.r_[True, change]) - 1  # the user's group per position
    ends = np.flatnonzero(np.r_[change, True])  # each group's last position
    from_end = ends[group] - np.arange(size)  # 0 for a user's latest rating, 1 before it, ...
    count = np.diff(np.r_[-1, ends])  # ratings per user
    test = (from_end < n) & (count[group] > n)
    return _take(ratings, order[~test]), _take(ratings, order[test])


def temporal_split(ratings: MovieLensRatings,
                   test_fraction: float = 0.2) -> tuple[MovieLensRatings, MovieLensRatings]:
    """``(train, test)``: the latest ``test_fraction`` of the ratings in test (module doc)."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction!r}")
    n = _check(ratings, 2)
    order = np.lexsort((np.arange(n), ratings.timestamps))
    cut = n - max(int(round(test_fraction * n)), 1)
    return _take(ratings, order[:cut]), _take(ratings, order[cut:])


def _check(ratings: MovieLensRatings, parts: int) -> int:
    if not isinstance(ratings, MovieLensRatings):
        raise TypeError(f"ratings must be a MovieLensRatings (load_movielens_ratings), got "
                        f"{type(ratings).__name__}")
    n = len(ratings)
    if n < parts:
        raise ValueError(f"{n} ratings cannot make {parts} parts")
    return n


def _take(ratings: MovieLensRatings, rows: np.ndarray) -> MovieLensRatings:
    rows = np.sort(rows)  # file order within a part
    return MovieLensRatings(*(field[rows] for field in ratings))
