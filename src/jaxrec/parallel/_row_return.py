"""Bounded bags pooled where they are asked, from distinct rows that their owners send back.

The dense paths (``_dist.assemble``) send pooled results: a row-wise device reduce-scatters
partial sums of the whole global batch, a table-wise device all-to-alls its slots' bags,
``[N * B, S * D]`` per device either way: one row per (sample, slot), however few ids the
bags hold and however often they repeat. When every feature of a group has a
``max_ids_per_bag`` bound, each device can instead ask the owners for the distinct rows
that its own bags read, and pool its bags itself::

    requester i   the ids of each output slot (``OutputSlots``), each with its owner o and
                  its virtual row v there; sorted by (o, v): one request per distinct
                  (o, v), the first K of each owner                -> ids [N (owner), K]
                  all_to_all        -> owner j receives [N (source), K] virtual rows
    owner j       one lookup of N * K single-id bags               -> [N * K, D]
                  all_to_all        -> requester i receives [N (owner), K, D]
    requester i   one gather of its bags' rows from the received ones, pooled with their
                  weights (MEAN's 1 / L included)

On the wire per device: ``N * K`` ids and ``N * K * D`` values instead of
``N * B * S * D``. K follows the distinct rows a device reads of one owner, which for
skewed (Zipf) ids is a small part of its ``B * S`` ids. The backward runs the same way
back: the gather's transpose sums each row's cotangents over the bags that read it, the
all-to-all returns them to the owner, and the owner's fused
lookup applies the optimizer to its rows (rows asked by several devices summed) in place.

The output slots of a group, and so the layout of the pooled result:

* reduce (ROW_WISE): the group's S slots, one feature each, its rows split over the
  devices; pooled ``[B, S * D]``, what the reduce-scatter of partial sums gives.
* a2a (TABLE_WISE, COLUMN_WISE, TABLE_ROW_WISE): every device's slots, ``(j, s)``, each
  one piece on one device (a column piece of a row is its own request); pooled
  ``[B, N * S * D]`` source-major, what the all-to-all of pooled bags gives.

K, the capacity per (requester, owner) pair, must be static. ``fit_capacity`` counts it on
the host from the batches before they reach the step (``shard_batch(..., model=)``), so a
batch it saw always fits. ``request`` counts the ids of a batch that did not pass through
it and whose rows did not fit (the collection raises under FATAL, and counts them
otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec.parallel._dist import Windows, _exclusive_cumsum
from jaxrec.parallel._layout import REDUCE, Group

MAX_KEYS = 2 ** 31 - 1
"""Requests are sorted by one int32 key ``owner * rows + virtual row``: a group whose
devices hold more rows than that together keeps the dense path."""


class OutputSlots(NamedTuple):
    """The bags a device pools from the rows sent back (module doc), static: per output slot
    o its feature (-1: none) and its candidate pieces c, each on device ``owner[o, c]``,
    rows ``[lo, hi)`` of the feature's table at virtual row ``offset`` (``[O, C]``; the
    pieces of one output slot do not overlap, so an id has at most one)."""

    feature: np.ndarray
    owner: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    offset: np.ndarray


def output_slots(group: Group) -> OutputSlots:
    """A reduce or a2a group's ``OutputSlots`` (module doc)."""
    feature = np.asarray(group.slot_feature)                                # [N, S]
    lo, hi, offset = (np.asarray(x) for x in (group.slot_lo, group.slot_hi, group.slot_offset))
    n, s = feature.shape
    if group.kind == REDUCE:  # slot s: the same feature everywhere, its rows over the devices
        return OutputSlots(feature[0], np.tile(np.arange(n), (s, 1)), lo.T, hi.T, offset.T)
    return OutputSlots(feature.ravel(), np.repeat(np.arange(n), s)[:, None],
                       lo.reshape(-1, 1), hi.reshape(-1, 1), offset.reshape(-1, 1))


