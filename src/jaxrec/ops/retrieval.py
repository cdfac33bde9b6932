"""Top-K retrieval by dot product over every item, on the device: ``top_k_retrieval``.

::

    scores, ids = top_k_retrieval(user_vectors, item_vectors, 10,
                                  exclude=seen_items)     # [Q, 10] each, best first

The items are scored in chunks of ``chunk_size`` rows (a ``lax.scan``), and a running
top ``k`` per query is merged with each chunk's, so memory is ``Q x chunk_size`` scores,
never ``Q x I``. Equal scores rank by item id, lowest first: ``lax.top_k`` keeps the
lower position first, and the running entries always come from lower ids than the chunk
(the order of ``jaxrec.metrics.ranking_metrics``).

``exclude`` ``[Q, E]``: per query, item ids never to return (e.g. those seen in training),
padded with -1; each chunk marks its ids by a scatter, O(Q x E) per chunk.
``approximate=True`` takes each chunk's top ``k`` with ``lax.approx_max_k`` (TPU-fast;
exact on other backends) at ``recall_target``.

No custom kernel: XLA's matmul and ``top_k`` are the fast path on every backend, and
the function is its own reference (tests/test_retrieval.py checks it against NumPy's
full sort). Slots a query cannot fill (fewer than ``k`` items left after ``exclude``) hold score
``-inf`` and id -1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def top_k_retrieval(queries, items, k: int, *, exclude=None, chunk_size: int = 8192,
                    approximate: bool = False, recall_target: float = 0.95):
    """``(scores [Q, k] float32, ids [Q, k] int32)``: each query's ``k`` items of highest
    ``queries @ items.T``, best first (module doc). ``queries`` ``[Q, D]``, ``items``
    ``[I, D]``; ``exclude`` ``[Q, E]`` int ids, -1 for padding."""
    queries, items = jnp.asarray(queries), jnp.asarray(items)
    if queries.ndim != 2 or items.ndim != 2 or queries.shape[1] != items.shape[1]:
        raise ValueError(f"queries and items must be [Q, D] and [I, D] with one D, got shapes "
                         f"{queries.shape} and {items.shape}")
    num_items = items.shape[0]
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 1 <= k <= num_items:
        raise ValueError(f"k must be an int in [1, {num_items}] (the number of items), got {k!r}")
    if not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if exclude is not None:
        exclude = jnp.asarray(exclude)
        if exclude.ndim != 2 or exclude.shape[0] != queries.shape[0] or not jnp.issubdtype(
                exclude.dtype, jnp.integer):
            raise ValueError(f"exclude must be integer ids [Q = {queries.shape[0]}, E] (-1 for "
                             f"padding), got {exclude.dtype}{list(exclude.shape)}")
    return _top_k(queries, items, exclude, k=int(k), chunk=int(min(chunk_size, num_items)),
                  approximate=approximate, recall_target=float(recall_target))


@functools.partial(jax.jit, static_argnames=("k", "chunk", "approximate", "recall_target"))
def _top_k(queries, items, exclude, *, k, chunk, approximate, recall_target):
    num_queries, num_items = queries.shape[0], items.shape[0]
    num_chunks = -(-num_items // chunk)
    padded = jnp.pad(items, ((0, num_chunks * chunk - num_items), (0, 0)))
    rows = jnp.arange(num_queries)[:, None]

    def chunk_top(start, block):
        scores = jnp.dot(queries, block.T, preferred_element_type=jnp.float32)  # [Q, chunk]
        ids = start + jnp.arange(chunk)
        masked = ids[None, :] >= num_items  # the padding past the last item
        if exclude is not None:  # mark each query's excluded ids that fall in this chunk
            local = jnp.where((exclude >= start) & (exclude < start + chunk), exclude - start, chunk)
            hit = jnp.zeros((num_queries, chunk), bool).at[rows, local].set(True, mode="drop")
            masked = masked | hit
        scores = jnp.where(masked, -jnp.inf, scores)
        size = min(k, chunk)
        if approximate:
            top, where = jax.lax.approx_max_k(scores, size, recall_target=recall_target)
        else:
            top, where = jax.lax.top_k(scores, size)
        return top, jnp.where(jnp.isneginf(top), -1, start + where).astype(jnp.int32)

    def step(best, c):
        start = c * chunk
        top, ids = chunk_top(start, jax.lax.dynamic_slice_in_dim(padded, start, chunk))
        scores = jnp.concatenate([best[0], top], axis=1)
        ids = jnp.concatenate([best[1], ids], axis=1)
        keep, where = jax.lax.top_k(scores, k)  # running entries (lower ids) win ties
        return (keep, jnp.take_along_axis(ids, where, axis=1)), None

    empty = (jnp.full((num_queries, k), -jnp.inf, jnp.float32), jnp.full((num_queries, k), -1, jnp.int32))
    (scores, ids), _ = jax.lax.scan(step, empty, jnp.arange(num_chunks))
    return scores, ids  # a -inf slot's id is -1 already (chunk_top and empty)
