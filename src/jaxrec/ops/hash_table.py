"""A fixed-capacity hash table of ids -> slots, inside ``jit``: the index of a dynamic
vocabulary (any id gets its own row, new ids are inserted while training, the least
valuable are evicted when their bucket is full). HierarchicalKV's design::

    slot = bucket * S + position        keys, digests, scores, seen: [num_buckets, S]
    h = murmur3_fmix(id)                (fmix32 for int32 ids, fmix64 for int64)
    bucket = (hi32(h) * num_buckets) >> 32      digest = low byte of h, 0 read as 1

    bucket 0  | k17 | k3 | -- | k40 | ... S slots     digests: 0x9c 0x41 0 0x07 (0 = empty)
    bucket 1  | k8  | -- | -- | --  | ...             scores: last step seen (LRU) or count (LFU)

A lookup reads its bucket's S digest bytes and compares keys only where the digest
matches. The bucket grows with ``h`` (multiply-shift of its high bits), so the batch's
ids sorted by ``h`` come grouped by bucket.

``find_or_insert(table, ids, step)`` gives every id its slot. The batch's distinct ids
already in the table keep their slots (scores refreshed). The new ids of a bucket, in
``h`` order, take its empty slots by position, then (``policy`` "lru" / "lfu") the slots
that no id of this batch uses, by lowest (score, position). An id left without a slot
(its bucket full of this batch's ids, or policy "none") is a failed insert: slot -1.
``find`` only looks up (evaluation): unknown ids get -1. Slot -1 is outside every table,
so a lookup under ``bounds_check_mode="NONE"`` gives it no row and no update
(docs/bounds_check.md).

Several indices can share one array, each a bucket range (``Range``, with ``table_of``
naming each id's): a collection's dynamic tables, or a device's parts of sharded ones.

There is no sentinel key (an empty slot has digest 0), so every value of the ids' dtype
(int32, or int64 with ``jax_enable_x64``) is a key. Deterministic: the same table and
batch give the same slots on every backend. Three implementations: XLA FFI handlers (C++
on CPU, CUDA on the GPU), and the jnp reference (``hash_table_reference``), which runs
where no handler is built; ``tests/test_hash_table.py`` checks all against a Python
dict model of the same buckets and policy (``tests/hash_table_testing.py``).
``find_or_insert`` sorts the batch by (range, ``h``), keeps one entry per distinct id (a
run) and places the runs, one bucket at a time: on the GPU all in one handler, on the
CPU XLA's sort and scatters and then a handler (docs/dynamic_vocab.md, Implementation).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec import _ffi
from jaxrec.ops import hash_table_reference as reference
from jaxrec.ops.hash_table_reference import FAILED, INSERTED, INSERTED_EVICTING, NOT_AN_ID

POLICIES = ("lru", "lfu", "none")
MAX_BUCKET_SIZE = 1024
"""The handlers keep a bucket's "used by this batch" bits in 32 words of shared memory."""


class HashTable(NamedTuple):
    """The table's state (a pytree; donate it to update it in place)."""

    keys: jax.Array
    """``[num_buckets, bucket_size]`` ids (meaningful where the digest is not 0)."""
    digests: jax.Array
    """``uint8[num_buckets, bucket_size]``: the low byte of each held id's hash (0 read as
    1); 0 marks an empty slot."""
    scores: jax.Array
    """``int32[num_buckets, bucket_size]``: last step seen (LRU) or times seen (LFU)."""
    seen: jax.Array
    """``int32[num_buckets, bucket_size]``: the last step ``find_or_insert`` saw the slot's
    id (whatever the policy): what changed since a step (``changed_since``)."""

    @property
    def capacity(self) -> int:
        return self.keys.size

    @property
    def used(self) -> jax.Array:
        """``bool[num_buckets, bucket_size]``: the slots holding an id."""
        return self.digests != 0


class InsertInfo(NamedTuple):
    """What ``find_or_insert`` did."""

    fresh_slots: jax.Array
    """``int32[N]``: entry ``k`` is the slot given to the batch's ``k``-th distinct id (in
    hash order) if it is new, ``capacity`` (out of range) otherwise. Their rows and optimizer state must be initialised
    anew: an evicted id's row is never inherited."""
    inserted: jax.Array
    """``int32[ranges]``: distinct ids inserted (per range)."""
    evicted: jax.Array
    """``int32[ranges]``: ids evicted to make room."""
    failed: jax.Array
    """``int32[ranges]``: distinct ids left without a slot (slot -1)."""


