"""The TBE table gradient as unique rows and their summed gradients (duplicates merged).

For users who apply their own row-wise update, and the input of the fused
optimizers' reference. ``SparseRowGrad.to_dense`` gives back the dense gradient that
``jax.grad`` of ``embedding_bag_lookup`` returns.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec.ops.tbe_layout import PoolingMode, TableLayout, as_pooling_mode
from jaxrec.ops.tbe_reference import bag_of_position, clamp_offsets, position_scale, row_keys


class SparseRowGrad(NamedTuple):
    """The table gradient as unique rows: ``grads[i]`` belongs to row ``rows[i]`` of table ``tables[i]``.

    Entries ``i >= num_unique`` are padding (table -1, zeros). ``grads`` is
    ``[N, max_dim]``; a table of a smaller dim uses the first ``dim`` columns.
    """

    tables: jax.Array
    rows: jax.Array
    grads: jax.Array
    num_unique: jax.Array

    def to_dense(self, layout: TableLayout) -> jax.Array:
        """The same gradient as a dense flat buffer (float32), for checks and export."""
        dense = jnp.zeros((layout.num_weights,), jnp.float32)
        for t, (off, dim) in enumerate(zip(layout.table_offsets, layout.dims)):
            mine = self.tables == t
            starts = off + jnp.where(mine, self.rows, 0) * dim
            cols = starts[:, None] + jnp.arange(dim)
            dense = dense.at[cols].add(jnp.where(mine[:, None], self.grads[:, :dim], 0.0))
        return dense


def embedding_bag_sparse_grad(grad_output, indices, offsets, *, layout: TableLayout,
                              pooling: PoolingMode | int = PoolingMode.SUM,
                              per_sample_weights=None) -> SparseRowGrad:
    """The gradient of the tables as unique rows + summed row gradients (duplicates merged).

    For users who apply their own row-wise update. Bad input is handled as the lookup's
    ``bounds_check_mode="NONE"`` does: an id outside its feature's table is dropped (no
    entry) and the offsets are clamped (``clamp_offsets``); run ``bounds_check_indices``
    first for the other modes' corrections.
    """
    pooling = as_pooling_mode(pooling)
    grad_output, indices, offsets = (jnp.asarray(x) for x in (grad_output, indices, offsets))
    n = indices.shape[0]
    offsets = clamp_offsets(offsets, n)
    num_bags = offsets.shape[0] - 1
    batch_size = num_bags // layout.num_features
    bag = bag_of_position(offsets, n)
    scale = position_scale(offsets, per_sample_weights, bag, pooling)
    feature = jnp.clip(bag // max(batch_size, 1), 0, layout.num_features - 1)
    table = jnp.asarray(layout.feature_table_map, jnp.int32)[feature]
    max_dim = max(layout.dims)

    if pooling == PoolingMode.NONE:
        g = grad_output.astype(jnp.float32)
    else:
        col0 = jnp.asarray(layout.output_offsets[:-1], jnp.int32)[feature]
        sample = jnp.clip(bag % max(batch_size, 1), 0, max(batch_size - 1, 0))
        cols = jnp.minimum(col0[:, None] + jnp.arange(max_dim, dtype=jnp.int32), layout.total_dim - 1)
        g = grad_output.astype(jnp.float32)[sample[:, None], cols] if batch_size else jnp.zeros((n, max_dim))
    dim = jnp.asarray(layout.dims, jnp.int32)[table]
    g = jnp.where(jnp.arange(g.shape[1], dtype=jnp.int32) < dim[:, None], g, 0.0)
    contrib = g[:, :max_dim] * scale[:, None]

    key = row_keys(layout, indices, bag, num_bags)
    sentinel = np.iinfo(key.dtype).max
    sorted_key, order = jax.lax.sort_key_val(key, jnp.arange(n, dtype=key.dtype))
    is_new = jnp.concatenate([jnp.ones((min(n, 1),), bool), sorted_key[1:] != sorted_key[:-1]])
    is_new = is_new & (sorted_key != sentinel)
    segment = jnp.cumsum(is_new) - 1
    num_unique = jnp.sum(is_new, dtype=jnp.int32)
    segment = jnp.where(sorted_key != sentinel, segment, n)
    grads = jax.ops.segment_sum(contrib[order], segment, num_segments=n + 1)[:n]
    position = jnp.arange(n, dtype=jnp.int32)
    first = jax.ops.segment_min(position, segment, num_segments=n + 1)[:n]
    has = position < num_unique
    first = jnp.where(has, first, 0)
    tables_out = jnp.where(has, table[order][first], -1)
    rows_out = jnp.where(has, indices[order][first], 0)
    return SparseRowGrad(tables_out, rows_out, grads, num_unique)
