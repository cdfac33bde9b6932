"""Pure-jnp table-batched embedding bags: the oracle of the kernels and the portable fallback.

Differentiating :func:`embedding_bag_reference` with ``jax.grad`` gives the
reference gradients of the tables and of the per-sample weights.

Bad input is handled as the kernels handle it (docs/bounds_check.md, "What NONE does
with a bad id"): an id outside ``[0, rows)`` of its feature's table contributes
nothing (no row is read, its gradients are 0), and offsets go through
:func:`clamp_offsets` first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec.ops.tbe_layout import PoolingMode, TableLayout


def clamp_offsets(offsets: jax.Array, num_indices: int) -> jax.Array:
    """Offsets clamped into ``[0, N]`` and made non-decreasing: ``max_{j<=i} clip(offsets[j], 0, N)``.

    The correction ``bounds_check_indices`` applies to offsets, in one fused scan over
    ``T * B + 1`` entries; under ``bounds_check_mode="NONE"`` the wrappers apply it so
    that every bag lies inside the indices and no two bags overlap (valid offsets are
    returned unchanged).
    """
    return jax.lax.cummax(jnp.clip(offsets, 0, num_indices), axis=0)


def valid_ids(layout: TableLayout, indices, bag, num_bags: int) -> jax.Array:
    """Whether position p is inside a bag and its id is in ``[0, rows)`` of its feature's table.

    Compared in the indices' own dtype: an int64 id of 2**31 or more is out of range,
    never truncated. ``bag`` is ``bag_of_position(offsets, N)``.
    """
    batch_size = max(num_bags // layout.num_features, 1)
    in_bag = (bag >= 0) & (bag < num_bags)
    feature = jnp.clip(bag // batch_size, 0, layout.num_features - 1)
    rows = jnp.asarray(layout.feature_rows, indices.dtype)[feature]
    return in_bag & (indices >= 0) & (indices < rows)


def bag_of_position(offsets: jax.Array, num_indices: int) -> jax.Array:
    """Bag k of each index position (``offsets[k] <= p < offsets[k+1]``); -1 or T*B outside bags.

    Offsets must be non-decreasing (``bounds_check_indices`` guarantees it). Computed as
    ``searchsorted(offsets, p, side="right") - 1`` by counting the offsets at or before
    each position (a scatter-add and a cumsum): no loop, where ``jnp.searchsorted``'s
    binary search is a while loop that syncs with the host each iteration on the GPU.
    """
    starts = jnp.clip(offsets, 0, num_indices)  # offsets past the end count for no position
    marks = jnp.zeros((num_indices + 1,), offsets.dtype).at[starts].add(1)
    return jnp.cumsum(marks[:num_indices], dtype=offsets.dtype) - 1


def row_keys(layout: TableLayout, indices, bag, num_bags: int) -> jax.Array:
    """Key of the table row each position reads: the table's first row in the stacked
    tables plus the id; the dtype's max for positions outside bags or whose id is out
    of range (sorted last, so no kernel touches a row for them).

    ``bag`` is ``bag_of_position(offsets, N)``, which every caller needs too.
    """
    batch_size = max(num_bags // layout.num_features, 1)
    valid = valid_ids(layout, indices, bag, num_bags)
    feature = jnp.clip(bag // batch_size, 0, layout.num_features - 1)
    first_row = jnp.asarray(layout.feature_first_rows, indices.dtype)
    return jnp.where(valid, first_row[feature] + jnp.where(valid, indices, 0), np.iinfo(indices.dtype).max)


def position_scale(offsets, per_sample_weights, bag, pooling: PoolingMode) -> jax.Array:
    """float32 factor of each position: its per-sample weight, times 1/L for MEAN, 0 outside bags."""
    num_bags = offsets.shape[0] - 1
    valid = (bag >= 0) & (bag < num_bags)
    safe_bag = jnp.clip(bag, 0, max(num_bags - 1, 0))
    scale = jnp.ones(bag.shape, jnp.float32)
    if per_sample_weights is not None:
        scale = jnp.asarray(per_sample_weights, jnp.float32)
    if pooling == PoolingMode.MEAN and num_bags:
        lengths = (offsets[1:] - offsets[:-1]).astype(jnp.float32)
        scale = scale / jnp.maximum(lengths[safe_bag], 1.0)
    return jnp.where(valid, scale, 0.0)


def embedding_bag_reference(weights, indices, offsets, per_sample_weights, *, layout: TableLayout,
                            pooling: PoolingMode, output_dtype) -> jax.Array:
    """``[B, total_dim]`` pooled embeddings (``[N, dim]`` for NONE); see ``embedding_bag_lookup``."""
    num_features = layout.num_features
    num_bags = offsets.shape[0] - 1
    batch_size = num_bags // num_features
    n = indices.shape[0]
    offsets = clamp_offsets(offsets, n)
    bag = bag_of_position(offsets, n)
    scale = position_scale(offsets, per_sample_weights, bag, pooling)
    valid = valid_ids(layout, indices, bag, num_bags)
    feature = jnp.where(valid, bag // max(batch_size, 1), -1)
    tables = layout.split_embedding_weights(weights)

    pieces = []
    for f in range(num_features):
        table = tables[layout.feature_table_map[f]]
        mine = feature == f
        # Masked with where, not by a 0 factor: a dropped id or padding contributes 0
        # (and gets 0 gradients) even if row 0 or its weight holds inf/NaN.
        rows = jnp.where(mine[:, None], table[jnp.where(mine, indices, 0)].astype(jnp.float32), 0.0)
        rows = rows * jnp.where(mine, scale, 0.0)[:, None]
        if pooling == PoolingMode.NONE:
            pieces.append(rows)
        else:
            sample = jnp.where(mine, bag - f * batch_size, batch_size)
            pieces.append(jax.ops.segment_sum(rows, sample, num_segments=batch_size + 1)[:batch_size])
    if pooling == PoolingMode.NONE:
        out = sum(pieces[1:], pieces[0])
    else:
        out = jnp.concatenate(pieces, axis=1)
    return out.astype(output_dtype)
