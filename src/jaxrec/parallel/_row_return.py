"""Row-wise outputs as the looked-up rows themselves, not as partial sums (bounded bags).

The dense row-wise path (``_dist.assemble``) has every device pool the global batch's
bags over its own rows and reduce-scatter the partial sums: ``[N * B, S * D]`` per device,
N times what a table-wise device sends, and mostly zeros when bags are short. When every
feature of a row-wise group has a ``max_ids_per_bag`` bound, each id's row can instead go
back to the device that asked for it, and that device pools its own bags::

    owner j       the ids of source i that fall in j's rows, in (slot, window position)
                  order, the first K of them                                  -> [N, K] ids
                  one lookup of N * K single-id bags                          -> [N * K, D]
                  all_to_all over the sources    -> device i receives [N (owner), K, D]
    requester i   each of its ids: its owner o (the static row ranges) and its rank r among
                  its ids that o owns, in the same order -> row received[o, r]; one
                  gather pools the bags with the per-sample weights (MEAN's 1 / L
                  included), and its backward is a gather too (``gather_pool``)

Bytes on the wire per device: ``N * K * D`` instead of ``N * B * S * D``; for uniform
one-hot ids K is about ``S * B / N``, which is what a table-wise device sends. The
transposes carry the gradient back: each row's cotangent returns to its owner, whose
fused lookup applies the optimizer to its rows (duplicates summed) in place.

K, the capacity per (source, owner) pair, must be static. ``fit_capacity`` computes it on
the host from the batches before they reach the step (``shard_batch(..., model=)``), so a
batch it saw always fits. ``owner_input`` counts the ids past K of a batch that did not
pass through it (the collection raises under FATAL, and counts them otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec.parallel._dist import Windows, _exclusive_cumsum
from jaxrec.parallel._layout import Group


def owner_input(windows: Windows, slots: dict[str, jax.Array], capacity: int):
    """``(values, offsets, dropped)``: this device's lookup of the ids it owns, one bag per
    (source, rank < K), laid out so that the group's lookup ``[N * K / S, S * D]`` reshaped
    to ``[N * K, D]`` is row ``source * K + rank``; ``dropped``: ids past the capacity."""
    ids = windows.ids                                                      # [S, N, W]
    num_slots, sources, _ = ids.shape
    dtype = ids.dtype
    lo, hi, offset = (slots[k].astype(dtype)[:, None, None] for k in ("lo", "hi", "offset"))
    keep = windows.inside & (ids >= lo) & (ids < hi)
    keep = keep.transpose(1, 0, 2).reshape(sources, -1).astype(dtype)      # [N, S*W]
    virtual = (ids - lo + offset).transpose(1, 0, 2).reshape(sources, -1)
    rank = jnp.cumsum(keep, axis=1, dtype=dtype) - keep
    count = keep.sum(1)
    fits = (keep > 0) & (rank < capacity)
    # Row p = source * K + rank comes out at [p // S, (p % S) * D]: bag (p % S) * (N*K/S) + p // S.
    p = jnp.arange(sources, dtype=dtype)[:, None] * capacity + rank
    per_slot = sources * capacity // num_slots
    bag = jnp.where(fits, (p % num_slots) * per_slot + p // num_slots, sources * capacity)
    lengths = jnp.zeros((sources * capacity,), dtype).at[bag].set(1, mode="drop")
    offsets = _exclusive_cumsum(lengths)
    values = jnp.zeros((sources * capacity,), dtype).at[
        jnp.where(fits, offsets[jnp.minimum(bag, sources * capacity - 1)], sources * capacity)
    ].set(virtual, mode="drop")
    dropped = jnp.sum(jnp.maximum(count - capacity, 0))
    return values, offsets, dropped


def send_rows(looked_up: jax.Array, dim: int, axis: str, comm_dtype) -> jax.Array:
    """The group's lookup ``[N * K / S, S * D]`` as rows, each back to the device that
    asked for it: ``[N (owner), K, D]`` float32 on the requester (``comm_dtype`` on the
    wire, and for the rows' cotangents on their way back)."""
    sources = jax.lax.axis_size(axis)
    rows = looked_up.reshape(sources, -1, dim).astype(comm_dtype)
    return jax.lax.all_to_all(rows, axis, 0, 0, tiled=True).astype(jnp.float32)


def pool_received(received: jax.Array, mine: Windows, weights: jax.Array,
                  lo: np.ndarray, hi: np.ndarray, max_ids: int) -> jax.Array:
    """``[B, S * D]``: this device's bags pooled from the rows its owners sent back.

    ``mine``: this device's own windows (one source); ``weights [S, 1, W]`` their per-sample
    weights; ``lo, hi [N, S]``: every device's row range per slot (the group's static slot
    arrays); ``max_ids``: the most ids of a bag. An id's rank among this device's ids owned
    by the same device, in (slot, position) order, is where that owner put its row
    (``owner_input``).
    """
    sources, capacity, dim = received.shape
    ids, inside = mine.ids[:, 0], mine.inside[:, 0]                        # [S, W]
    num_slots, window = ids.shape
    dtype = ids.dtype
    lo, hi = (jnp.asarray(x.astype(dtype))[:, :, None] for x in (lo, hi))
    owned = (inside[None] & (ids[None] >= lo) & (ids[None] < hi)).reshape(sources, -1)
    owned = owned.astype(dtype)                                            # [N, S*W]
    owner = jnp.argmax(owned, axis=0)
    rank = jnp.take_along_axis(jnp.cumsum(owned, axis=1, dtype=dtype) - owned, owner[None], 0)[0]
    fits = (owned.max(0) > 0) & (rank < capacity)
    none = sources * capacity
    row = jnp.where(fits, owner.astype(dtype) * capacity + rank, none).reshape(num_slots, window)

    # Bag (b, s)'s l-th id sits at window position bag_start[s, b] + l.
    start = mine.bag_start[:, 0, :-1]                                      # [S, B]
    length = mine.bag_length[:, 0]
    slot = jnp.arange(num_slots)[:, None, None]
    position = jnp.minimum(start[..., None] + jnp.arange(max_ids, dtype=dtype), window - 1)
    present = jnp.arange(max_ids, dtype=dtype) < length[..., None]         # [S, B, L]
    index = jnp.where(present, row[slot, position], none).transpose(1, 0, 2)
    w = jnp.where(present, weights[:, 0][slot, position], 0.0).transpose(1, 0, 2)
    # The requester of each received row: flat (b, s, l), or -1 (a slot no id asked for).
    inverse = jnp.full((none,), -1, dtype).at[index.ravel()].set(
        jnp.arange(index.size, dtype=dtype), mode="drop")
    return gather_pool(received.reshape(none, dim), index, inverse, w)


@jax.custom_vjp
def gather_pool(rows, index, inverse, weights):
    """``[B, S * D]``: ``sum_l weights[b, s, l] * rows[index[b, s, l]]`` (index past the end:
    nothing). Each row feeds at most one (b, s, l), ``inverse[row]`` (-1: none), so the
    backward is a gather too, not a scatter-add."""
    picked = jnp.take(rows, index, axis=0, mode="fill", fill_value=0)      # [B, S, L, D]
    return jnp.sum(picked * weights[..., None], axis=2).reshape(index.shape[0], -1)


def _gather_pool_fwd(rows, index, inverse, weights):
    return gather_pool(rows, index, inverse, weights), (rows, index, inverse, weights)


def _gather_pool_bwd(residuals, ct):
    rows, index, inverse, weights = residuals
    batch, num_slots, max_ids = index.shape
    ct = ct.reshape(batch * num_slots, -1)
    valid = inverse >= 0
    requester = jnp.maximum(inverse, 0)
    scale = jnp.where(valid, weights.reshape(-1)[requester], 0.0)
    ct_rows = jnp.take(ct, requester // max_ids, axis=0) * scale[:, None]
    picked = jnp.take(rows, index, axis=0, mode="fill", fill_value=0)
    ct_weights = jnp.sum(picked * ct.reshape(batch, num_slots, 1, -1), axis=-1)
    return ct_rows, None, None, ct_weights


gather_pool.defvjp(_gather_pool_fwd, _gather_pool_bwd)


# --- the capacity, on the host ------------------------------------------------------------

def fit_capacity(group: Group, feature_rows: Sequence[int], kjt_ids: Sequence[Sequence[np.ndarray]]
                 ) -> int:
    """K for ``group``: the most ids that one device's batch sends to one owner, rounded up
    (to 1/8 of its leading power of two, then to a multiple of the group's slots) so that
    batches of one distribution compile once.

    ``kjt_ids[d][f]``: device d's ids of feature f (the collection's feature order);
    ``feature_rows[f]``: the rows of feature f's table. Ids out of range count as row 0
    (where bounds-check WARNING and IGNORE put them); bags are not cut to
    ``max_ids_per_bag`` here, so the count is an upper bound."""
    feature = np.asarray(group.slot_feature[0])
    lo, hi = np.asarray(group.slot_lo), np.asarray(group.slot_hi)          # [N, S]
    need = 0
    for ids in kjt_ids:
        counts = np.zeros(lo.shape[0], np.int64)
        for s, f in enumerate(feature):
            if f < 0:
                continue
            x = np.asarray(ids[f]).astype(np.int64)
            x = np.where((x >= 0) & (x < feature_rows[f]), x, 0)
            counts += ((x[None] >= lo[:, s, None]) & (x[None] < hi[:, s, None])).sum(1)
        need = max(need, int(counts.max()))
    granule = 1 << max(need.bit_length() - 4, 0)
    need = -(-max(need, 1) // granule) * granule
    return -(-need // len(feature)) * len(feature)
