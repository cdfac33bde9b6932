"""Dynamic-vocabulary tables in a collection (``EmbeddingBagConfig(dynamic=DynamicVocab())``):
their index and how a lookup maps raw ids to rows, shared by the unsharded collections
and ``jaxrec.parallel``'s sharded one (a public module for that reason; users meet it
through the collections).

The dynamic tables of a collection that share a ``_configs.dynamic_group_key`` are one
group: fused tables of ``num_embeddings`` rows (the slots) each, and one ``DynamicIndex``
variable holding their hash index (``jaxrec.ops.hash_table``: one bucket range per table,
``ranges``) and counters, so the whole group's ids are mapped by one call and looked up
by one. A lookup maps the raw ids to slots first:

* training (the collection's ``deterministic`` False, flax's ``model.train()``):
  ``find_or_insert``; the slots given a new id get a freshly drawn row and zeroed
  optimizer state (``reset_rows``) before the lookup reads them, so an evicted id's row
  and state are never inherited. The reset is a ``custom_vjp`` whose backward passes the
  fused update's tables through unchanged: the step's updated tables are the reset ones,
  updated. A step the guard skips keeps the reset rows and the new index together (the
  fused update is gated off, the reset is not), so they stay consistent.
* evaluation (``model.eval()``): ``find`` only; unknown ids get slot -1 and look up
  nothing (the group's lookup runs under bounds-check NONE, whose out-of-range ids add
  nothing: docs/bounds_check.md), and are counted.

Fresh rows are drawn like the table's initial rows (its bounds or ``init_fn``), from the
table's name, the fused step and the id alone (``fresh_rows``): a resumed run draws the
same, and so does a table sharded over devices (``jaxrec.parallel``), whose devices see
other batches of ids.

``shards``: the index holds one of ``shards`` bucket ranges of each table (a device's part
of a sharded table, ``hash_table.shard_of``), ``valid`` marking the ids of its ranges.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrec.fused import FusedEmbeddingTables
from jaxrec.ops import hash_table


class IndexState(NamedTuple):
    """The hash index of a group's dynamic tables (one bucket range per table, ``ranges``)
    and its counters since it was created, ``int32[tables]`` (a table's part: scalars)."""

    table: hash_table.HashTable
    inserted: jax.Array
    evicted: jax.Array
    failed: jax.Array
    """New ids left without a row (their bucket full of the batch's ids, or eviction "none")."""
    unknown: jax.Array
    """Ids looked up in evaluation that the index does not hold."""


COUNTERS = IndexState._fields[1:]


class DynamicIndex(nnx.Variable):
    """The ``IndexState`` of a group's dynamic tables: state, not trained; checkpointed
    with the model."""


def check_collection(configs, optimizer) -> None:
    """Refuses dynamic tables in a collection without a fused optimizer (unsharded and sharded)."""
    dynamic = [c.name for c in configs if getattr(c, "dynamic", None) is not None]
    if dynamic and optimizer is None:
        raise ValueError(f"tables {dynamic} are dynamic vocabularies, whose new ids' rows and optimizer "
                         "state are reset inside the step: give the collection a fused optimizer "
                         "(optimizer=RowWiseAdagrad(...) etc.)")


def check_dynamic_table(table: str, dynamic_tables, collection: str) -> None:
    """Refuses ``table`` where a dynamic table is needed (``dynamic_changes``)."""
    if table not in dynamic_tables:
        raise ValueError(f"{table!r} is not a dynamic table of collection {collection!r}; its dynamic "
                         f"tables: {sorted(dynamic_tables)}")


def ranges(configs, shards: int = 1) -> tuple[hash_table.Range, ...]:
    """Each table's bucket range in the group's index: its buckets one after the other (a
    device's part of a sharded table: ``1 / shards`` of them, ``hash_table.shard_of``)."""
    out, first = [], 0
    for c in configs:
        buckets = c.num_embeddings // c.dynamic.bucket_size
        out.append(hash_table.Range(first, buckets // shards, buckets))
        first += buckets // shards
    return tuple(out)


def new_index(configs) -> IndexState:
    dtype = jnp.int64 if jax.config.jax_enable_x64 else jnp.int32
    capacity = sum(c.num_embeddings for c in configs)
    table = hash_table.create(capacity, bucket_size=configs[0].dynamic.bucket_size, dtype=dtype)
    return IndexState(table, *(jnp.zeros((len(configs),), jnp.int32) for _ in COUNTERS))


def table_index(state: IndexState, configs, t: int) -> IndexState:
    """Table ``t``'s own index (its bucket range, its counters) in a group's index."""
    r = ranges(configs)[t]
    part = hash_table.HashTable(*(x[r.first:r.first + r.local] for x in state.table))
    return IndexState(part, *(getattr(state, f)[t] for f in COUNTERS))


def group_index(parts: list[IndexState]) -> IndexState:
    """The group's index of its tables' own indices (``table_index``'s inverse)."""
    table = hash_table.HashTable(*(jnp.concatenate(xs) for xs in zip(*(p.table for p in parts))))
    return IndexState(table, *(jnp.stack([jnp.asarray(getattr(p, f)).reshape(()) for p in parts])
                               for f in COUNTERS))


def slots_for_training(index: DynamicIndex, tables: FusedEmbeddingTables, configs, ids, valid,
                       table_of=None, *, shards: int = 1):
    """``(slots, tables)``: the ids' slots, as rows of the group (inserting new ids), and
    the tables with the new ids' rows drawn anew; the index is updated. ``table_of``: each
    id's table in ``configs`` (default: the first)."""
    state = index.get_value()
    bounds = ranges(configs, shards)
    slots, table, info = hash_table.find_or_insert(
        state.table, _ids(ids, state), tables.step, policy=configs[0].dynamic.eviction, valid=valid,
        table_of=table_of, ranges=bounds)
    index.set_value(IndexState(table, state.inserted + info.inserted, state.evicted + info.evicted,
                               state.failed + info.failed, state.unknown))
    # the id now held by each fresh slot, and its table (entries past the fresh ones: out
    # of range, not reset)
    fresh = info.fresh_slots
    new_ids = table.keys.reshape(-1)[jnp.minimum(fresh, table.capacity - 1)]
    fresh_table = hash_table.range_of_slots(fresh, bounds, table.keys.shape[1])
    return slots, reset_rows(tables, fresh, fresh_rows(configs, fresh_table, tables.step, new_ids))


def fresh_rows(configs, table_of: jax.Array, step, ids: jax.Array) -> jax.Array:
    """``float32[N, dim]``: the new rows of ``ids`` (of tables ``table_of`` among
    ``configs``) at fused step ``step``. A row depends on the table, the step and the id
    alone, not on the batch it came in nor on the device that holds it (a sharded table
    draws what the whole table draws).

    * Default init (uniform in the table's bounds): each value from a counter-based hash
      (murmur3's fmix32) of (crc32 of the name, step, the id's 32-bit words, column):
      elementwise integer work, where a threefry key per row cost most of the step.
    * ``init_fn`` (a group of one table, ``_configs.dynamic_group_key``): ``init_fn`` with the key
      ``fold_in(fold_in(key(crc32(name)), step), id)`` (an int64 id folded in as its two
      32-bit words, low first), one row per key.
    """
    names = [zlib.crc32(c.name.encode()) for c in configs]
    words = jax.lax.bitcast_convert_type(ids, jnp.uint32).reshape(ids.shape[0], -1)
    if configs[0].init_fn is None:
        bounds = np.asarray([c.init_bounds() for c in configs], np.float32)
        low, high = jnp.asarray(bounds[:, 0])[table_of], jnp.asarray(bounds[:, 1])[table_of]
        name = jnp.asarray(names, jnp.uint32)[table_of]
        h = _fmix32(name ^ _fmix32(jnp.asarray(step).astype(jnp.uint32)))
        for w in range(words.shape[1]):
            h = _fmix32(h ^ _fmix32(words[:, w] + jnp.uint32(0x9E3779B9 * (w + 1) % 2**32)))
        column = jnp.arange(configs[0].embedding_dim, dtype=jnp.uint32) * jnp.uint32(0x85EBCA77)
        bits = _fmix32(h[:, None] ^ column[None, :])
        unit = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)  # [0, 1)
        return low[:, None] + (high - low)[:, None] * unit
    base = jax.random.fold_in(jax.random.key(names[0]), step)

    def one(word):
        key = base
        for w in word:
            key = jax.random.fold_in(key, w)
        return configs[0].init(key, rows=1)[0]

    return jax.vmap(one)(words)


def _fmix32(h: jax.Array) -> jax.Array:
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def slots_for_eval(index: DynamicIndex, configs, ids, valid, table_of=None, *, shards: int = 1):
    """The ids' slots (rows of the group), -1 for ids the index does not hold (counted as
    unknown, per table)."""
    state = index.get_value()
    slots = hash_table.find(state.table, _ids(ids, state), table_of=table_of, ranges=ranges(configs, shards))
    table_of = jnp.zeros(ids.shape, jnp.int32) if table_of is None else table_of
    unknown = hash_table.count_per_range(valid & (slots < 0), table_of, len(configs))
    index.set_value(state._replace(unknown=state.unknown + unknown.reshape(state.unknown.shape)))
    return jnp.where(valid, slots, -1)


def to_portable(state: IndexState) -> dict[str, jax.Array]:
    """A table's index in the portable form (``portable_tables``' ``"index"`` entry): the
    hash table's arrays and the counters, by name."""
    return {**state.table._asdict(), **{f: getattr(state, f) for f in COUNTERS}}


def from_portable(given) -> IndexState:
    """``to_portable``'s inverse."""
    return IndexState(hash_table.HashTable(*(jnp.asarray(given[f]) for f in hash_table.HashTable._fields)),
                      *(jnp.asarray(given[f]) for f in COUNTERS))


def statistics(state: IndexState) -> dict[str, jax.Array]:
    """``size``, ``load_factor`` and the counters of an index."""
    return {**hash_table.stats(state.table), "inserted": state.inserted, "evicted": state.evicted,
            "failed_inserts": state.failed, "unknown_lookups": state.unknown}


def _ids(ids, state: IndexState):
    dtype = state.table.keys.dtype
    if jnp.dtype(ids.dtype).itemsize > jnp.dtype(dtype).itemsize:
        raise ValueError(f"the dynamic table's index holds {dtype} ids but the KJT's are {ids.dtype}; "
                         "create the collection with jax_enable_x64 on for int64 ids")
    return ids.astype(dtype)


@jax.custom_vjp
def reset_rows(tables: FusedEmbeddingTables, slots: jax.Array, rows: jax.Array) -> FusedEmbeddingTables:
    """``tables`` (one table) with rows ``slots`` set to ``rows`` and their optimizer state
    zeroed; slots out of range are skipped. Its backward passes the tables' cotangent (the
    fused update's new tables) through unchanged."""
    return _reset(tables, slots, rows)


def _reset(tables, slots, rows):
    num_rows = sum(tables.layout.rows)  # the group's tables have one width (dynamic_group_key)
    weights = _set_rows(tables.weights, num_rows, slots, rows.astype(tables.weights.dtype))
    fields = {}
    for name in tables.config.state_names:
        buf = getattr(tables.state, name)
        width = 1 if name in tables.config.state_type.row_fields else buf.size // num_rows
        fields[name] = _set_rows(buf, num_rows, slots, jnp.zeros((slots.shape[0], width), buf.dtype))
    return dataclasses.replace(tables, weights=weights, state=tables.state._replace(**fields))


def _set_rows(flat: jax.Array, num_rows: int, slots: jax.Array, values: jax.Array) -> jax.Array:
    """``flat`` (a ``[num_rows * width]`` buffer) with rows ``slots`` set to ``values``
    (``[N, width]``); slots out of range are skipped. One scatter of ``width``-long windows
    on the flat buffer itself: through a ``[num_rows, width]`` reshape XLA copied the whole
    table (twice) instead of updating it in place."""
    width = values.shape[1]
    if (num_rows + 1) * width < 2**31:
        index = jnp.int32
    elif jax.config.jax_enable_x64:
        index = jnp.int64
    else:  # element offsets need int64: through the reshape, at the cost of the copies
        return flat.reshape(num_rows, width).at[slots].set(values, mode="drop").reshape(-1)
    slots = jnp.where((slots >= 0) & (slots < num_rows), slots, num_rows).astype(index)
    numbers = jax.lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(),
                                              scatter_dims_to_operand_dims=(0,))
    return jax.lax.scatter(flat, (slots * width)[:, None], values.astype(flat.dtype), numbers,
                           mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def _reset_forward(tables, slots, rows):
    return _reset(tables, slots, rows), (slots, rows)


def _reset_backward(residuals, cotangent):
    slots, rows = residuals
    return cotangent, np.zeros(slots.shape, jax.dtypes.float0), jnp.zeros_like(rows)


reset_rows.defvjp(_reset_forward, _reset_backward)
