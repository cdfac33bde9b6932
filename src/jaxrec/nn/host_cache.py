"""Host-cached tables in a collection (``EmbeddingBagConfig(placement="host_cached")``):
all rows and their optimizer state in host memory, a cache of some rows in device
memory, shared by the collections (docs/host_memory.md).

The host-cached tables of a collection that share a ``_configs.host_cache_group_key`` are
one group, held in three places::

    FusedTables   the cache: fused tables of cache_rows rows per table (device memory);
                  the lookup and the fused update run on it as on any table
    HostCache     .index: a hash index (jaxrec.ops.hash_table, buckets of 128 slots,
                  one bucket range per table) of row id -> cache row
                  .rows: fused tables of num_embeddings rows per table whose weights
                  and optimizer-state buffers live in host memory ("pinned_host")

A lookup first maps each id to a cache row with ``find_or_insert`` (LRU: last step seen,
or LFU: times seen). Each cache row given a new id is then exchanged with the host by the
row-copy handler (``jaxrec.ops.host_cache.exchange_rows``): the evicted id's row and
optimizer state are written back to its host row, the new id's are loaded. The lookup and the fused
update then read and write the cache only. So the cache row of an id holds its current
row and state for as long as the id is cached, and the host row is current otherwise:
``flushed_rows`` (checkpoints, ``split_embedding_weights``) overlays the one on the other.

* **Rows in use are never evicted.** The index never gives a new id a slot that an id of
  the same batch holds. An id left without a cache row (its bucket's 128 slots all held by
  ids of the batch) is an error: the step updates nothing and raises (inside a train step,
  by the step guard; outside, when the computation runs), naming the table and the cache
  size to raise. Size the cache to at least twice a batch's distinct rows of the table.
* **Bounds.** The raw ids are checked against ``num_embeddings`` under the collection's
  bounds-check mode before the index sees them; an id out of range (NONE) gets no cache row
  and looks up nothing, so no id ever reaches a host row outside its table.
* **Step counter.** The cache's fused tables count the updates (Adam's bias correction,
  LRU's score); the host copy's ``step`` is not used.

Prefetch (``prefetching``; a train step's ``prefetch=``): after its own batch, a lookup
places the next batch's ids with a second ``find_or_insert(..., keep_seen=True)``, which
evicts no row seen at this step (the batch in flight's), and exchanges their rows in the
background (``start_exchange``): the copies touch only rows the step does not use. The
fused update's new cache waits for them (``_through``'s backward, ``wait_copies``). A
prefetched id left without a row fails nothing: its own step caches it. Measured on the
H100's DLRM, prefetch made the step slower (docs/host_memory.md, "Prefetch").
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrec import _step_guard
from jaxrec.fused import FusedEmbeddingTables
from jaxrec.nn._configs import CACHE_BUCKET
from jaxrec.nn.dynamic import COUNTERS, IndexState
from jaxrec.nn.host_tables import buffers, new_host_tables, place_in_host_memory, with_buffers
from jaxrec.ops import hash_table
from jaxrec.ops.host_cache import exchange_rows, start_exchange, wait_copies
from jaxrec.ops.tbe_layout import TableLayout

BUCKET_SIZE = CACHE_BUCKET
"""Slots per bucket of a cache's index (HierarchicalKV's bucket)."""


class CacheState(NamedTuple):
    """A host-cached group's index (row id -> cache row) and its tables in host memory."""

    index: IndexState
    rows: FusedEmbeddingTables
    """The full tables; weights and optimizer-state buffers in host memory."""


class HostCache(nnx.Variable):
    """The ``CacheState`` of a group of host-cached tables: state, not trained;
    checkpointed with the model."""


_UPCOMING: contextvars.ContextVar[tuple] = contextvars.ContextVar("jaxrec_upcoming_features", default=())


@contextlib.contextmanager
def prefetching(features):
    """Inside, the lookups of host-cached tables also cache the rows of ``features`` (the
    next batch's ``KeyedJaggedTensor``, or a sequence of them: each collection takes the
    first that holds its features), loaded in the background while the step computes
    (module doc, "Prefetch"). ``jaxrec.nn.make_train_step``'s ``prefetch=`` enters it
    around the loss; a collection outside a fused train step must not be called inside."""
    features = tuple(features) if isinstance(features, (list, tuple)) else (features,)
    token = _UPCOMING.set(features)
    try:
        yield
    finally:
        _UPCOMING.reset(token)


def upcoming_features(names: Sequence[str]):
    """The prefetched KJT that holds every feature of ``names``, or None (``prefetching``)."""
    return next((f for f in _UPCOMING.get() if set(names) <= set(f.keys())), None)


def check_collection(configs, optimizer, placements=None) -> None:
    """Refuses tables in host memory in a collection without a fused optimizer.
    ``placements``: each table's (default: its config's; a sharding plan may set them)."""
    placements = [getattr(c, "placement", "device") for c in configs] if placements is None else placements
    placed = [c.name for c, p in zip(configs, placements) if p != "device"]
    if placed and optimizer is None:
        raise ValueError(f"tables {placed} are placed in host memory, whose rows move to the device inside the "
                         "step together with their optimizer state: give the collection a fused optimizer "
                         "(optimizer=RowWiseAdagrad(...) etc.)")


