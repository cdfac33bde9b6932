"""The hash table of a dynamic vocabulary (jaxrec.ops.hash_table) against a Python dict
model of the same buckets and policy, written independently (the bucket function in
Python ints, one bucket and one id at a time): on random streams with repeats, new ids,
padding entries and evictions, the same slots, keys, scores, fresh slots and counts."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrec.ops import hash_table as ht

M32, M64 = (1 << 32) - 1, (1 << 64) - 1


def fmix(i: int, bits: int) -> int:
    if bits == 32:
        h = i & M32
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & M32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & M32
        return h ^ (h >> 16)
    h = i & M64
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & M64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & M64
    return h ^ (h >> 33)


class DictModel:
    """The table as a dict id -> slot plus per-slot arrays, updated one id at a time."""

    def __init__(self, num_buckets, size, policy, bits):
        self.nb, self.size, self.policy, self.bits = num_buckets, size, policy, bits
        self.slot_of = {}
        self.keys = np.zeros(num_buckets * size, np.int64)
        self.used = np.zeros(num_buckets * size, bool)
        self.scores = np.zeros(num_buckets * size, np.int64)

    def bucket(self, i):
        return fmix(i, self.bits) % self.nb

    def find_or_insert(self, ids, valid, step):
        counts = collections.Counter(int(i) for i, v in zip(ids, valid) if v)
        found = {i: self.slot_of[i] for i in counts if i in self.slot_of}
        hit = set(found.values())
        slot_for, fresh = dict(found), set()
        inserted = evicted = failed = 0
        missing = sorted((i for i in counts if i not in found), key=lambda i: (self.bucket(i), i))
        for b in sorted({self.bucket(i) for i in missing}):
            cells = range(b * self.size, (b + 1) * self.size)
            empty = [c for c in cells if not self.used[c]]
            old = [] if self.policy == "none" else sorted(
                (c for c in cells if self.used[c] and c not in hit), key=lambda c: (self.scores[c], c))
            candidates = empty + old
            for rank, i in enumerate(i for i in missing if self.bucket(i) == b):
                if rank >= len(candidates):
                    failed += 1
                    slot_for[i] = -1
                    continue
                c = candidates[rank]
                if self.used[c]:
                    evicted += 1
                    del self.slot_of[int(self.keys[c])]
                self.keys[c], self.used[c], self.slot_of[i] = i, True, c
                slot_for[i] = c
                fresh.add(c)
                inserted += 1
        for i, c in slot_for.items():
            if c >= 0:
                self.scores[c] = (self.scores[c] if i in found else 0) + counts[i] if self.policy == "lfu" else step
        slots = [slot_for[int(i)] if v else -1 for i, v in zip(ids, valid)]
        return np.asarray(slots), fresh, (inserted, evicted, failed)


def _jitted(policy):
    return jax.jit(functools.partial(ht.find_or_insert, policy=policy))


@pytest.mark.parametrize("policy", ht.POLICIES)
def test_find_or_insert_equals_the_dict_model(policy):
    rng = np.random.default_rng({"lru": 0, "lfu": 1, "none": 2}[policy])
    num_buckets, size, n = 6, 4, 20  # 24 slots for ~70 distinct ids: buckets overflow
    table = ht.create(num_buckets * size, bucket_size=size)
    model = DictModel(num_buckets, size, policy, 32)
    step_fn = _jitted(policy)
    universe = np.concatenate([rng.integers(-2**31, 2**31, 40), np.arange(-3, 27)]).astype(np.int32)
    totals = np.zeros(3, int)
    for step in range(40):
        hot = universe[: 8 + step]  # repeats of old ids, and new ones arriving
        ids = rng.choice(hot, size=n).astype(np.int32)
        valid = rng.random(n) > 0.15
        slots, table, info = step_fn(table, jnp.asarray(ids), step, valid=jnp.asarray(valid))
        want_slots, want_fresh, want_counts = model.find_or_insert(ids, valid, step)
        np.testing.assert_array_equal(np.asarray(slots), want_slots, err_msg=f"step {step}")
        used = np.asarray(table.used).ravel()
        np.testing.assert_array_equal(used, model.used)
        np.testing.assert_array_equal(np.asarray(table.keys).ravel()[used], model.keys[used])
        np.testing.assert_array_equal(np.asarray(table.scores).ravel()[used], model.scores[used])
        np.testing.assert_array_equal(np.flatnonzero(np.asarray(info.fresh)), sorted(want_fresh))
        got_counts = (int(info.inserted), int(info.evicted), int(info.failed))
        assert got_counts == want_counts, (step, got_counts, want_counts)
        totals += want_counts
        # every id holds its own slot: no two ids share one
        held = np.asarray(table.keys).ravel()[used]
        assert len(set(held.tolist())) == held.size
        np.testing.assert_array_equal(np.asarray(ht.find(table, jnp.asarray(ids))),
                                      [model.slot_of.get(int(i), -1) for i in ids])
    inserted, evicted, failed = totals
    assert inserted >= 24  # the stream filled the table
    if policy == "none":  # a full bucket refuses new ids
        assert evicted == 0 and failed > 0
    else:  # ... or evicts the least valuable id that this batch does not use
        assert evicted > 0


def test_int64_ids_equal_the_dict_model(x64):
    rng = np.random.default_rng(3)
    table = ht.create(32, bucket_size=8, dtype=jnp.int64)
    model = DictModel(4, 8, "lru", 64)
    universe = rng.integers(-2**63, 2**63 - 1, 60, dtype=np.int64)
    for step in range(12):
        ids = rng.choice(universe[: 10 + 4 * step], size=16)
        valid = np.ones(16, bool)
        slots, table, _ = ht.find_or_insert(table, jnp.asarray(ids), step)
        want, _, _ = model.find_or_insert(ids, valid, step)
        np.testing.assert_array_equal(np.asarray(slots), want)


def test_every_distinct_id_gets_its_own_slot_below_capacity():
    """100k distinct ids into 262,144 slots (buckets of 128, load 0.38): none evicted, none
    failed, and no two ids share a slot."""
    table = ht.create(1 << 18, bucket_size=128)
    ids = np.random.default_rng(4).permutation(np.arange(-50_000, 50_000, dtype=np.int32))
    step = jax.jit(functools.partial(ht.find_or_insert, policy="lru"))
    slots = []
    for i, chunk in enumerate(np.split(ids, 10)):
        s, table, info = step(table, jnp.asarray(chunk), i)
        assert int(info.inserted) == chunk.size and int(info.evicted) == int(info.failed) == 0
        slots.append(np.asarray(s))
    slots = np.concatenate(slots)
    assert slots.min() >= 0 and np.unique(slots).size == ids.size
    np.testing.assert_array_equal(np.asarray(ht.find(table, jnp.asarray(ids))), slots)
    assert int(ht.stats(table)["size"]) == ids.size


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="positive multiple of bucket_size=128"):
        ht.create(100)
    with pytest.raises(ValueError, match="int64 ids need jax_enable_x64"):
        ht.create(128, dtype=jnp.int64)
    table = ht.create(128)
    with pytest.raises(ValueError, match=r"ids must be a 1-D array of the table's dtype int32, got float32\[3\]"):
        ht.find(table, jnp.ones(3, jnp.float32))
    with pytest.raises(ValueError, match="policy must be one of"):
        ht.find_or_insert(table, jnp.ones(3, jnp.int32), 0, policy="fifo")
