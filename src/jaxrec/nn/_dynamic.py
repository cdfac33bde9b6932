"""Dynamic-vocabulary tables in a collection (``EmbeddingBagConfig(dynamic=DynamicVocab())``).

Each such table is a group of its own: a fused table of ``num_embeddings`` rows (the slots)
and a ``DynamicIndex`` variable holding its hash index (``jaxrec.ops.hash_table``) and
counters. A lookup maps the raw ids to slots first:

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

Fresh rows are drawn like the table's initial rows (its bounds or ``init_fn``), each from
a key of the table's name, the fused step and the id alone (``fresh_rows``): a resumed run
draws the same, and so does a table sharded over devices (``jaxrec.parallel``), whose
devices see other batches of ids.

``shards``: the index is one of ``shards`` bucket ranges of the table (a device's part of a
sharded table, ``hash_table.shard_of``), ``valid`` marking the ids of its range.
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
    """A dynamic table's hash index and its counters since it was created."""

    table: hash_table.HashTable
    inserted: jax.Array
    evicted: jax.Array
    failed: jax.Array
    """New ids left without a row (their bucket full of the batch's ids, or eviction "none")."""
    unknown: jax.Array
    """Ids looked up in evaluation that the index does not hold."""


class DynamicIndex(nnx.Variable):
    """The ``IndexState`` of a dynamic table: state, not trained; checkpointed with the model."""


def new_index(config) -> IndexState:
    dtype = jnp.int64 if jax.config.jax_enable_x64 else jnp.int32
    zero = jnp.zeros((), jnp.int32)
    table = hash_table.create(config.num_embeddings, bucket_size=config.dynamic.bucket_size, dtype=dtype)
    return IndexState(table, zero, zero, zero, zero)


def slots_for_training(index: DynamicIndex, tables: FusedEmbeddingTables, config, ids, valid, *,
                       shards: int = 1):
    """``(slots, tables)``: the ids' slots (inserting new ids) and the tables with the new
    ids' rows drawn anew; the index is updated."""
    state = index.get_value()
    slots, table, info = hash_table.find_or_insert(
        state.table, _ids(ids, state), tables.step, policy=config.dynamic.eviction, valid=valid,
        shards=shards)
    index.set_value(IndexState(table, state.inserted + info.inserted, state.evicted + info.evicted,
                               state.failed + info.failed, state.unknown))
    # the id now held by each fresh slot (entries past the fresh ones: out of range, not reset)
    new_ids = table.keys.reshape(-1)[jnp.minimum(info.fresh_slots, table.capacity - 1)]
    return slots, reset_rows(tables, info.fresh_slots, fresh_rows(config, tables.step, new_ids))


def fresh_rows(config, step, ids: jax.Array) -> jax.Array:
    """``float32[N, dim]``: the new rows of ``ids`` at fused step ``step``, each drawn like
    the table's initial rows from ``fold_in(fold_in(key(crc32(name)), step), id)`` (an int64
    id folded in as its two 32-bit words, low first): a row depends on the id, not on the
    batch it came in nor on the device that holds it."""
    base = jax.random.fold_in(jax.random.key(zlib.crc32(config.name.encode())), step)
    words = jax.lax.bitcast_convert_type(ids, jnp.uint32).reshape(ids.shape[0], -1)

    def one(word):
        key = base
        for w in word:
            key = jax.random.fold_in(key, w)
        return config.init(key, rows=1)[0]

    return jax.vmap(one)(words)


def slots_for_eval(index: DynamicIndex, ids, valid, *, shards: int = 1):
    """The ids' slots, -1 for ids the index does not hold (counted as unknown)."""
    state = index.get_value()
    slots = hash_table.find(state.table, _ids(ids, state), shards=shards)
    unknown = jnp.sum(valid & (slots < 0), dtype=jnp.int32)
    index.set_value(state._replace(unknown=state.unknown + unknown))
    return jnp.where(valid, slots, -1)


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
    num_rows, dim = tables.layout.rows[0], tables.layout.dims[0]
    weights = tables.weights.reshape(num_rows, dim).at[slots].set(
        rows.astype(tables.weights.dtype), mode="drop").reshape(-1)
    fields = {}
    for name in tables.config.state_names:
        buf = getattr(tables.state, name)
        shape = buf.shape if name in tables.config.state_type.row_fields else (num_rows, -1)
        fields[name] = buf.reshape(shape).at[slots].set(0, mode="drop").reshape(-1)
    return dataclasses.replace(tables, weights=weights, state=tables.state._replace(**fields))


def _reset_forward(tables, slots, rows):
    return _reset(tables, slots, rows), (slots, rows)


def _reset_backward(residuals, cotangent):
    slots, rows = residuals
    return cotangent, np.zeros(slots.shape, jax.dtypes.float0), jnp.zeros_like(rows)


reset_rows.defvjp(_reset_forward, _reset_backward)
