"""The pure-jnp hash table (``jaxrec.ops.hash_table``'s reference): the hash, the bucket,
the digest, ``find`` and the placement of a batch's distinct ids. It runs where no
handler is built, and is what the handlers (csrc/*/hash_table.*) are tested against.
Costs O(batch * S): each distinct id reads its whole bucket."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# What the placement did with each distinct id (a run); the handlers use the same codes.
NOT_AN_ID, FOUND, INSERTED, INSERTED_EVICTING, FAILED = range(5)


def hash_ids(ids: jax.Array) -> jax.Array:
    """murmur3's finalizer of each id's bits: ``uint32`` (fmix32) for int32 ids, ``uint64``
    (fmix64) for int64 ids. A bijection: distinct ids have distinct hashes."""
    if ids.dtype == jnp.int64:
        h = ids.astype(jnp.uint64)
        h = (h ^ (h >> 33)) * jnp.uint64(0xFF51AFD7ED558CCD)
        h = (h ^ (h >> 33)) * jnp.uint64(0xC4CEB9FE1A85EC53)
        return h ^ (h >> 33)
    h = ids.astype(jnp.uint32)
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def bucket_of(ids: jax.Array, num_buckets: int) -> jax.Array:
    """Each id's bucket (``int32``)."""
    return bucket_of_hash(hash_ids(ids), num_buckets)


def bucket_of_hash(h: jax.Array, num_buckets: int) -> jax.Array:
    """``(hi32(h) * num_buckets) >> 32``: in ``[0, num_buckets)``, growing with ``h``."""
    if h.dtype == jnp.uint64:
        return (((h >> 32) * jnp.uint64(num_buckets)) >> 32).astype(jnp.int32)
    return _mul_hi32(h, num_buckets).astype(jnp.int32)


def digest_of_hash(h: jax.Array) -> jax.Array:
    """``uint8``: the low byte of ``h``, 0 read as 1 (0 marks an empty slot)."""
    d = (h & 0xFF).astype(jnp.uint8)
    return jnp.where(d == 0, jnp.uint8(1), d)


def _mul_hi32(x: jax.Array, n) -> jax.Array:
    """``(x * n) >> 32`` for ``uint32`` x and n (an int or ``uint32`` array) below 2**31, in
    32-bit arithmetic (int64 may be off): the four 16-bit partial products, carries added."""
    n = jnp.asarray(n, jnp.uint32)
    a, b = x >> 16, x & 0xFFFF
    c, d = n >> 16, n & 0xFFFF
    ad, bc = a * d, b * c
    mid = ((b * d) >> 16) + (ad & 0xFFFF) + (bc & 0xFFFF)
    return a * c + (ad >> 16) + (bc >> 16) + (mid >> 16)


def bucket_in(h: jax.Array, ranges: jax.Array, table_of: jax.Array) -> jax.Array:
    """Each id's bucket in a table holding bucket ranges (``hash_table.Ranges``): range
    ``t = table_of`` starts at bucket ``first[t]`` and holds ``local[t]`` buckets of a table of
    ``total[t]``: ``first + bucket_of_hash(h, total) % local``."""
    first, local, total = (ranges[table_of, k] for k in range(3))
    if h.dtype == jnp.uint64:
        bucket = ((h >> 32) * total.astype(jnp.uint64)) >> 32
    else:
        bucket = _mul_hi32(h, total.astype(jnp.uint32))
    return (first + bucket.astype(jnp.int32) % local).astype(jnp.int32)


def _lookup(keys, digests, ids, ranges, table_of) -> tuple[jax.Array, jax.Array]:
    """``(slot, found)`` of each id: its bucket's slots of equal digest compared with it."""
    size = keys.shape[1]
    h = hash_ids(ids)
    bucket = bucket_in(h, ranges, table_of)
    match = (digests[bucket] == digest_of_hash(h)[:, None]) & (keys[bucket] == ids[:, None])
    return bucket * size + jnp.argmax(match, axis=1).astype(jnp.int32), jnp.any(match, axis=1)


def find(keys, digests, ids, ranges, table_of) -> jax.Array:
    """``int32`` slot of each id, -1 where the table does not hold it."""
    slot, found = _lookup(keys, digests, ids, ranges, table_of)
    return jnp.where(found, slot, -1)


