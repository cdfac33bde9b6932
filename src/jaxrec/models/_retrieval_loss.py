"""Retrieval losses over a batch of (query, candidate) pairs: in-batch sampled softmax with
the logQ correction, and BPR.

``query`` and ``candidate`` are ``[B, H]`` tower outputs (``TwoTower.embed``); row ``i``
is a positive pair. **In-batch softmax** scores every query against every candidate of
the batch, ``logits = query @ candidate.T / temperature`` (``[B, B]``), and takes the
cross-entropy of the diagonal: the other rows' candidates are the negatives. Popular items
are negatives more often than a uniform sample would make them, which biases the model
against them; the **logQ correction** (Yi et al., RecSys 2019) subtracts from each
column the log of the probability that its candidate is in a batch (``log_q``, e.g.
``log(count / total)`` of the candidate's frequency in the training data). Where the same
candidate appears in several rows (``candidate_ids``), its other copies are not negatives
of a row. Rows of ``mask`` 0 (padding) are neither positives nor negatives::

    #            c0    c1    c2          row 0's softmax runs over c0, c1, c2 (c0 positive);
    #   q0   [ l00   l01   l02 ]         with candidate_ids [7, 9, 7], c2 is c0's item:
    #   q1   [ l10   l11   l12 ]         dropped from row 0 (and c0 from row 2)
    #   q2   [ l20   l21   l22 ]

**BPR** (Rendle et al., 2009): ``-log sigmoid(<q, positive> - <q, negative>)`` per row, with
one negative candidate per query (e.g. the batch's candidates shifted by one row).

Both return the mean over the rows of ``mask`` > 0, in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def in_batch_softmax_loss(query: jax.Array, candidate: jax.Array, *, log_q: jax.Array | None = None,
                          candidate_ids: jax.Array | None = None, mask: jax.Array | None = None,
                          temperature: float = 1.0) -> jax.Array:
    """Mean in-batch sampled-softmax cross-entropy of the diagonal pairs (module doc)."""
    query, candidate = _pair(query, candidate)
    b = query.shape[0]
    logits = jnp.dot(query, candidate.T, preferred_element_type=jnp.float32) / temperature
    if log_q is not None:
        logits = logits - _row_vector("log_q", log_q, b)[None, :]
    mask = _mask(mask, b)
    negative = mask[None, :] > 0  # padding columns are no candidates
    if candidate_ids is not None:
        ids = jnp.asarray(candidate_ids)
        if ids.shape != (b,):
            raise ValueError(f"candidate_ids must have shape ({b},), got {ids.shape}")
        negative = negative & (ids[:, None] != ids[None, :])
    negative = negative | jnp.eye(b, dtype=bool)  # the positive always stays
    logits = jnp.where(negative, logits, -jnp.inf)
    losses = jax.nn.logsumexp(logits, axis=1) - jnp.diagonal(logits)
    return _masked_mean(losses, mask)


def bpr_loss(query: jax.Array, positive: jax.Array, negative: jax.Array, *,
             mask: jax.Array | None = None) -> jax.Array:
    """Mean ``-log sigmoid(<q, positive> - <q, negative>)`` (module doc)."""
    query, positive = _pair(query, positive)
    _, negative = _pair(query, negative)
    margin = jnp.sum(query * (positive - negative), axis=1, dtype=jnp.float32)
    return _masked_mean(-jax.nn.log_sigmoid(margin), _mask(mask, query.shape[0]))


def _pair(query, candidate):
    query, candidate = jnp.asarray(query), jnp.asarray(candidate)
    if query.ndim != 2 or query.shape != candidate.shape:
        raise ValueError(f"query and candidate must be [B, H] of one shape, got {query.shape} and "
                         f"{candidate.shape}")
    return query, candidate


def _row_vector(name, x, b):
    x = jnp.asarray(x, jnp.float32)
    if x.shape != (b,):
        raise ValueError(f"{name} must have shape ({b},) (one value per row), got {x.shape}")
    return x


def _mask(mask, b):
    return jnp.ones((b,), jnp.float32) if mask is None else _row_vector("mask", mask, b)


def _masked_mean(losses, mask):
    return jnp.sum(jnp.where(mask > 0, losses, 0.0) * mask) / jnp.maximum(jnp.sum(mask), 1.0)
