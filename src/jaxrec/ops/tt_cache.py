"""``TTCache``: FBTT-Embedding's LFU cache of decompressed hot rows, in pure ``jnp``.

A tensor-train (TT) table stores no rows: each lookup multiplies slices of the TT
cores. FBTT keeps the most frequently looked-up rows decompressed in a small cache:

* ``count_ids`` counts lookups per id in an open-addressing hash table of
  ``hashtbl_size`` slots (linear probing, at most ``MAX_PROBES`` probes per id);
* ``cache_populate`` (called every so often by the training loop) picks the
  ``cache_size`` most frequent ids, keeps the rows of those already cached (they are
  trained values) and decompresses the others with ``row_fn``;
* ``cache_lookup`` tells which ids the cache serves, and where. While cached, a row is
  trained as a dense row; the TT op (not this module) does the serving and training.

FBTT semantics kept here:

* ids that find neither their key nor a free slot within ``MAX_PROBES`` probes are not
  counted (FBTT's bounded probing): size the table to at least ~2x the number of
  distinct ids you want tracked;
* ``cache_populate`` rebuilds the hash table holding only the selected ids with their
  counts: the counts of uncached ids are dropped, which makes room for new ids (and
  lets the cache follow a drifting distribution).

Determinism: every result is a function of the inputs only. Slot claims are a
scatter-min (the smallest id wins a free slot) and counts a scatter-add of integers,
both order-independent; the selection is a total order (count desc, then id asc).

Counting and populating are ``jnp`` (XLA) rather than a custom kernel: a few gathers
and scatters per probe round (usually 1-3 rounds) and a sort at populate time, a
small fraction of the cost of a TT lookup (a chain of small matmuls per id). They run
under ``jit`` on CPU and GPU; the functions also work eagerly.

Ids are int32 (``EMPTY = 2**31 - 1`` is reserved). Cast int64 ids yourself after
checking that they are in ``[0, 2**31 - 1)``. Counts are int32 and are reset for
uncached ids at every populate; populate often enough that no count reaches 2**31.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

EMPTY = int(np.iinfo(np.int32).max)
"""Sentinel of a free hash-table slot and of an unused cache position."""

MAX_PROBES = 32
"""Slots an id looks at before it gives up (FBTT's bound)."""

_HASH_MULTIPLIER = np.uint32(0x9E3779B1)  # Knuth's multiplicative constant, 2**32 / phi


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["keys", "counts", "ids", "rows"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TTCache:
    """Lookup counts and the cached rows of one TT table: a pytree of four arrays.

    ::

        # hash table (hashtbl_size = 8): lookups counted since the last populate
        # slot:     0    1    2    3    4    5    6    7
        # keys:   [ E,  42,   7,   E,   E,  13,  99,   E ]     E = EMPTY (free slot)
        # counts: [ 0,   5,   1,   0,   0,   9,   3,   0 ]
        #
        # cache (cache_size = 4): cached ids, sorted ascending, EMPTY-padded
        # ids:    [ 13,  42,  99,   E ]
        # rows:   [r13, r42, r99,   0 ]                      float32[cache_size, dim]
    """

    keys: jax.Array
    """int32[hashtbl_size]: the id in each slot, ``EMPTY`` where the slot is free."""
    counts: jax.Array
    """int32[hashtbl_size]: lookups counted for the id in each slot."""
    ids: jax.Array
    """int32[cache_size]: the cached ids, sorted ascending, ``EMPTY`` at the end."""
    rows: jax.Array
    """float32[cache_size, dim]: the row of each cached id (zeros where ``EMPTY``)."""

    @property
    def cache_size(self) -> int:
        return self.ids.shape[0]

    @property
    def hashtbl_size(self) -> int:
        return self.keys.shape[0]

    @property
    def dim(self) -> int:
        return self.rows.shape[1]


def init_cache(cache_size: int, hashtbl_size: int, dim: int) -> TTCache:
    """An empty cache: a free hash table and no cached ids."""
    for name, value in (("cache_size", cache_size), ("hashtbl_size", hashtbl_size), ("dim", dim)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if hashtbl_size < cache_size:
        raise ValueError(f"hashtbl_size ({hashtbl_size}) must be >= cache_size ({cache_size}): the "
                         f"table must hold every cached id; use hashtbl_size >= {2 * cache_size} "
                         "(about 2x the distinct ids you want tracked)")
    if hashtbl_size >= EMPTY:
        raise ValueError(f"hashtbl_size must be < 2**31 - 1, got {hashtbl_size}")
    return TTCache(keys=jnp.full((hashtbl_size,), EMPTY, jnp.int32),
                   counts=jnp.zeros((hashtbl_size,), jnp.int32),
                   ids=jnp.full((cache_size,), EMPTY, jnp.int32),
                   rows=jnp.zeros((cache_size, dim), jnp.float32))


def count_ids(cache: TTCache, ids: jax.Array, valid: jax.Array | None = None) -> TTCache:
    """``cache`` with 1 added to the count of the id of every valid position.

    ``ids``: int32 of any shape; ``valid``: bool of the same shape (``None``: all valid).
    The id ``EMPTY`` is never counted, nor is an id that finds neither its key nor a
    free slot within ``MAX_PROBES`` probes (module doc).
    """
    _check_cache(cache)
    ids, valid = _check_ids(ids, valid)
    keys, counts = _count(cache.keys, cache.counts, ids.ravel(), valid.ravel(),
                          jnp.ones(ids.size, jnp.int32))
    return dataclasses.replace(cache, keys=keys, counts=counts)


def cache_lookup(cache: TTCache, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(hit, location)``, each of the shape of ``ids``: is the id cached, and where.

    ``cache.rows[location]`` is the row of a hit. Where there is no hit, ``location`` is
    some position in ``[0, cache_size)`` (safe to gather, wrong to use): mask with
    ``hit``, e.g. ``jnp.where(hit, location, cache_size)`` for a scatter with
    ``mode="drop"``. ``EMPTY`` never hits.
    """
    _check_cache(cache)
    ids, _ = _check_ids(ids, None)
    return _lookup(cache.ids, ids)


def cache_populate(cache: TTCache,
                   row_fn: Callable[[jax.Array], jax.Array]) -> tuple[TTCache, jax.Array]:
    """Cache the ``cache_size`` most frequent ids; returns ``(new_cache, source)``.

    Selection: highest count first, ties to the smaller id; ids with count 0 are never
    selected, so with fewer counted ids the cache is padded with ``EMPTY``. The new
    ``ids`` are sorted ascending. Rows of ids that were already cached are kept (they
    are trained values); the others come from ``row_fn``.

    ``row_fn(ids: int32[cache_size]) -> [cache_size, dim]`` decompresses rows from the
    TT cores. It gets the whole new id vector, ``EMPTY`` entries included: clamp ids
    into your table's range before indexing (those rows are discarded and zeroed).

    ``source: int32[cache_size]``: for each new position, the old position its row came
    from, or -1 (a newly cached id or ``EMPTY``); carry per-row optimizer state with it.

    The hash table is rebuilt holding only the selected ids with their counts (FBTT
    drops the counts of uncached ids to make room for new ones). With ``hashtbl_size``
    close to ``cache_size`` a selected id may miss its slot within ``MAX_PROBES`` and
    lose its count (it stays cached until the next populate); another reason for ~2x.

    Pure and jit-able: call it inside a jitted step, or ``jax.jit(cache_populate,
    static_argnums=1)``.
    """
    _check_cache(cache)
    new_ids, new_counts, source = _select(cache)
    fresh = jnp.asarray(row_fn(new_ids))
    if fresh.shape != cache.rows.shape:
        raise ValueError(f"row_fn must return the rows of the {cache.cache_size} ids it is given, "
                         f"shape {tuple(cache.rows.shape)}; got shape {tuple(fresh.shape)}")
    new_cache = _rebuild(cache, new_ids, new_counts, source, fresh.astype(cache.rows.dtype))
    return new_cache, source


def cache_hit_rate(cache: TTCache, ids: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """float32 scalar: the fraction of valid positions whose id is cached (0 if none valid)."""
    _check_cache(cache)
    ids, valid = _check_ids(ids, valid)
    hit, _ = _lookup(cache.ids, ids)
    hits = jnp.sum(hit & valid, dtype=jnp.int32)
    total = jnp.sum(valid, dtype=jnp.int32)
    return (hits.astype(jnp.float32) / jnp.maximum(total, 1).astype(jnp.float32))


# ---------------------------------------------------------------- implementation


def _hash(ids: jax.Array, size: int) -> jax.Array:
    """Home slot of each id, uint32 in ``[0, size)``: multiply, fold the high bits down."""
    x = lax.bitcast_convert_type(ids, jnp.uint32) * _HASH_MULTIPLIER
    x = x ^ (x >> 16)
    return x % np.uint32(size)


def _probe(keys: jax.Array, ids: jax.Array, pending: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Finds or claims a slot for every pending id: ``(keys, slot, placed)``.

    Probe round k: each pending id looks at slot ``(h + k) % size``. Its own key there:
    placed. A free slot: every id looking at it offers itself by a scatter-min, the
    smallest wins and is placed (equal ids follow the same probe sequence in lockstep,
    so they win or lose together). Others go on, up to ``MAX_PROBES`` rounds; the loop
    stops early once nothing is pending. Slots are never freed, so an id already in the
    table is always found before any free slot of its probe sequence.
    """
    size = keys.shape[0]
    home = _hash(ids, size)

    def cond(state):
        k, _, _, pending = state
        return (k < MAX_PROBES) & jnp.any(pending)

    def body(state):
        k, keys, slot, pending = state
        s = ((home + k.astype(jnp.uint32)) % np.uint32(size)).astype(jnp.int32)
        here = keys[s]
        found = pending & (here == ids)
        free = pending & (here == EMPTY)
        keys = keys.at[jnp.where(free, s, size)].min(ids, mode="drop")
        won = free & (keys[s] == ids)
        now = found | won
        return k + 1, keys, jnp.where(now, s, slot), pending & ~now

    init = (jnp.int32(0), keys, jnp.zeros(ids.shape, jnp.int32), pending)
    _, keys, slot, left = lax.while_loop(cond, body, init)
    return keys, slot, pending & ~left


@jax.jit
def _count(keys, counts, ids, valid, weights):
    """Adds ``weights`` to the counts of the valid ids (inserting them): ``(keys, counts)``."""
    keys, slot, placed = _probe(keys, ids, valid & (ids != EMPTY))
    counts = counts.at[jnp.where(placed, slot, keys.shape[0])].add(weights, mode="drop")
    return keys, counts


@jax.jit
def _lookup(cached_ids, ids):
    pos = jnp.searchsorted(cached_ids, ids, side="left").astype(jnp.int32)
    pos = jnp.minimum(pos, cached_ids.shape[0] - 1)
    hit = (cached_ids[pos] == ids) & (ids != EMPTY)
    return hit, pos


@jax.jit
def _select(cache: TTCache):
    """The new ids (sorted, EMPTY-padded), their counts, and where each was cached before."""
    eligible = (cache.keys != EMPTY) & (cache.counts > 0)
    order = jnp.where(eligible, -cache.counts, 1)  # count desc; ineligible last
    order, keys, counts = lax.sort((order, cache.keys, cache.counts), num_keys=2)
    take = order[:cache.cache_size] < 0
    new_ids = jnp.where(take, keys[:cache.cache_size], EMPTY)
    new_counts = jnp.where(take, counts[:cache.cache_size], 0)
    new_ids, new_counts = lax.sort((new_ids, new_counts), num_keys=1)
    hit, pos = _lookup(cache.ids, new_ids)
    return new_ids, new_counts, jnp.where(hit, pos, -1)


@jax.jit
def _rebuild(cache: TTCache, new_ids, new_counts, source, fresh):
    kept = cache.rows[jnp.maximum(source, 0)]
    rows = jnp.where((source >= 0)[:, None], kept,
                     jnp.where((new_ids != EMPTY)[:, None], fresh, jnp.zeros_like(fresh)))
    keys, counts = _count(jnp.full_like(cache.keys, EMPTY), jnp.zeros_like(cache.counts),
                          new_ids, new_ids != EMPTY, new_counts)
    return TTCache(keys=keys, counts=counts, ids=new_ids, rows=rows)


def _check_cache(cache) -> None:
    if not isinstance(cache, TTCache):
        raise TypeError(f"cache must be a TTCache (from init_cache), got {type(cache).__name__}")


def _check_ids(ids, valid) -> tuple[jax.Array, jax.Array]:
    ids = jnp.asarray(ids)
    if ids.dtype != jnp.int32:
        raise TypeError(f"ids must be int32, got {ids.dtype}; cast with ids.astype(jnp.int32) after "
                        f"checking that they are in [0, {EMPTY}) (2**31 - 1 is EMPTY)")
    if valid is None:
        return ids, jnp.ones(ids.shape, jnp.bool_)
    valid = jnp.asarray(valid)
    if valid.dtype != jnp.bool_ or valid.shape != ids.shape:
        raise ValueError(f"valid must be a bool mask of the shape of ids {tuple(ids.shape)}; got "
                         f"{valid.dtype} of shape {tuple(valid.shape)}")
    return ids, valid