def insert_runs(keys, digests, scores, seen, run_ids, run_tables, counts, step, ranges, policy: str,
                keep_seen: bool = False):
    """``(keys, digests, scores, seen, run_slots, status)``: the table's new state and
    where each run went. Places a batch's distinct ids (``hash_table``'s
    module doc). ``run_ids[r]`` (of range ``run_tables[r]``) is an id of the batch where
    ``counts[r] > 0`` (how often it occurs), distinct and in (range, hash) order; entries
    with count 0 are not ids. ``status``:
    ``NOT_AN_ID`` / ``FOUND`` / ``INSERTED`` / ``INSERTED_EVICTING`` / ``FAILED``.
    ``keep_seen``: slots seen at ``step`` by an earlier call are in use too."""
    n = run_ids.shape[0]
    shape = num_buckets, size = keys.shape
    capacity = keys.size
    is_id = counts > 0
    slot, found = _lookup(keys, digests, run_ids, ranges, run_tables)
    found &= is_id
    flat_used, flat_scores = digests.reshape(-1) != 0, scores.reshape(-1)
    hit = jnp.zeros((capacity,), bool).at[jnp.where(found, slot, capacity)].set(True, mode="drop")

    # New ids: their rank among the batch's new ids of their bucket (hash order).
    missing = is_id & ~found
    h = hash_ids(run_ids)
    bucket = bucket_in(h, ranges, run_tables)
    key = jnp.where(missing, bucket, num_buckets)
    by_bucket = jnp.argsort(key, stable=True)
    sorted_key = key[by_bucket]
    pos = jnp.arange(n, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones((min(n, 1),), bool), sorted_key[1:] != sorted_key[:-1]])
    rank = jnp.zeros((n,), jnp.int32).at[by_bucket].set(
        pos - jax.lax.cummax(jnp.where(starts, pos, 0), axis=0))

    # Each new id's candidates in its bucket: empty slots, then (evicting policies) the
    # slots no id of the batch uses, by (score, position); slots in use come last, never taken.
    cells = bucket[:, None] * size + jnp.arange(size, dtype=jnp.int32)[None, :]
    empty = ~flat_used[cells]
    in_use = hit[cells] | (keep_seen & (seen.reshape(-1)[cells] == step))
    evictable = flat_used[cells] & ~in_use & (policy != "none")
    cls = jnp.where(empty, 0, jnp.where(evictable, 1, 2))
    score = jnp.where(evictable, flat_scores[cells], 0)
    ranked = jnp.take_along_axis(cells, jnp.lexsort((cells, score, cls), axis=-1), axis=-1)
    available = jnp.sum(cls < 2, axis=1, dtype=jnp.int32)
    placed = missing & (rank < available)
    chosen = jnp.take_along_axis(ranked, jnp.minimum(rank, size - 1)[:, None], axis=1)[:, 0]
    chosen = jnp.where(placed, chosen, capacity)  # out of range: dropped by the scatters
    evicting = placed & flat_used.at[chosen].get(mode="fill", fill_value=False)

    keys = keys.reshape(-1).at[chosen].set(run_ids, mode="drop")
    digests = digests.reshape(-1).at[chosen].set(digest_of_hash(h), mode="drop")
    touched = jnp.where(found, slot, chosen)
    touched = jnp.where(is_id, touched, capacity)
    if policy == "lfu":
        base = jnp.where(found, flat_scores.at[touched].get(mode="fill", fill_value=0), 0)
        scores = flat_scores.at[touched].set(base + counts, mode="drop")
    else:
        scores = flat_scores.at[touched].set(step, mode="drop")
    seen = seen.reshape(-1).at[touched].set(step, mode="drop")

    run_slots = jnp.where(found, slot, jnp.where(placed, chosen, -1)).astype(jnp.int32)
    status = jnp.where(~is_id, NOT_AN_ID, jnp.where(found, FOUND, jnp.where(
        placed, jnp.where(evicting, INSERTED_EVICTING, INSERTED), FAILED))).astype(jnp.int32)
    return (keys.reshape(shape), digests.reshape(shape), scores.reshape(shape), seen.reshape(shape),
            run_slots, status)
