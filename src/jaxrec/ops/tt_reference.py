"""Pure-jnp TT embedding bags: the oracle of the CUDA kernels and the portable path.

Each id's row is the chain of the core slices its digits select, contracted by batched
``einsum``; bags are pooled with ``segment_sum``. ``jax.grad`` of
:func:`tt_embedding_bag_reference` gives the reference gradients of the cores and of the
per-sample weights. :func:`tt_full_weight` materialises the whole table (tests, export).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrec.ops.tbe_layout import PoolingMode
from jaxrec.ops.tbe_reference import bag_of_position, position_scale
from jaxrec.ops.tt_layout import TTLayout


def tt_rows(cores, ids: jax.Array, *, layout: TTLayout) -> jax.Array:
    """``float32[n, embedding_dim]``: the row of each id (ids must be in range)."""
    digits = layout.digits(ids)
    n = ids.shape[0]
    r = layout.ranks
    x = cores[0][0][digits[0]]  # [n, q0, r1]
    for t in range(1, layout.num_cores):
        g = jnp.moveaxis(cores[t], 1, 0)[digits[t]]  # [n, r_t, q_t, r_t+1]
        x = jnp.einsum("nma,najb->nmjb", x, g, precision="highest")
        x = x.reshape(n, -1, r[t + 1])
    return x.reshape(n, layout.embedding_dim)


def tt_full_weight(cores, *, layout: TTLayout) -> jax.Array:
    """The dense ``[num_embeddings, embedding_dim]`` table the cores represent (FBTT's ``full_weight``)."""
    x = cores[0][0]  # [p0, q0, r1]
    for t in range(1, layout.num_cores):
        x = jnp.einsum("PQa,apjb->PpQjb", x, cores[t], precision="highest")
        big_p, p, big_q, q, r = x.shape
        x = x.reshape(big_p * p, big_q * q, r)
    return x[: layout.num_embeddings, :, 0]


def tt_embedding_bag_reference(cores, indices, offsets, per_sample_weights=None, *,
                               layout: TTLayout, pooling: PoolingMode,
                               num_features: int = 1) -> jax.Array:
    """``float32[B, num_features * D]``: bags pooled from the rows of their ids.

    ``offsets`` has ``num_features * B + 1`` entries, feature-major (FBGEMM's order); every
    feature reads the same table. Positions past the last offset are padding. An id
    outside ``[0, num_embeddings)`` contributes nothing (``tt_embedding_bag``'s NONE mode).
    """
    n = indices.shape[0]
    num_bags = offsets.shape[0] - 1
    bag = bag_of_position(offsets, n)
    scale = position_scale(offsets, per_sample_weights, bag, pooling)
    valid = (bag >= 0) & (bag < num_bags) & (indices >= 0) & (indices < layout.num_embeddings)
    ids = jnp.where(valid, indices, 0)
    # Masked with where: a dropped id gets 0 gradients even if its weight is inf/NaN.
    rows = tt_rows(cores, ids, layout=layout) * jnp.where(valid, scale, 0.0)[:, None]
    pooled = jax.ops.segment_sum(rows, jnp.where(valid, bag, num_bags), num_segments=num_bags + 1)
    return bags_to_batch(pooled[:num_bags], num_features)


def bags_to_batch(pooled: jax.Array, num_features: int) -> jax.Array:
    """``[F * B, D]`` bags (feature-major) -> ``[B, F * D]`` (feature blocks side by side)."""
    num_bags, dim = pooled.shape
    batch = num_bags // num_features
    return pooled.reshape(num_features, batch, dim).transpose(1, 0, 2).reshape(batch, -1)


def batch_to_bags(out: jax.Array, num_features: int) -> jax.Array:
    """The inverse of :func:`bags_to_batch`."""
    batch, width = out.shape
    dim = width // num_features
    return out.reshape(batch, num_features, dim).transpose(1, 0, 2).reshape(-1, dim)