def fits_keys(group: Group) -> bool:
    """Whether the group's requests fit one int32 sort key (``MAX_KEYS``)."""
    return len(group.slot_feature) * group.layout.rows[0] < MAX_KEYS


def request(mine: Windows, slots: OutputSlots, rows: int, capacity: int):
    """``(requested [N, K], row [O, W], dropped)`` of this device (module doc).

    ``mine``: this device's windows of the output slots' features (one source); ``rows``:
    the virtual rows of each device. ``requested[o, k]``: the k-th distinct virtual row
    asked of owner o (-1: none); ``row[o, w]``: where window position w's row arrives,
    ``owner * K + k`` (``N * K``: no row: no id, or past the capacity); ``dropped``: the
    ids whose rows did not fit."""
    ids, inside = mine.ids[:, 0], mine.inside[:, 0]                         # [O, W]
    dtype = ids.dtype
    sources = int(slots.owner.max()) + 1
    owner, lo, hi, offset = (jnp.asarray(x.astype(dtype))[..., None]        # [O, C, 1]
                             for x in (slots.owner, slots.lo, slots.hi, slots.offset))
    none = sources * rows
    match = inside[:, None] & (ids[:, None] >= lo) & (ids[:, None] < hi)    # [O, C, W]
    key = jnp.where(match, owner * rows + ids[:, None] - lo + offset, none).min(1).ravel()
    key, position = jax.lax.sort_key_val(key, jnp.arange(key.size, dtype=dtype))
    valid = key < none
    first = valid & (key != jnp.concatenate([jnp.full((1,), -1, dtype), key[:-1]]))
    distinct = jnp.cumsum(first, dtype=dtype) - 1                           # the run's row
    o = jnp.minimum(key // rows, sources - 1)
    starts = jnp.arange(sources, dtype=dtype)[:, None] * rows
    before = jnp.sum(first[None] & (key[None] < starts), axis=1, dtype=dtype)  # of lower owners
    rank = distinct - before[o]
    fits = valid & (rank < capacity)
    slot = jnp.where(fits, o * capacity + rank, sources * capacity)
    requested = jnp.full((sources * capacity,), -1, dtype).at[
        jnp.where(first, slot, sources * capacity)].set(key - o * rows, mode="drop")
    row = jnp.zeros_like(slot).at[position].set(slot)
    dropped = jnp.sum(valid & ~fits, dtype=dtype)
    return requested.reshape(sources, capacity), row.reshape(ids.shape), dropped


def owner_bags(requested: jax.Array, num_slots: int):
    """``(values, offsets)``: the rows that every source asked of this device (``[N, K]``,
    -1 none), as single-id bags of the group's lookup, laid out so that its
    ``[N * K / S, S * D]`` reshaped to ``[N * K, D]`` is row ``source * K + k``: row p sits
    at ``[p // S, (p % S) * D]``, bag ``(p % S) * (N * K / S) + p // S``."""
    by_bag = requested.reshape(-1, num_slots).T.ravel()
    present = by_bag >= 0
    offsets = _exclusive_cumsum(present.astype(by_bag.dtype))
    values = jnp.zeros_like(by_bag).at[jnp.where(present, offsets[:-1], by_bag.size)].set(
        by_bag, mode="drop")
    return values, offsets


def exchange(x: jax.Array, axis: str) -> jax.Array:
    """``x [N, ...]``: block j to device j, block i of the result from device i."""
    return jax.lax.all_to_all(x, axis, 0, 0, tiled=True)


def send_rows(looked_up: jax.Array, dim: int, axis: str, comm_dtype) -> jax.Array:
    """The group's lookup ``[N * K / S, S * D]`` as rows, each back to the device that
    asked for it: ``[N (owner), K, D]`` float32 on the requester (``comm_dtype`` on the
    wire, and for the rows' cotangents on their way back)."""
    sources = jax.lax.axis_size(axis)
    rows = looked_up.reshape(sources, -1, dim).astype(comm_dtype)
    return exchange(rows, axis).astype(jnp.float32)


def pool(received: jax.Array, row: jax.Array, mine: Windows, weights: jax.Array | None,
         max_ids: int) -> jax.Array:
    """``[B, O * D]``: this device's bags of every output slot, pooled from the ``received``
    rows ``[N, K, D]`` (``row [O, W]``: ``request``'s; ``weights [O, W]`` or None).

    Bag (o, b) reads window positions ``bag_start[o, b]`` on, at most ``max_ids``: one
    gather of ``[B, O, max_ids]`` rows. Its transpose, a scatter-add of the rows'
    cotangents, sums each row's over the bags that read it (float atomics: the order of
    that sum, and so its last bits, may differ run to run; the TBE lookup's sorted
    backward would not, but it sums a hot row with one warp)."""
    sources, capacity, dim = received.shape
    num_out, window = row.shape
    start = mine.bag_start[:, 0, :-1]                                       # [O, B]
    length = mine.bag_length[:, 0]
    dtype = row.dtype
    position = jnp.minimum(start[..., None] + jnp.arange(max_ids, dtype=dtype), window - 1)
    present = jnp.arange(max_ids, dtype=dtype) < length[..., None]          # [O, B, L]
    slot = jnp.arange(num_out)[:, None, None]
    index = jnp.where(present, row[slot, position], sources * capacity).transpose(1, 0, 2)
    picked = jnp.take(received.reshape(-1, dim), index, axis=0, mode="fill", fill_value=0)
    if weights is None:
        return jnp.sum(picked, axis=2).reshape(index.shape[0], -1)
    w = jnp.where(present, weights[slot, position], 0.0).transpose(1, 0, 2)
    return jnp.sum(picked * w[..., None], axis=2).reshape(index.shape[0], -1)


# --- the capacity, on the host ------------------------------------------------------------

def fit_capacity(group: Group, feature_rows: Sequence[int], kjt_ids: Sequence[Sequence[np.ndarray]]
                 ) -> int:
    """K for ``group``: the most distinct rows that one device's batch asks of one owner,
    rounded up (to 1/8 of its leading power of two, then to a multiple of the group's
    slots) so that batches of one distribution compile once.

    ``kjt_ids[d][f]``: device d's ids of feature f (the collection's feature order);
    ``feature_rows[f]``: the rows of feature f's table. Ids out of range count as row 0
    (where bounds-check WARNING and IGNORE put them); bags are not cut to
    ``max_ids_per_bag`` here, so the count is an upper bound."""
    rows = group.layout.rows[0]
    sources = len(group.slot_feature)
    need = 0
    for ids in kjt_ids:
        distinct = np.unique(request_keys(group, feature_rows, ids))
        need = max(need, int(np.bincount(distinct // rows, minlength=sources).max()))
    granule = 1 << max(need.bit_length() - 4, 0)
    need = -(-max(need, 1) // granule) * granule
    return -(-need // group.num_slots) * group.num_slots


def request_keys(group: Group, feature_rows: Sequence[int], ids: Sequence[np.ndarray]
                 ) -> np.ndarray:
    """The sort keys ``owner * rows + virtual row`` of one device's ids (``ids[f]``: of
    feature f), one per id and output slot that reads it, as ``request`` forms them on the
    device (int64; ids out of range count as row 0)."""
    slots = output_slots(group)
    rows = group.layout.rows[0]
    keys = [np.zeros(0, np.int64)]
    for o, f in enumerate(slots.feature):
        if f < 0:
            continue
        x = np.asarray(ids[f]).astype(np.int64)
        x = np.where((x >= 0) & (x < feature_rows[f]), x, 0)
        for owner, lo, hi, offset in zip(slots.owner[o], slots.lo[o], slots.hi[o],
                                         slots.offset[o]):
            keys.append(owner * rows + x[(x >= lo) & (x < hi)] - lo + offset)
    return np.concatenate(keys)
