"""The hash table of a dynamic vocabulary (jaxrec.ops.hash_table) against a Python dict
model of the same buckets and policy (hash_table_testing.py): on random streams with
repeats, new ids, padding entries and evictions, the same slots, keys, digests, scores,
fresh slots and counts; for the handlers (C++ on CPU, CUDA on the GPU) and the jnp
reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hash_table_testing import DictModel, fmix, unfmix

from jaxrec.ops import hash_table as ht


def _jitted(policy, backend="auto"):
    return jax.jit(functools.partial(ht.find_or_insert, policy=policy, backend=backend))


@pytest.mark.parametrize("backend", ["kernel", "reference"])
@pytest.mark.parametrize("policy,prefetch", [(p, False) for p in ht.POLICIES] + [("lru", True), ("lfu", True)])
@pytest.mark.parametrize("num_buckets,size", [(6, 4), (2, 16)], ids=["4-slot-buckets", "16-slot-buckets"])
def test_find_or_insert_equals_the_dict_model(platform, backend, policy, prefetch, num_buckets, size):
    """``prefetch``: odd calls place a second batch at the step of the call before, keeping
    (``keep_seen``) the slots that call saw. 24 or 32 slots for up to 47 distinct ids: buckets
    overflow. (Buckets of a multiple of 16 slots take the handlers' 16-digest loads.)"""
    rng = np.random.default_rng({"lru": 0, "lfu": 1, "none": 2}[policy] + 10 * prefetch)
    n = 20
    table = ht.create(num_buckets * size, bucket_size=size)
    model = DictModel(num_buckets, size, policy, 32)
    step_fn = _jitted(policy, backend)
    keeping = jax.jit(functools.partial(ht.find_or_insert, policy=policy, backend=backend, keep_seen=True))
    universe = np.concatenate([rng.integers(-2**31, 2**31, 40), np.arange(-3, 27)]).astype(np.int32)
    totals = np.zeros(3, int)
    in_flight = {}  # the slots of the call before: {id: slot}
    for call in range(80 if prefetch else 40):
        step, keep = (call // 2, call % 2 == 1) if prefetch else (call, False)
        hot = universe[: 8 + step]  # repeats of old ids, and new ones arriving
        ids = rng.choice(hot, size=n).astype(np.int32)
        valid = rng.random(n) > 0.15
        slots, table, info = (keeping if keep else step_fn)(table, jnp.asarray(ids), step, valid=jnp.asarray(valid))
        want_slots, want_fresh, want_counts = model.find_or_insert(ids, valid, step, keep_seen=keep)
        if keep:  # the batch before (in flight) keeps every slot it had
            assert all(model.slot_of.get(i) == c for i, c in in_flight.items()), step
        in_flight = {int(i): int(c) for i, c in zip(ids, want_slots) if c >= 0}
        np.testing.assert_array_equal(np.asarray(slots), want_slots, err_msg=f"step {step}")
        used = np.asarray(table.used).ravel()
        np.testing.assert_array_equal(used, model.used)
        np.testing.assert_array_equal(np.asarray(table.keys).ravel()[used], model.keys[used])
        np.testing.assert_array_equal(np.asarray(table.digests).ravel(), model.digests)
        np.testing.assert_array_equal(np.asarray(table.scores).ravel()[used], model.scores[used])
        np.testing.assert_array_equal(np.asarray(table.seen).ravel()[used], model.seen[used])
        since = max(step - 3, 0)  # the ids seen in the last steps, as a serving copy would ask
        ids_changed, slots_changed = ht.changed_since(table, since)
        want = np.flatnonzero(model.used & (model.seen >= since))
        np.testing.assert_array_equal(slots_changed, want)
        np.testing.assert_array_equal(ids_changed, model.keys[want])
        fresh = np.asarray(info.fresh_slots)
        np.testing.assert_array_equal(np.sort(fresh[fresh < table.capacity]), sorted(want_fresh))
        got_counts = (int(info.inserted[0]), int(info.evicted[0]), int(info.failed[0]))
        assert got_counts == want_counts, (step, got_counts, want_counts)
        totals += want_counts
        # every id holds its own slot: no two ids share one
        held = np.asarray(table.keys).ravel()[used]
        assert len(set(held.tolist())) == held.size
        np.testing.assert_array_equal(np.asarray(ht.find(table, jnp.asarray(ids), backend=backend)),
                                      [model.slot_of.get(int(i), -1) for i in ids])
    inserted, evicted, failed = totals
    assert inserted >= num_buckets * size  # the stream filled the table
    if policy == "none":  # a full bucket refuses new ids
        assert evicted == 0 and failed > 0
    else:  # ... or evicts the least valuable id that this batch does not use
        assert evicted > 0


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_int64_ids_equal_the_dict_model(x64, platform, backend):
    rng = np.random.default_rng(3)
    table = ht.create(40, bucket_size=8, dtype=jnp.int64)
    model = DictModel(5, 8, "lfu", 64)
    universe = np.concatenate([rng.integers(-2**63, 2**63 - 1, 60, dtype=np.int64), [-1, 0, 2**63 - 1]])
    for step in range(12):
        ids = rng.choice(universe[: 10 + 4 * step], size=16)
        valid = np.ones(16, bool)
        slots, table, _ = ht.find_or_insert(table, jnp.asarray(ids), step, policy="lfu", backend=backend)
        want, _, _ = model.find_or_insert(ids, valid, step)
        np.testing.assert_array_equal(np.asarray(slots), want)
        np.testing.assert_array_equal(np.asarray(table.digests).ravel(), model.digests)
        np.testing.assert_array_equal(np.asarray(table.scores).ravel()[model.used], model.scores[model.used])
        np.testing.assert_array_equal(np.asarray(ht.find(table, jnp.asarray(ids), backend=backend)), want)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_ids_whose_hashes_share_their_high_bits_equal_the_dict_model(x64, platform, dtype):
    """The CUDA handler sorts a batch by 32-bit keys (the range in the high bits, then the
    hash's high bits) and then orders each group of equal keys and unequal hashes by hash.
    Ids built from chosen hashes make such groups: of two (hashes that differ in their low
    bits), of three, one of 3000 ids (int64: the high 32 bits shared), and a group whose id
    comes 2000 times. One range (against the dict model) and three (against the jnp
    reference)."""
    bits = 32 if dtype == "int32" else 64
    rng = np.random.default_rng(11)
    sizes = [2] * 40 if bits == 32 else [2] * 30 + [3] * 10 + [3000]
    hashes = []
    for size in sizes + [2]:  # the last: the hot id's
        if bits == 32:  # the key holds bits 1 ... 31 of the hash
            high = int(rng.integers(0, 2**31)) << 1
            hashes.append([high, high | 1])
        else:  # the key holds bits 33 ... 63
            high = int(rng.integers(0, 2**32)) << 32
            hashes.append([high | int(low) for low in rng.choice(2**32, size, replace=False)])
    ids = np.array([unfmix(h, bits) for group in hashes for h in group], dtype)
    assert [fmix(int(i), bits) for i in ids] == [h for group in hashes for h in group]
    hot = ids[-1]
    table, model = ht.create(64 * 16, bucket_size=16, dtype=dtype), DictModel(64, 16, "lru", bits)
    ranged = ht.create(3 * 64 * 16, bucket_size=16, dtype=dtype)
    reference = ranged
    ranges = tuple(ht.Range(64 * t, 64, 64) for t in range(3))
    for step in range(3):
        batch = rng.permutation(np.concatenate([rng.choice(ids, int(0.8 * ids.size), replace=False),
                                                np.full(2000, hot, dtype), rng.choice(ids, 300)]))
        valid = rng.random(batch.size) > 0.05
        slots, table, info = ht.find_or_insert(table, jnp.asarray(batch), step, policy="lru",
                                               valid=jnp.asarray(valid))
        want_slots, _, want_counts = model.find_or_insert(batch, valid, step)
        np.testing.assert_array_equal(np.asarray(slots), want_slots, err_msg=f"step {step}")
        assert (int(info.inserted[0]), int(info.evicted[0]), int(info.failed[0])) == want_counts
        used = np.asarray(table.used).ravel()
        np.testing.assert_array_equal(used, model.used)
        np.testing.assert_array_equal(np.asarray(table.keys).ravel()[used], model.keys[used])
        np.testing.assert_array_equal(np.asarray(table.digests).ravel(), model.digests)
        np.testing.assert_array_equal(np.asarray(table.scores).ravel()[used], model.scores[used])

        table_of = jnp.asarray(rng.integers(-1, 3, batch.size).astype(np.int32))
        got = ht.find_or_insert(ranged, jnp.asarray(batch), step, valid=jnp.asarray(valid), table_of=table_of,
                                ranges=ranges)
        want = ht.find_or_insert(reference, jnp.asarray(batch), step, valid=jnp.asarray(valid), table_of=table_of,
                                 ranges=ranges, backend="reference")
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"step {step}")
        ranged, reference = got[1], want[1]
    if bits == 64:  # the group of 3000 overflows its bucket of 16 slots
        assert want_counts[2] > 2000


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_buckets_and_digests_equal_the_dict_model(x64, dtype):
    """The jnp bucket (32-bit multiply-high without int64 for int32 ids) against Python ints."""
    bits = 32 if dtype == "int32" else 64
    info = np.iinfo(dtype)
    ids = np.concatenate([np.random.default_rng(5).integers(info.min, info.max, 2000, dtype=dtype),
                          np.array([info.min, -1, 0, 1, info.max], dtype)])
    for num_buckets in (1, 7, 1000, 2**24 + 3, 2**31 // 128):
        model = DictModel(num_buckets, 1, "lru", bits)
        np.testing.assert_array_equal(np.asarray(ht.bucket_of(jnp.asarray(ids), num_buckets)),
                                      [model.bucket(int(i)) for i in ids])


def test_every_distinct_id_gets_its_own_slot_below_capacity(platform):
    """100k distinct ids into 262,144 slots (buckets of 128, load 0.38): none evicted, none
    failed, and no two ids share a slot. (benchmarks/hash_table_gpu.py checks 10M ids.)"""
    table = ht.create(1 << 18, bucket_size=128)
    ids = np.random.default_rng(4).permutation(np.arange(-50_000, 50_000, dtype=np.int32))
    step = jax.jit(functools.partial(ht.find_or_insert, policy="lru"))
    slots = []
    for i, chunk in enumerate(np.split(ids, 10)):
        s, table, info = step(table, jnp.asarray(chunk), i)
        assert int(info.inserted[0]) == chunk.size and int(info.evicted[0]) == int(info.failed[0]) == 0
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
    with pytest.raises(ValueError, match=r"bucket_size must lie in \[1, 1024\], got 2048"):
        ht.create(4096, bucket_size=2048)
    with pytest.raises(ValueError, match="num_buckets=6 must be a multiple of shards=4"):
        ht.shard_of(jnp.ones(3, jnp.int32), 6, 4)
    with pytest.raises(ValueError, match="policy must be one of"):
        ht.find_or_insert(table, jnp.ones(3, jnp.int32), 0, policy="fifo")


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_a_table_split_into_bucket_ranges_places_ids_as_the_whole_table(platform, backend):
    """Three shards of a 9-bucket table, each fed the ids of its range (shard_of), hold what
    the whole table holds, slot for slot (a sharded dynamic table's equality)."""
    rng = np.random.default_rng(6)
    shards, num_buckets, size, n = 3, 9, 4, 24
    whole = ht.create(num_buckets * size, bucket_size=size)
    parts = [ht.create(num_buckets * size // shards, bucket_size=size) for _ in range(shards)]
    part = (ht.Range(0, num_buckets // shards, num_buckets),)  # a third of a 9-bucket table
    universe = rng.integers(-2**31, 2**31, 90).astype(np.int32)
    for step in range(10):
        ids = rng.choice(universe[: 20 + 7 * step], size=n).astype(np.int32)
        valid = rng.random(n) > 0.1
        slots, whole, _ = ht.find_or_insert(whole, jnp.asarray(ids), step, valid=jnp.asarray(valid),
                                            backend=backend)
        owner = np.asarray(ht.shard_of(jnp.asarray(ids), num_buckets, shards))
        want = np.full(n, -1)
        for d in range(shards):
            mine = valid & (owner == d)
            local, parts[d], _ = ht.find_or_insert(parts[d], jnp.asarray(ids), step, valid=jnp.asarray(mine),
                                                   ranges=part, backend=backend)
            local = np.asarray(local)
            want[mine] = np.where(local[mine] >= 0, local[mine] + d * whole.capacity // shards, -1)
            np.testing.assert_array_equal(
                np.asarray(ht.find(parts[d], jnp.asarray(ids[mine]), ranges=part, backend=backend)), local[mine])
        np.testing.assert_array_equal(np.asarray(slots), want, err_msg=f"step {step}")
        for field in ht.HashTable._fields:
            np.testing.assert_array_equal(np.concatenate([np.asarray(getattr(p, field)) for p in parts]),
                                          np.asarray(getattr(whole, field)), err_msg=field)
    assert int(ht.stats(whole)["size"]) == whole.capacity  # full: evictions happened


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_tables_in_one_array_place_ids_as_separate_tables(platform, backend):
    """Three indices in one array (ranges of 3, 5 and 2 buckets; a collection's dynamic
    tables), the same raw ids in several of them: each range holds what a table of its own
    holds, and the counts come per range."""
    rng = np.random.default_rng(8)
    size, n, sizes = 4, 30, (3, 5, 2)
    ranges = tuple(ht.Range(sum(sizes[:t]), b, b) for t, b in enumerate(sizes))
    both = ht.create(sum(sizes) * size, bucket_size=size)
    alone = [ht.create(b * size, bucket_size=size) for b in sizes]
    universe = rng.integers(-40, 40, 60).astype(np.int32)  # small: ids repeat across tables
    for step in range(10):
        ids = rng.choice(universe[: 20 + 4 * step], size=n).astype(np.int32)
        table_of = rng.integers(0, 3, n).astype(np.int32)
        valid = rng.random(n) > 0.1
        slots, both, info = ht.find_or_insert(both, jnp.asarray(ids), step, policy="lfu", valid=jnp.asarray(valid),
                                              table_of=jnp.asarray(table_of), ranges=ranges, backend=backend)
        slots = np.asarray(slots)
        for t, r in enumerate(ranges):
            mine = valid & (table_of == t)
            want, alone[t], want_info = ht.find_or_insert(alone[t], jnp.asarray(ids), step, policy="lfu",
                                                          valid=jnp.asarray(mine), backend=backend)
            want = np.asarray(want)
            np.testing.assert_array_equal(slots[mine], np.where(want[mine] >= 0, want[mine] + r.first * size, -1))
            for got, expected in zip(info[1:], want_info[1:]):
                assert int(got[t]) == int(expected[0])
            got_find = ht.find(both, jnp.asarray(ids), table_of=jnp.asarray(np.full(n, t, np.int32)), ranges=ranges,
                               backend=backend)
            want_find = np.asarray(ht.find(alone[t], jnp.asarray(ids), backend=backend))
            np.testing.assert_array_equal(np.asarray(got_find),
                                          np.where(want_find >= 0, want_find + r.first * size, -1))
        for field in ht.HashTable._fields:
            np.testing.assert_array_equal(np.concatenate([np.asarray(getattr(a, field)) for a in alone]),
                                          np.asarray(getattr(both, field)), err_msg=field)
    assert np.asarray(ht.find(both, jnp.asarray(ids), table_of=jnp.full(n, 3, jnp.int32), ranges=ranges,
                              backend=backend)).max() == -1  # no such range: no id