def host_layout(layout: TableLayout, configs) -> TableLayout:
    """The group's full tables (``num_embeddings`` rows each) in the cache layout's order."""
    return dataclasses.replace(layout, rows=tuple(c.num_embeddings for c in configs))


def ranges(configs) -> tuple[hash_table.Range, ...]:
    """Each table's bucket range of the group's index: its cache rows, one after the other."""
    out, first = [], 0
    for c in configs:
        buckets = c.cache_size() // BUCKET_SIZE
        out.append(hash_table.Range(first, buckets, buckets))
        first += buckets
    return tuple(out)


def new_state(cache: FusedEmbeddingTables, configs, draw) -> CacheState:
    """A group's empty index and its full tables in host memory: table ``t`` is ``draw(t)``
    (float32 ``[rows, dim]``), the optimizer state zero. The device holds one drawn table
    at a time, never the group."""
    layout = host_layout(cache.layout, configs)
    if sum(layout.rows) >= 2**31:
        raise ValueError(f"host-cached tables {[c.name for c in configs]} share one group of "
                         f"{sum(layout.rows)} rows; a group holds fewer than 2**31: give some of them "
                         "another cache_policy (a group of their own)")
    capacity = sum(c.cache_size() for c in configs)
    index = IndexState(hash_table.create(capacity, bucket_size=BUCKET_SIZE),
                       *(jnp.zeros((len(configs),), jnp.int32) for _ in COUNTERS))
    rows = new_host_tables(cache, layout, draw, cache.name + ".host")
    return CacheState(index, rows)


def cache_rows_for(var: HostCache, cache: FusedEmbeddingTables, configs, ids, valid, table_of=None,
                   upcoming=None):
    """``(rows, cache)``: each id's row of the group's cache (-1 where ``valid`` is False),
    and the cache with the rows of newly cached ids loaded; the index and the host copy
    are updated (module doc). ``table_of``: each id's table in ``configs`` (default: the
    first); the ids must lie in their tables.

    ``upcoming``: ``(ids, valid, table_of)`` of the next batch, prefetched: its rows are
    cached too, loaded in the background while the step computes, and the returned
    cache's fused update waits for them (module doc, "Prefetch")."""
    state = var.get_value()
    bounds = ranges(configs)
    policy = configs[0].cache_policy
    index = state.index
    slots, table, info = hash_table.find_or_insert(index.table, ids.astype(index.table.keys.dtype), cache.step,
                                                   policy=policy, valid=valid, table_of=table_of, ranges=bounds)
    _report_overflow(info.failed, configs)
    sizes = dict(cache_num_rows=sum(cache.layout.rows), host_num_rows=sum(state.rows.layout.rows))
    new_cache, new_host = exchange_rows(jax.lax.stop_gradient(buffers(cache)), buffers(state.rows),
                                        *_exchanged(index.table, table, info, state.rows.layout, bounds), **sizes)
    counts = (info.inserted, info.evicted, info.failed)
    in_flight = ()
    if upcoming is not None:  # this batch's rows (seen at this step) stay; the next batch's may
        # fail to find one (a step does not fail for it: its own step retries)
        up_ids, up_valid, up_table_of = upcoming
        before = table
        _, table, up = hash_table.find_or_insert(before, up_ids.astype(before.keys.dtype), cache.step, policy=policy,
                                                 valid=up_valid, table_of=up_table_of, ranges=bounds, keep_seen=True)
        new_cache, new_host, in_flight = start_exchange(
            new_cache, new_host, *_exchanged(before, table, up, state.rows.layout, bounds), **sizes)
        counts = tuple(a + b for a, b in zip(counts, (up.inserted, up.evicted, up.failed)))
    var.set_value(CacheState(IndexState(table, *(a + b for a, b in zip(index[1:4], counts)), index.unknown),
                             with_buffers(state.rows, new_host)))
    return slots, _through(cache, with_buffers(cache, new_cache), in_flight)


