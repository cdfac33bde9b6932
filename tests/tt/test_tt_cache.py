"""TTCache (FBTT's LFU cache of decompressed rows) against Counter / numpy oracles.

The hash table's slot layout is an implementation detail: tests compare the multiset
of ``(key, count)`` pairs, never where a key sits.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrec.ops.tt_cache import (
    EMPTY,
    TTCache,
    cache_hit_rate,
    cache_lookup,
    cache_populate,
    count_ids,
    init_cache,
)

DIM = 5


def table_counts(cache: TTCache) -> dict[int, int]:
    """``{key: count}`` of the occupied slots; checks that no key sits in two slots."""
    keys, counts = np.asarray(cache.keys), np.asarray(cache.counts)
    used = keys != EMPTY
    assert len(np.unique(keys[used])) == used.sum(), "a key sits in two slots"
    assert (counts[~used] == 0).all()
    return dict(zip(keys[used].tolist(), counts[used].tolist()))


def top_ids(counter: collections.Counter, k: int) -> list[int]:
    """The ``k`` ids of highest count, ties to the smaller id, sorted ascending."""
    best = sorted((item for item in counter.items() if item[1] > 0), key=lambda kv: (-kv[1], kv[0]))
    return sorted(i for i, _ in best[:k])


def row_fn(ids):
    """A stand-in for TT decompression: a distinct, non-zero row per id (clamped, as told)."""
    safe = jnp.clip(ids, -(10**6), 10**6).astype(jnp.float32)
    return safe[:, None] * 0.5 + jnp.arange(1, DIM + 1, dtype=jnp.float32)


def row_fn_np(ids):
    return np.asarray(ids, np.float64)[:, None] * 0.5 + np.arange(1, DIM + 1)


def random_ids(rng, n, low=-50, high=600):
    """Ids with many duplicates, a few negative ones and a few near EMPTY."""
    ids = rng.integers(low, high, n)
    ids[rng.random(n) < 0.02] = EMPTY - 1 - rng.integers(0, 3)
    return ids.astype(np.int32)


@pytest.mark.parametrize("use_mask", [True, False])
def test_counts_equal_counter_over_successive_calls(use_mask):
    rng = np.random.default_rng(11)
    cache, expected = init_cache(8, 2048, DIM), collections.Counter()
    for n in (777, 1001, 13, 512):
        ids = random_ids(rng, n)
        valid = rng.random(n) < 0.8 if use_mask else np.ones(n, bool)
        cache = count_ids(cache, ids, valid if use_mask else None)
        expected.update(ids[valid].tolist())
        assert table_counts(cache) == dict(expected)


def test_invalid_positions_and_empty_are_not_counted():
    rng = np.random.default_rng(12)
    ids = np.concatenate([rng.integers(0, 10, 91), rng.integers(1000, 1100, 57), [EMPTY, EMPTY]])
    valid = np.concatenate([np.ones(91, bool), np.zeros(57, bool), [True, False]])
    perm = rng.permutation(ids.size)
    cache = count_ids(init_cache(4, 64, DIM), ids[perm].astype(np.int32), valid[perm])
    assert table_counts(cache) == dict(collections.Counter(ids[:91].tolist()))


def test_tiny_table_overflows_without_double_counting():
    rng = np.random.default_rng(13)
    cache, seen = init_cache(2, 8, DIM), collections.Counter()
    for call in range(3):
        ids = rng.integers(0, 50, 301).astype(np.int32)  # ~50 distinct ids, 8 slots
        valid = rng.random(301) < 0.9
        cache = count_ids(cache, ids, valid)
        seen.update(ids[valid].tolist())
        got = table_counts(cache)
        # 32 probes cover all 8 slots: the first call fills the table, and its 8 ids
        # are found (and counted) by every later call; the other ids are dropped.
        assert len(got) == 8
        if call == 0:
            first = set(got)
        assert set(got) == first
        assert got == {i: seen[i] for i in got}
        assert sum(got.values()) <= sum(seen.values())


def test_probe_bound_drops_ids_but_keeps_invariants():
    rng = np.random.default_rng(14)
    ids = rng.integers(-(2**30), 2**30, 4099).astype(np.int32)  # ~4k distinct ids, 1024 slots
    valid = rng.random(ids.size) < 0.7
    cache = count_ids(init_cache(16, 1024, DIM), ids, valid)
    got, seen = table_counts(cache), collections.Counter(ids[valid].tolist())
    assert 0 < len(got) <= 1024
    assert all(0 < c <= seen[i] for i, c in got.items())
    assert sum(got.values()) <= valid.sum()


def test_jit_matches_eager():
    rng = np.random.default_rng(15)
    cache = init_cache(16, 512, DIM)
    ids = random_ids(rng, 333, 0, 100)
    valid = rng.random(333) < 0.85

    def step(cache, ids, valid):
        cache = count_ids(cache, ids, valid)
        cache, source = cache_populate(cache, row_fn)
        return cache, source, cache_hit_rate(cache, ids, valid)

    eager, jitted = step(cache, ids, valid), jax.jit(step)(cache, ids, valid)
    for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(jitted)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(jax.tree_util.tree_leaves(cache)) == 4


def test_cache_lookup_hits_exactly_the_cached_ids():
    rng = np.random.default_rng(16)
    cached = np.sort(rng.choice(np.arange(-40, 500), 30, replace=False)).astype(np.int32)
    cache = init_cache(37, 64, DIM)
    cache = dataclasses.replace(cache, ids=jnp.asarray(np.concatenate([cached, np.full(7, EMPTY)]),
                                                       jnp.int32))
    queries = rng.integers(-60, 520, (5, 41)).astype(np.int32)
    queries[0, :10] = cached[:10]
    queries[1, :3] = EMPTY
    hit, location = cache_lookup(cache, queries)
    hit, location = np.asarray(hit), np.asarray(location)
    assert hit.shape == location.shape == queries.shape
    np.testing.assert_array_equal(hit, np.isin(queries, cached))
    assert ((location >= 0) & (location < 37)).all()
    np.testing.assert_array_equal(np.asarray(cache.ids)[location[hit]], queries[hit])
    assert hit.any() and not hit.all()


def skewed_ids(rng, n, offset=0):
    """Ids in [offset, offset + 800) with a power-law skew, so top ids are clear but ties exist."""
    p = 1.0 / np.arange(1, 801) ** 0.8
    return (rng.choice(800, n, p=p / p.sum()) * 7 % 800 + offset).astype(np.int32)


def test_populate_selects_top_ids_and_keeps_trained_rows():
    rng = np.random.default_rng(17)
    cache, seen = init_cache(50, 4096, DIM), collections.Counter()
    for n in (600, 901):
        ids, valid = skewed_ids(rng, n), rng.random(n) < 0.9
        cache = count_ids(cache, ids, valid)
        seen.update(ids[valid].tolist())

    old, source = cache_populate(cache, row_fn)
    want = top_ids(seen, 50)
    np.testing.assert_array_equal(np.asarray(old.ids), want)
    np.testing.assert_array_equal(np.asarray(source), -1)
    np.testing.assert_array_equal(np.asarray(old.rows), row_fn_np(want).astype(np.float32))
    assert table_counts(old) == {i: seen[i] for i in want}

    # "Train" the cached rows, then shift the distribution so part of the cache changes.
    trained = rng.standard_normal((50, DIM)).astype(np.float32)
    old = dataclasses.replace(old, rows=jnp.asarray(trained))
    table = collections.Counter({i: seen[i] for i in want})
    for n in (700, 455):
        ids = np.concatenate([skewed_ids(rng, n // 2), skewed_ids(rng, n - n // 2, offset=300)])
        valid = rng.random(n) < 0.9
        old = count_ids(old, ids, valid)
        table.update(ids[valid].tolist())

    new, source = cache_populate(old, row_fn)
    want = top_ids(table, 50)
    new_ids, source, rows = np.asarray(new.ids), np.asarray(source), np.asarray(new.rows)
    np.testing.assert_array_equal(new_ids, want)
    old_ids = np.asarray(old.ids)
    retained = np.isin(new_ids, old_ids)
    assert 0 < retained.sum() < 50, "the test should mix retained and new ids"
    np.testing.assert_array_equal(source[~retained], -1)
    np.testing.assert_array_equal(old_ids[source[retained]], new_ids[retained])
    np.testing.assert_array_equal(rows[retained], trained[source[retained]])  # bit-exact
    np.testing.assert_array_equal(rows[~retained], row_fn_np(new_ids[~retained]).astype(np.float32))
    assert table_counts(new) == {i: table[i] for i in want}


def test_populate_breaks_ties_by_smaller_id():
    ids = np.array([9, 4, 4, 7, 7, 2, 2, 8, 8, 3, 3, 3, 5], np.int32)  # 3 once more, then 2,4,7,8 tied
    cache = count_ids(init_cache(3, 32, DIM), ids)
    cache, _ = cache_populate(cache, row_fn)
    np.testing.assert_array_equal(np.asarray(cache.ids), [2, 3, 4])
    assert table_counts(cache) == {2: 2, 3: 3, 4: 2}


def test_populate_with_fewer_ids_than_cache_size():
    def noisy_row_fn(ids):  # garbage on EMPTY entries must not reach the cache
        return jnp.where((ids == EMPTY)[:, None], jnp.nan, row_fn(ids))

    cache = count_ids(init_cache(16, 64, DIM), np.array([3, 3, 9, -2, 3], np.int32))
    cache, source = cache_populate(cache, noisy_row_fn)
    ids, rows = np.asarray(cache.ids), np.asarray(cache.rows)
    np.testing.assert_array_equal(ids, [-2, 3, 9] + [EMPTY] * 13)
    np.testing.assert_array_equal(rows[:3], row_fn_np([-2, 3, 9]).astype(np.float32))
    np.testing.assert_array_equal(rows[3:], 0.0)
    np.testing.assert_array_equal(np.asarray(source), -1)
    assert table_counts(cache) == {-2: 1, 3: 3, 9: 1}

    again, source = cache_populate(cache, noisy_row_fn)  # nothing new counted: all kept
    np.testing.assert_array_equal(np.asarray(again.ids), ids)
    np.testing.assert_array_equal(np.asarray(again.rows), rows)
    np.testing.assert_array_equal(np.asarray(source), [0, 1, 2] + [-1] * 13)


def test_zipf_hit_rate():
    rng = np.random.default_rng(18)
    num_ids, exponent = 100_000, 1.2
    p = 1.0 / np.arange(1, num_ids + 1) ** exponent
    p /= p.sum()
    perm = rng.permutation(num_ids).astype(np.int32)  # hot ids scattered over the id space

    def batch(n):
        return perm[rng.choice(num_ids, n, p=p)], rng.random(n) < 0.9

    cache = init_cache(num_ids // 100, 1 << 15, 4)
    for _ in range(4):
        cache = count_ids(cache, *batch(8192))
    cache, _ = cache_populate(cache, lambda ids: jnp.zeros((ids.shape[0], 4), jnp.float32))
    ids, valid = batch(8192)
    rate = float(cache_hit_rate(cache, ids, valid))
    direct = np.isin(ids[valid], np.asarray(cache.ids)).mean()
    assert rate == pytest.approx(direct, abs=1e-6)
    assert rate > 0.5
    assert float(cache_hit_rate(cache, ids, np.zeros(ids.shape, bool))) == 0.0


@pytest.mark.parametrize("args, name", [
    ((0, 16, 4), "cache_size"),
    ((4.0, 16, 4), "cache_size"),
    ((True, 16, 4), "cache_size"),
    ((4, -16, 4), "hashtbl_size"),
    ((8, 7, 4), "hashtbl_size"),
    ((4, 16, 0), "dim"),
])
def test_init_cache_rejects_bad_sizes(args, name):
    with pytest.raises(ValueError, match=name):
        init_cache(*args)


def test_bad_arguments():
    cache = init_cache(4, 16, DIM)
    ids = np.arange(6, dtype=np.int32)
    with pytest.raises(TypeError, match="ids must be int32"):
        count_ids(cache, ids.astype(np.float32))
    with pytest.raises(ValueError, match="valid"):
        count_ids(cache, ids, np.ones(5, bool))
    with pytest.raises(ValueError, match="valid"):
        cache_hit_rate(cache, ids, np.ones(6, np.int32))
    with pytest.raises(TypeError, match="cache must be a TTCache"):
        cache_lookup((cache.keys, cache.ids), ids)
    with pytest.raises(ValueError, match="row_fn"):
        cache_populate(count_ids(cache, ids), lambda i: jnp.zeros((4, DIM + 1), jnp.float32))


def test_int64_ids_are_refused(x64):
    with pytest.raises(TypeError, match="astype"):
        count_ids(init_cache(4, 16, DIM), jnp.arange(6, dtype=jnp.int64))