def create(capacity: int, *, bucket_size: int = 128, dtype=jnp.int32) -> HashTable:
    """An empty table of ``capacity`` slots (a multiple of ``bucket_size``, below 2**31)
    for ids of ``dtype`` (int32, or int64 with ``jax_enable_x64``)."""
    if not 1 <= bucket_size <= MAX_BUCKET_SIZE:
        raise ValueError(f"bucket_size must lie in [1, {MAX_BUCKET_SIZE}], got {bucket_size}")
    if capacity < bucket_size or capacity % bucket_size or capacity >= 2**31:
        raise ValueError(f"capacity must be a positive multiple of bucket_size={bucket_size} below 2**31, "
                         f"got capacity={capacity}")
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.int32), jnp.dtype(jnp.int64)):
        raise TypeError(f"dtype must be int32 or int64, got {dtype}")
    if dtype == jnp.int64 and not jax.config.jax_enable_x64:
        raise ValueError("int64 ids need jax_enable_x64: jax.config.update('jax_enable_x64', True)")
    shape = (capacity // bucket_size, bucket_size)
    return HashTable(jnp.zeros(shape, dtype), jnp.zeros(shape, jnp.uint8), jnp.zeros(shape, jnp.int32),
                     jnp.full(shape, -1, jnp.int32))


hash_ids = reference.hash_ids
bucket_of = reference.bucket_of


class Range(NamedTuple):
    """Buckets ``[first, first + local)`` of a table are an index of their own: bucket ``b``
    of a table of ``total`` buckets, of which this one holds a ``local``-bucket part, is
    bucket ``first + b % local`` here. One table: ``Range(0, nb, nb)``; a device's part of a
    table split over D devices: ``Range(0, nb / D, nb)`` (``shard_of``); several tables
    in one array (a collection's dynamic tables): one range after the other."""

    first: int
    local: int
    total: int


def ranges_of(table: HashTable, ranges=None) -> tuple[Range, ...]:
    """``ranges`` checked, or the one range of the whole table."""
    num_buckets = table.keys.shape[0]
    if ranges is None:
        return (Range(0, num_buckets, num_buckets),)
    ranges = tuple(Range(*map(int, r)) for r in ranges)
    end = 0
    for r in ranges:
        if r.first != end or r.local < 1 or r.total % r.local or r.total >= 2**31:
            raise ValueError(f"ranges must tile the table's {num_buckets} buckets in order, each a part "
                             f"(local) of a table of total buckets (a multiple of local, below 2**31); "
                             f"got {ranges}")
        end += r.local
    if end != num_buckets:
        raise ValueError(f"ranges cover {end} buckets, the table has {num_buckets}; got {ranges}")
    return ranges


def shard_of(ids: jax.Array, num_buckets: int, shards: int) -> jax.Array:
    """Each id's shard (``int32``) when a table of ``num_buckets`` buckets is split into
    ``shards`` consecutive bucket ranges (``num_buckets % shards == 0``), each a table of
    its own (a device's part of a sharded dynamic table). Slot ``s`` of shard ``d`` is
    slot ``d * capacity / shards + s`` of the whole table: sharded and whole tables place
    every id alike."""
    if num_buckets % shards:
        raise ValueError(f"num_buckets={num_buckets} must be a multiple of shards={shards}")
    return bucket_of(ids, num_buckets) // (num_buckets // shards)


def find(table: HashTable, ids: jax.Array, *, table_of: jax.Array | None = None, ranges=None,
         backend: str = "auto") -> jax.Array:
    """``int32`` slot of each id, -1 where the table does not hold it.

    ``ranges`` (``Range`` per table, default: the whole table) and ``table_of`` (``int32[N]``,
    each id's range, default 0): the table holds several indices, one per range (or parts
    of larger tables, whose ids must be those of the part: ``shard_of``); an id whose
    ``table_of`` is no range's gets -1. backend: "auto", "kernel" or "reference"
    (``jaxrec._ffi.dispatch``)."""
    ids = _check(table, ids)
    ranges = ranges_of(table, ranges)
    table_of = _table_of(ids, table_of, len(ranges))
    return _find(table.keys, table.digests, ids, table_of, ranges=ranges, backend=backend)


@functools.partial(jax.jit, static_argnames=("ranges", "backend"))
def _find(keys, digests, ids, table_of, *, ranges, backend):
    bounds = jnp.asarray(ranges, jnp.int32).reshape(-1, 3)

    def kernel(keys, digests, ids, table_of, bounds):
        call = jax.ffi.ffi_call("jaxrec_hash_find", jax.ShapeDtypeStruct(ids.shape, jnp.int32),
                                vmap_method="sequential")
        return call(keys, digests, ids, table_of, bounds)

    def ref(keys, digests, ids, table_of, bounds):
        return reference.find(keys, digests, ids, bounds, table_of)

    slots = _ffi.dispatch(kernel, ref, keys, digests, ids, table_of, bounds, backend=backend)
    return jnp.where((table_of >= 0) & (table_of < len(ranges)), slots, -1)  # not an index's id


def find_or_insert(table: HashTable, ids: jax.Array, step, *, policy: str = "lru",
                   valid: jax.Array | None = None, table_of: jax.Array | None = None, ranges=None,
                   keep_seen: bool = False, backend: str = "auto") -> tuple[jax.Array, HashTable, InsertInfo]:
    """``(slots, table, info)``: every id's slot, inserting new ids (module doc).

    ``step``: the training step (LRU's score). ``valid``: ``bool[N]``, False for entries
    that are not ids (a KJT's padding): they get slot -1 and change nothing. ``table_of``,
    ``ranges``: as for ``find``. ``keep_seen``: the slots an earlier call of this ``step``
    saw are not evicted either, as if their ids were in this batch (the rows of a batch in
    flight, while a prefetch places the next one's). backend: "auto", "kernel" or
    "reference" (``jaxrec._ffi.dispatch``).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    ids = _check(table, ids)
    ranges = ranges_of(table, ranges)
    table_of = _table_of(ids, table_of, len(ranges))
    valid = jnp.ones(ids.shape, bool) if valid is None else jnp.asarray(valid, bool)
    return _find_or_insert(table, ids, jnp.asarray(step, jnp.int32), valid, table_of, policy=policy,
                           ranges=ranges, keep_seen=bool(keep_seen), backend=backend)


@functools.partial(jax.jit, static_argnames=("policy", "ranges", "keep_seen", "backend"))
def _find_or_insert(table, ids, step, valid, table_of, *, policy, ranges, keep_seen, backend):
    # The CPU handler and the reference place runs that XLA sorts and groups
    # (_insert_by_runs); the CUDA handler does it all in one call (csrc/cuda/hash_table.cu).
    bounds = jnp.asarray(ranges, jnp.int32).reshape(-1, 3)
    options = dict(policy=policy, keep_seen=keep_seen)
    kernels = {"cpu": functools.partial(_insert_by_runs, insert=functools.partial(_insert_runs_cpu, **options)),
               "cuda": functools.partial(_insert_cuda, **options)}
    by_reference = functools.partial(_insert_by_runs,
                                     insert=lambda *args: reference.insert_runs(*args, **options))
    return _ffi.dispatch(kernels, by_reference, table, ids, step, valid, table_of, bounds, backend=backend)


def _insert_by_runs(table, ids, step, valid, table_of, bounds, *, insert):
    # One run per distinct (range, id), in (range, hash) order: a stable sort by hash, then
    # (several ranges) a stable sort by range; fmix is a bijection, so equal hashes are
    # equal ids.
    count = bounds.shape[0]
    h = hash_ids(ids)
    order = jnp.argsort(h, stable=True)
    if count > 1:
        order = order[jnp.argsort(table_of[order], stable=True)]
    s_h, s_valid, s_table = h[order], valid[order], table_of[order]
    n = ids.shape[0]
    new_run = jnp.concatenate([jnp.ones((min(n, 1),), bool),
                               (s_h[1:] != s_h[:-1]) | (s_table[1:] != s_table[:-1])])
    run = jnp.cumsum(new_run, dtype=jnp.int32) - 1
    s_valid &= (s_table >= 0) & (s_table < count)  # an id of no range is no id
    counts = jnp.zeros((n,), jnp.int32).at[run].add(s_valid.astype(jnp.int32))
    # The entries past the last run belong to no range (count 0): the handlers skip them,
    # and each bucket's runs stay consecutive.
    s_ids = ids[order]
    run_ids = jnp.zeros((n,), ids.dtype).at[run].set(s_ids)
    run_tables = jnp.full((n,), count, jnp.int32).at[run].set(s_table)
    *state, run_slots, status = insert(*table, run_ids, run_tables, counts, step, bounds)
    slots = jnp.zeros((n,), jnp.int32).at[order].set(jnp.where(s_valid, run_slots[run], -1))
    placed = (status == INSERTED) | (status == INSERTED_EVICTING)
    # fresh_slots by the id's rank among the batch's distinct ids (hash order), so that
    # the padding entries do not shift it.
    rank = jnp.cumsum(status != NOT_AN_ID, dtype=jnp.int32) - 1
    fresh = jnp.full((n,), table.capacity, jnp.int32).at[jnp.where(placed, rank, n)].set(run_slots, mode="drop")
    info = InsertInfo(fresh, *(count_per_range(flag, run_tables, count)
                               for flag in (placed, status == INSERTED_EVICTING, status == FAILED)))
    return slots, HashTable(*state), info


def _insert_runs_cpu(keys, digests, scores, seen, run_ids, run_tables, counts, step, bounds, *, policy, keep_seen):
    n = run_ids.shape[0]
    like = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (keys, digests, scores, seen)]
    call = jax.ffi.ffi_call(
        "jaxrec_hash_insert", (*like, jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.int32)),
        input_output_aliases={0: 0, 1: 1, 2: 2, 3: 3}, vmap_method="sequential")
    return call(keys, digests, scores, seen, run_ids, run_tables, counts, step, bounds,
                policy=np.int32(POLICIES.index(policy)), keep_seen=np.int32(keep_seen))


def _insert_cuda(table, ids, step, valid, table_of, bounds, *, policy, keep_seen):
    n, count = ids.shape[0], bounds.shape[0]
    like = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in table]
    call = jax.ffi.ffi_call(
        "jaxrec_hash_find_or_insert",
        (*like, jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.int32),
         jax.ShapeDtypeStruct((3, count), jnp.int32)),
        input_output_aliases={0: 0, 1: 1, 2: 2, 3: 3}, vmap_method="sequential")
    *state, slots, fresh, counts = call(*table, ids, valid, table_of, step, bounds,
                                        policy=np.int32(POLICIES.index(policy)), keep_seen=np.int32(keep_seen))
    return slots, HashTable(*state), InsertInfo(fresh, counts[0], counts[1], counts[2])


def range_of_slots(slots, ranges, bucket_size: int):
    """Each slot's range (its index in ``ranges``, clipped into them): the range whose
    buckets hold it. NumPy slots give a NumPy answer."""
    xp = np if isinstance(slots, np.ndarray) else jnp
    firsts = xp.asarray([r.first for r in ranges], slots.dtype) * bucket_size
    return xp.clip(xp.searchsorted(firsts, slots, side="right") - 1, 0, len(ranges) - 1)


def count_per_range(flag: jax.Array, table_of: jax.Array, count: int) -> jax.Array:
    """``int32[count]``: how many entries of each range are flagged. A reduction: a
    scatter-add into a few counters serialised a million atomics on the GPU."""
    if count == 1:
        return jnp.sum(flag & (table_of == 0), dtype=jnp.int32)[None]
    return jnp.sum(flag[:, None] & (table_of[:, None] == jnp.arange(count, dtype=table_of.dtype)[None, :]),
                   axis=0, dtype=jnp.int32)


def _table_of(ids, table_of, count: int) -> jax.Array:
    if table_of is None:
        if count != 1:
            raise ValueError(f"table_of is needed: the table holds {count} ranges")
        return jnp.zeros(ids.shape, jnp.int32)
    table_of = jnp.asarray(table_of)
    if table_of.shape != ids.shape:
        raise ValueError(f"table_of must be like ids, {list(ids.shape)}, got {list(table_of.shape)}")
    return table_of.astype(jnp.int32)


def _check(table: HashTable, ids) -> jax.Array:
    ids = jnp.asarray(ids)
    if ids.ndim != 1 or ids.dtype != table.keys.dtype:
        raise ValueError(f"ids must be a 1-D array of the table's dtype {table.keys.dtype}, got "
                         f"{ids.dtype}{list(ids.shape)}")
    return ids


def changed_since(table: HashTable, step: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, slots)`` (NumPy) of the ids that ``find_or_insert`` saw at ``step`` or later:
    those inserted or trained since then (the rows a serving copy must refresh)."""
    used, seen = np.asarray(table.digests).ravel() != 0, np.asarray(table.seen).ravel()
    slots = np.flatnonzero(used & (seen >= step))
    return np.asarray(table.keys).ravel()[slots], slots


def stats(table: HashTable) -> dict[str, jax.Array]:
    """``size`` (ids held) and ``load_factor`` (size / capacity)."""
    size = jnp.sum(table.digests != 0, dtype=jnp.int32)
    return {"size": size, "load_factor": size.astype(jnp.float32) / table.capacity}