def _exchanged(old: hash_table.HashTable, new: hash_table.HashTable, info: hash_table.InsertInfo,
               host: TableLayout, bounds) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(cache_rows, evict_rows, load_rows)`` of ``exchange_rows`` for what one
    ``find_or_insert`` did (``old`` -> ``new``): each newly cached id's slot, the host row
    of the id it evicted (if any, else -1) and its own host row; -1 past the new ids."""
    fresh = info.fresh_slots
    is_fresh = fresh < new.capacity
    at = jnp.minimum(fresh, new.capacity - 1)
    host_first = jnp.asarray(host.row_offsets, jnp.int32)[hash_table.range_of_slots(at, bounds, BUCKET_SIZE)]
    evicting = is_fresh & (old.digests.reshape(-1)[at] != 0)
    evict = jnp.where(evicting, host_first + old.keys.reshape(-1)[at].astype(jnp.int32), -1)
    load = jnp.where(is_fresh, host_first + new.keys.reshape(-1)[at].astype(jnp.int32), -1)
    return jnp.where(is_fresh, fresh, -1), evict, load


@jax.custom_vjp
def _through(tables: FusedEmbeddingTables, exchanged: FusedEmbeddingTables, in_flight) -> FusedEmbeddingTables:
    """``exchanged``, whose backward hands the cotangent (the fused update's new tables)
    to ``tables``: the step's updated cache is the exchanged one, updated. With rows
    copied in the background (``in_flight``), the new tables are handed on once the
    copies are done: whatever runs after the step sees them."""
    return exchanged


def _through_forward(tables, exchanged, in_flight):
    return exchanged, in_flight


def _through_backward(in_flight, cotangent):
    weights, *rest = buffers(cotangent)
    done = with_buffers(cotangent, [wait_copies(weights, in_flight), *rest])
    return done, jax.tree.map(_zero_cotangent, cotangent), jax.tree.map(_zero_cotangent, in_flight)


def _zero_cotangent(x):
    if x.dtype == jax.dtypes.float0 or not jnp.issubdtype(x.dtype, jnp.inexact):
        return np.zeros(x.shape, jax.dtypes.float0)
    return jnp.zeros_like(x)


_through.defvjp(_through_forward, _through_backward)


def _report_overflow(failed: jax.Array, configs) -> None:
    """An id without a cache row fails the step (module doc)."""
    names = [c.name for c in configs]
    sizes = [c.cache_size() for c in configs]
    report = jnp.concatenate([jnp.sum(failed, dtype=jnp.int32)[None], failed.astype(jnp.int32)])
    _step_guard.report_fatal(report, _OverflowMessage(tuple(names), tuple(sizes)))


@dataclasses.dataclass(frozen=True)
class _OverflowMessage:
    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def __call__(self, total, *per_table):
        worst = int(np.argmax(per_table))
        return (f"host-cached table {self.names[worst]!r}: {per_table[worst]} distinct ids of one batch found no "
                f"row in its cache of {self.sizes[worst]} rows (a bucket of {BUCKET_SIZE} cache rows was full of "
                f"the batch's own ids; {total} such ids in all tables {list(self.names)}). Raise the table's "
                "cache_rows (or cache_load_factor) to at least twice a batch's distinct ids of the table.")


def flushed_rows(state: CacheState, cache: FusedEmbeddingTables, configs) -> dict[str, np.ndarray]:
    """``{"weights": ..., state name: ...}``: the group's full flat buffers (NumPy), the
    cached rows written over their host rows; nothing is changed."""
    table, layout = state.index.table, state.rows.layout
    held = np.flatnonzero(np.asarray(table.digests).reshape(-1) != 0)
    keys = np.asarray(table.keys).reshape(-1)[held].astype(np.int64)
    slot_table = hash_table.range_of_slots(held, ranges(configs), BUCKET_SIZE)
    host_rows = np.asarray(layout.row_offsets, np.int64)[slot_table] + keys
    names = ["weights", *cache.config.state_names]
    out = {}
    for name, host, cached in zip(names, buffers(state.rows), buffers(cache)):
        full = np.array(host).reshape(sum(layout.rows), -1)
        full[host_rows] = np.asarray(cached).reshape(sum(cache.layout.rows), -1)[held]
        out[name] = full.reshape(-1)
    return out


def full_tables(state: CacheState, cache: FusedEmbeddingTables, configs) -> FusedEmbeddingTables:
    """The group's full tables as NumPy buffers (``flushed_rows``), with the cache's step."""
    flushed = flushed_rows(state, cache, configs)
    rows = dataclasses.replace(state.rows, state=state.rows.state._replace(step=np.asarray(cache.step)))
    return with_buffers(rows, list(flushed.values()))


def stored(state: CacheState, full: FusedEmbeddingTables) -> CacheState:
    """``state`` holding the full tables ``full`` in host memory, with its cache emptied (the
    index forgets every row; its counters stay)."""
    table = state.index.table
    empty = hash_table.create(table.capacity, bucket_size=BUCKET_SIZE, dtype=table.keys.dtype)
    rows = with_buffers(state.rows, [place_in_host_memory(np.asarray(b)) for b in buffers(full)])
    return CacheState(state.index._replace(table=empty), rows)


def statistics(state: CacheState, configs) -> dict[str, dict[str, jax.Array]]:
    """``{table: {size, load_factor, inserted, evicted}}``: the rows cached now, their share of
    the cache, and since the collection was created the rows loaded into it (misses) and
    written back out of it."""
    out = {}
    for t, (c, r) in enumerate(zip(configs, ranges(configs))):
        part = hash_table.HashTable(*(x[r.first:r.first + r.local] for x in state.index.table))
        out[c.name] = {**hash_table.stats(part), "inserted": state.index.inserted[t],
                       "evicted": state.index.evicted[t]}
    return out
