"""A fixed-capacity hash table of ids -> slots, inside ``jit``: the index of a dynamic
vocabulary (any id gets its own row, new ids are inserted while training, the least
valuable are evicted when their bucket is full). HierarchicalKV's design, in ``jnp``::

    slot = bucket * S + position          keys, used, scores, seen: [num_buckets, S]
    bucket(id) = murmur3_fmix(id) % num_buckets

    bucket 0  | k17 | k3 | -- | k40 | ... S slots     used:   1 1 0 1
    bucket 1  | k8  | -- | -- | --  | ...             scores: last step seen (LRU) or count (LFU)

``find_or_insert(table, ids, step)`` gives every id its slot. The batch's distinct ids
already in the table keep their slots (scores refreshed); a new id takes, in its bucket,
the first empty slot, else (``policy`` "lru" / "lfu") the slot of lowest score that no
id of this batch uses, ties to the lower position; new ids of one bucket are placed in
id order. An id left without a slot (its bucket full of this batch's ids, or policy
"none") is a failed insert: slot -1. ``find`` only looks up (evaluation): unknown ids
get -1. Slot -1 is outside every table, so a lookup under ``bounds_check_mode="NONE"``
gives it no row and no update (docs/bounds_check.md).

There is no sentinel key: ``used`` marks the slots in use, so every value of the ids'
dtype (int32, or int64 with ``jax_enable_x64``) is a key. Deterministic: the same table
and batch give the same slots on every backend. ``tests/test_hash_table.py`` checks
it against a Python dict model of the same buckets and policy. Costs O(batch * S): each
distinct id reads its bucket.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

POLICIES = ("lru", "lfu", "none")


class HashTable(NamedTuple):
    """The table's state (a pytree; donate it to update it in place)."""

    keys: jax.Array
    """``[num_buckets, bucket_size]`` ids (meaningful where ``used``)."""
    used: jax.Array
    """``bool[num_buckets, bucket_size]``: slots holding an id."""
    scores: jax.Array
    """``int32[num_buckets, bucket_size]``: last step seen (LRU) or times seen (LFU)."""
    seen: jax.Array
    """``int32[num_buckets, bucket_size]``: the last step ``find_or_insert`` saw the slot's
    id (whatever the policy): what changed since a step (``changed_since``)."""

    @property
    def capacity(self) -> int:
        return self.keys.size


class InsertInfo(NamedTuple):
    """What ``find_or_insert`` did."""

    fresh_slots: jax.Array
    """``int32[N]``: the slots given a new id, one entry per new distinct id, ``capacity``
    (out of range) in the other entries. Their rows and optimizer state must be initialised
    anew: an evicted id's row is never inherited."""
    inserted: jax.Array
    """Distinct ids inserted."""
    evicted: jax.Array
    """Ids evicted to make room."""
    failed: jax.Array
    """Distinct ids left without a slot (slot -1)."""


