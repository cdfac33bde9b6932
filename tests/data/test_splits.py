"""Ratings splits: disjoint, covering, deterministic by seed, and each its own rule."""

import numpy as np
import pytest

from jaxrec.data import MovieLensRatings, k_fold, leave_last_out, random_split, temporal_split


def ratings(n=157, users=23, seed=0):
    """Row r is identified by its rating field (r + 1, a float32-exact integer); timestamps
    repeat (ties) and users have 1..many ratings."""
    rng = np.random.default_rng(seed)
    u = rng.integers(0, users, n)
    u[-1] = users + 5  # a user with a single rating
    return MovieLensRatings(u.astype(np.int64), rng.integers(0, 40, n).astype(np.int64),
                            np.arange(1, n + 1, dtype=np.float32),
                            rng.integers(0, 30, n).astype(np.int64))


def rows(part):
    return part.ratings.astype(np.int64) - 1


def assert_partition(parts, n):
    got = np.concatenate([rows(p) for p in parts])
    assert len(got) == n and set(got.tolist()) == set(range(n))  # disjoint and covering
    for p in parts:
        assert (np.diff(rows(p)) > 0).all()  # file order within a part
        for field, whole in zip(p, ratings(n)):  # fields travel together
            np.testing.assert_array_equal(field, whole[rows(p)])


def test_random_split_sizes_partition_and_seed():
    r = ratings()
    parts = random_split(r, (0.8, 0.1, 0.1), seed=3)
    assert_partition(parts, len(r))
    assert [len(p) for p in parts] == [126, 15, 16]  # cumulative shares rounded
    again = random_split(r, (0.8, 0.1, 0.1), seed=3)
    assert all((rows(a) == rows(b)).all() for a, b in zip(parts, again))
    other = random_split(r, (0.8, 0.1, 0.1), seed=4)
    assert not (rows(parts[1]).tolist() == rows(other[1]).tolist())


@pytest.mark.parametrize("k", [2, 5, 7])
def test_k_fold_tests_partition_the_ratings(k):
    r = ratings()
    folds = k_fold(r, k, seed=1)
    assert len(folds) == k
    assert_partition([test for _, test in folds], len(r))
    for train, test in folds:
        assert_partition([train, test], len(r))
        assert abs(len(test) - len(r) / k) < 1
    assert [rows(t).tolist() for _, t in k_fold(r, k, seed=1)] == [rows(t).tolist() for _, t in folds]


@pytest.mark.parametrize("n", [1, 2])
def test_leave_last_out_takes_each_users_latest(n):
    r = ratings()
    train, test = leave_last_out(r, n)
    assert_partition([train, test], len(r))
    for user in np.unique(r.users):
        mine = np.flatnonzero(r.users == user)
        latest = sorted(mine, key=lambda i: (r.timestamps[i], i))[-n:]  # ties: the later line
        want = set(latest) if len(mine) > n else set()
        assert set(rows(test)[test.users == user].tolist()) == want
    assert set(test.users.tolist()) <= set(train.users.tolist())  # every test user is known


def test_temporal_split_puts_the_latest_ratings_in_test():
    r = ratings()
    train, test = temporal_split(r, 0.2)
    assert_partition([train, test], len(r))
    assert len(test) == round(0.2 * len(r))
    # every test rating is at least as late as every train rating; at equal times the
    # later line is the later rating
    key = lambda i: (r.timestamps[i], i)  # noqa: E731
    assert max(map(key, rows(train))) < min(map(key, rows(test)))


@pytest.mark.parametrize("call, message", [
    (lambda r: random_split(r, (0.8, 0.3)), "summing to 1"),
    (lambda r: random_split(r, (1.0,)), "two or more"),
    (lambda r: k_fold(r, 1), "k must be an int >= 2"),
    (lambda r: leave_last_out(r, 0), "n must be an int >= 1"),
    (lambda r: temporal_split(r, 1.0), r"test_fraction must lie in \(0, 1\)"),
    (lambda r: k_fold(MovieLensRatings(*(f[:3] for f in r)), 5), "3 ratings cannot make 5 parts"),
])
def test_bad_arguments_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call(ratings())
    with pytest.raises(TypeError, match="MovieLensRatings"):
        random_split([1, 2, 3])
