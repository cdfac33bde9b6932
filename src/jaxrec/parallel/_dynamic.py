"""Dynamic-vocabulary tables sharded by key hash over a mesh (``EmbeddingBagConfig(dynamic=)``).

A dynamic table of ``num_embeddings`` slots (``num_buckets`` buckets of S) is ROW_WISE in
D equal blocks, one per device in order. Block d is the slots of buckets
``[d * num_buckets / D, (d + 1) * num_buckets / D)``, and device d's part of the hash index
(its range ``Range(0, nb / D, nb)``, ``hash_table.find_or_insert``) places every id of its
range where the whole table places it: at slot ``d * capacity / D + s`` (tests/test_hash_table.py). The sharded
table is the unsharded one, cut in blocks::

    # capacity 16, bucket_size 2 (8 buckets), 4 devices: R = 4 rows per device
    # device 0: buckets 0-1, slots 0:4    device 1: buckets 2-3, slots 4:8    ...
    # id -> shard_of(id, 8, 4) = bucket(id) // 2: the device that maps it and holds its row

Every device sees every device's ids (the row-wise path's ``all_gather``), maps the ids it
owns with its index part (training: ``find_or_insert`` with the fused step, fresh rows drawn
per id as the unsharded table draws them, ``jaxrec.nn.dynamic.fresh_rows``; evaluation:
``find``) and gives ``_dist.group_input`` their global slots in place of the ids. The
device's row range ``[d * R, (d + 1) * R)`` then keeps them as for any row-wise table; the
ids it does not own, and refused or unknown ones (-1), fall outside it. Pooled partial
sums return by the row-wise ``psum_scatter``; the fused backward trains the block in place.

The index is a ``DynamicIndex`` variable whose arrays are global and sharded over the axis
on their first dimension: keys, digests, scores, seen ``[num_buckets, S]`` and the counters
``[D]`` (each device counts its own ids). Statistics, ``dynamic_changes`` and the portable
form read the global arrays: the whole table's index, counters summed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrec._mesh import to_host
from jaxrec.nn.dynamic import COUNTERS, IndexState, new_index, slots_for_eval, slots_for_training
from jaxrec.nn.dynamic import to_portable as index_to_portable
from jaxrec.ops import hash_table
from jaxrec.parallel._dist import Ids


def check(config, n: int) -> None:
    """Refuses a dynamic table whose buckets do not split evenly over ``n`` devices."""
    buckets = config.num_embeddings // config.dynamic.bucket_size
    if buckets % n:
        raise ValueError(
            f"table {config.name!r} is a dynamic vocabulary of {buckets} buckets (num_embeddings="
            f"{config.num_embeddings} / bucket_size={config.dynamic.bucket_size}), which must be a "
            f"multiple of the {n} devices: each device holds an equal range of buckets. Make "
            f"num_embeddings a multiple of {n * config.dynamic.bucket_size}")


def sharded_index(config, mesh, axis: str, portable: Mapping[str, np.ndarray] | None = None) -> IndexState:
    """The global index of a dynamic table on ``mesh``: empty, or from its portable form
    (``to_portable``, or an unsharded collection's), whose counters device 0 takes."""
    empty = jax.tree.map(np.asarray, new_index([config]).table)  # host arrays: placed from every process
    table = empty
    if portable is not None:
        table = hash_table.HashTable(*(np.asarray(portable[f]) for f in hash_table.HashTable._fields))
        wrong = [f for f, x, e in zip(table._fields, table, empty) if x.shape != e.shape or x.dtype != e.dtype]
        if wrong:
            raise ValueError(f"table {config.name!r}: the portable index's {wrong} do not match this "
                             f"table's index of shape {empty.keys.shape} ({empty.keys.dtype} ids)")
    counters = {f: np.zeros(mesh.shape[axis], np.int32) for f in COUNTERS}
    for f in COUNTERS if portable is not None else ():
        counters[f][0] = int(np.sum(portable[f]))
    sharding = NamedSharding(mesh, P(axis))
    return jax.tree.map(lambda x: jax.device_put(x, sharding), IndexState(table, **counters))


def totals(state: IndexState) -> IndexState:
    """The index with its per-device counters summed (the unsharded index's form)."""
    return state._replace(**{f: jnp.sum(getattr(state, f), dtype=jnp.int32) for f in COUNTERS})


def to_portable(state: IndexState) -> dict[str, np.ndarray]:
    """The portable form of a sharded index: the whole table's arrays, counters summed (what
    an unsharded collection's ``portable_tables`` gives under the table's ``"index"``)."""
    return index_to_portable(jax.tree.map(to_host, totals(state)))


def owned(ids: Ids, features: Sequence[int], num_buckets: int, me, n: int) -> jax.Array:
    """``bool[sources, C]``: the positions of ``ids`` holding an id of one of ``features``
    whose bucket lies in device ``me``'s range."""
    values, lengths = ids.values, ids.lengths
    counts = lengths.sum(-1)                                   # [sources, F]
    ends = jnp.cumsum(counts, axis=1)
    position = jnp.arange(values.shape[1], dtype=ends.dtype)[None, :]
    inside = jnp.zeros(values.shape, bool)
    for f in features:
        inside |= (position >= ends[:, f:f + 1] - counts[:, f:f + 1]) & (position < ends[:, f:f + 1])
    return inside & (hash_table.shard_of(values, num_buckets, n) == me)


def map_ids(index, tables, config, ids: Ids, features: Sequence[int], me, n: int, *,
            training: bool):
    """``(ids, tables)``: ``ids`` with each id that device ``me`` owns replaced by its global
    slot (-1: refused or unknown) and every other id by -1, and the device's tables with the
    rows of newly inserted ids drawn anew (training). Updates the device's index part."""
    num_buckets = config.num_embeddings // config.dynamic.bucket_size
    mine = owned(ids, features, num_buckets, me, n)
    values, valid = ids.values.ravel(), mine.ravel()
    if training:
        slots, tables = slots_for_training(index, tables, [config], values, valid, shards=n)
    else:
        slots = slots_for_eval(index, [config], values, valid, shards=n)
    rows = config.num_embeddings // n
    slots = jnp.where(valid & (slots >= 0), slots + me * rows, -1)
    return Ids(slots.reshape(ids.values.shape).astype(ids.values.dtype), ids.lengths, ids.weights), tables


def dynamic_positions(values, offsets, features: Sequence[int], batch: int) -> jax.Array:
    """``bool[C]``: the positions of a device's KJT (feature-major ``offsets``) that hold ids
    of ``features`` (raw ids, which the bounds check must leave alone)."""
    position = jnp.arange(values.shape[0], dtype=offsets.dtype)
    inside = jnp.zeros(values.shape, bool)
    for f in features:
        inside |= (position >= offsets[f * batch]) & (position < offsets[(f + 1) * batch])
    return inside