def create(capacity: int, *, bucket_size: int = 128, dtype=jnp.int32) -> HashTable:
    """An empty table of ``capacity`` slots (a multiple of ``bucket_size``) for ids of
    ``dtype`` (int32, or int64 with ``jax_enable_x64``)."""
    if bucket_size < 1 or capacity < bucket_size or capacity % bucket_size:
        raise ValueError(f"capacity must be a positive multiple of bucket_size={bucket_size}, got "
                         f"capacity={capacity}")
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.int32), jnp.dtype(jnp.int64)):
        raise TypeError(f"dtype must be int32 or int64, got {dtype}")
    if dtype == jnp.int64 and not jax.config.jax_enable_x64:
        raise ValueError("int64 ids need jax_enable_x64: jax.config.update('jax_enable_x64', True)")
    shape = (capacity // bucket_size, bucket_size)
    return HashTable(jnp.zeros(shape, dtype), jnp.zeros(shape, bool), jnp.zeros(shape, jnp.int32),
                     jnp.full(shape, -1, jnp.int32))


def bucket_of(ids: jax.Array, num_buckets: int) -> jax.Array:
    """Each id's bucket: murmur3's finalizer (fmix32 / fmix64) of its bits, mod ``num_buckets``."""
    if ids.dtype == jnp.int64:
        h = ids.astype(jnp.uint64)
        h = (h ^ (h >> 33)) * jnp.uint64(0xFF51AFD7ED558CCD)
        h = (h ^ (h >> 33)) * jnp.uint64(0xC4CEB9FE1A85EC53)
        h = h ^ (h >> 33)
        return (h % jnp.uint64(num_buckets)).astype(jnp.int32)
    h = ids.astype(jnp.uint32)
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    h = h ^ (h >> 16)
    return (h % jnp.uint32(num_buckets)).astype(jnp.int32)


def find(table: HashTable, ids: jax.Array) -> jax.Array:
    """``int32`` slot of each id, -1 where the table does not hold it."""
    ids = _check(table, ids)
    slot, found = _lookup(table, ids)
    return jnp.where(found, slot, -1)


def find_or_insert(table: HashTable, ids: jax.Array, step, *, policy: str = "lru",
                   valid: jax.Array | None = None) -> tuple[jax.Array, HashTable, InsertInfo]:
    """``(slots, table, info)``: every id's slot, inserting new ids (module doc).

    ``step``: the training step (LRU's score). ``valid``: ``bool[N]``, False for entries
    that are not ids (a KJT's padding): they get slot -1 and change nothing.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    ids = _check(table, ids)
    n = ids.shape[0]
    valid = jnp.ones((n,), bool) if valid is None else jnp.asarray(valid, bool)
    num_buckets, size = table.keys.shape

    # The distinct valid ids, in id order (invalid entries sorted after them).
    order = jnp.lexsort((ids, ~valid))
    s_ids, s_valid = ids[order], valid[order]
    new_run = jnp.concatenate([jnp.ones((1,), bool), s_ids[1:] != s_ids[:-1]])
    first = s_valid & (new_run | jnp.concatenate([jnp.ones((1,), bool), ~s_valid[:-1]]))
    group = jnp.cumsum(first, dtype=jnp.int32) - 1  # each sorted entry's distinct id (valid ones)
    group = jnp.where(s_valid, group, n - 1)
    uniq = jnp.zeros((n,), ids.dtype).at[jnp.where(first, group, n)].set(s_ids, mode="drop")
    pos = jnp.arange(n, dtype=jnp.int32)
    is_uniq = pos < jnp.sum(first, dtype=jnp.int32)
    count = jnp.zeros((n,), jnp.int32).at[group].add(s_valid.astype(jnp.int32))

    slot, found = _lookup(table, uniq)
    found &= is_uniq
    flat_used, flat_scores = table.used.reshape(-1), table.scores.reshape(-1)
    hit = jnp.zeros((table.capacity,), bool).at[jnp.where(found, slot, table.capacity)].set(True, mode="drop")

    # New ids: their rank among the batch's new ids of their bucket (id order).
    missing = is_uniq & ~found
    bucket = bucket_of(uniq, num_buckets)
    key = jnp.where(missing, bucket, num_buckets)
    by_bucket = jnp.argsort(key, stable=True)
    sorted_key = key[by_bucket]
    starts = jnp.concatenate([jnp.ones((1,), bool), sorted_key[1:] != sorted_key[:-1]])
    rank = jnp.zeros((n,), jnp.int32).at[by_bucket].set(
        pos - jax.lax.cummax(jnp.where(starts, pos, 0), axis=0))

    # Each new id's candidates in its bucket: empty slots, then (evicting policies) the
    # slots no id of the batch uses, by (score, position); slots in use come last, never taken.
    cells = bucket[:, None] * size + jnp.arange(size, dtype=jnp.int32)[None, :]
    empty = ~flat_used[cells]
    evictable = flat_used[cells] & ~hit[cells] & (policy != "none")
    cls = jnp.where(empty, 0, jnp.where(evictable, 1, 2))
    score = jnp.where(evictable, flat_scores[cells], 0)
    ranked = jnp.take_along_axis(cells, jnp.lexsort((cells, score, cls), axis=-1), axis=-1)
    available = jnp.sum(cls < 2, axis=1, dtype=jnp.int32)
    placed = missing & (rank < available)
    chosen = jnp.take_along_axis(ranked, jnp.minimum(rank, size - 1)[:, None], axis=1)[:, 0]
    chosen = jnp.where(placed, chosen, table.capacity)  # out of range: dropped by the scatters

    evicted = jnp.sum(jnp.where(placed, flat_used.at[chosen].get(mode="fill", fill_value=False), False))
    keys = table.keys.reshape(-1).at[chosen].set(uniq, mode="drop")
    used = flat_used.at[chosen].set(True, mode="drop")
    touched = jnp.where(found, slot, chosen)
    touched = jnp.where(is_uniq, touched, table.capacity)
    if policy == "lfu":
        base = jnp.where(found, flat_scores.at[touched].get(mode="fill", fill_value=0), 0)
        scores = flat_scores.at[touched].set(base + count, mode="drop")
    else:
        scores = flat_scores.at[touched].set(jnp.asarray(step, jnp.int32), mode="drop")

    seen = table.seen.reshape(-1).at[touched].set(jnp.asarray(step, jnp.int32), mode="drop")
    uniq_slot = jnp.where(found, slot, jnp.where(placed, chosen, -1))
    sorted_slot = jnp.where(s_valid, uniq_slot[group], -1)
    slots = jnp.zeros((n,), jnp.int32).at[order].set(sorted_slot.astype(jnp.int32))
    shape = table.keys.shape
    new = HashTable(keys.reshape(shape), used.reshape(shape), scores.reshape(shape), seen.reshape(shape))
    info = InsertInfo(chosen, jnp.sum(placed, dtype=jnp.int32), evicted.astype(jnp.int32),
                      jnp.sum(missing & ~placed, dtype=jnp.int32))
    return slots, new, info


def _lookup(table: HashTable, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(slot, found)`` of each id: its bucket's slots compared with it."""
    num_buckets, size = table.keys.shape
    bucket = bucket_of(ids, num_buckets)
    match = table.used[bucket] & (table.keys[bucket] == ids[:, None])
    return bucket * size + jnp.argmax(match, axis=1).astype(jnp.int32), jnp.any(match, axis=1)


def _check(table: HashTable, ids) -> jax.Array:
    ids = jnp.asarray(ids)
    if ids.ndim != 1 or ids.dtype != table.keys.dtype:
        raise ValueError(f"ids must be a 1-D array of the table's dtype {table.keys.dtype}, got "
                         f"{ids.dtype}{list(ids.shape)}")
    return ids


def changed_since(table: HashTable, step: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, slots)`` (NumPy) of the ids that ``find_or_insert`` saw at ``step`` or later:
    those inserted or trained since then (the rows a serving copy must refresh)."""
    used, seen = np.asarray(table.used).ravel(), np.asarray(table.seen).ravel()
    slots = np.flatnonzero(used & (seen >= step))
    return np.asarray(table.keys).ravel()[slots], slots


def stats(table: HashTable) -> dict[str, jax.Array]:
    """``size`` (ids held) and ``load_factor`` (size / capacity)."""
    size = jnp.sum(table.used)
    return {"size": size, "load_factor": size.astype(jnp.float32) / table.capacity}
