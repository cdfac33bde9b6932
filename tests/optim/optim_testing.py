"""Shared helpers of the optimizer tests: a layout, random batches, a float64 NumPy reference.

Test modules import them by name (``from optim_testing import ...``). The NumPy
reference is written from the formulas (as the brief and FBGEMM state them), not
from jaxrec's code: per row, in float64, one dict entry per (table, row).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec import fused, optim
from jaxrec.ops import TableLayout, embedding_bag_sparse_grad

# Three tables; features 0 and 2 share table 0, features 3 and 4 share table 2.
LAYOUT = TableLayout(rows=(23, 9, 17), dims=(8, 3, 16), feature_table_map=(0, 1, 0, 2, 2))
BATCH = 4

# Hyperparameters far from the defaults, so that each one matters (eps included).
HP = dict(learning_rate=0.05, eps=0.05, beta1=0.8, beta2=0.95, weight_decay=0.1, momentum=0.7,
          eta=0.3)


def make(cls, **overrides):
    """``cls`` with the fields of HP it has, then ``overrides``."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{**{k: v for k, v in HP.items() if k in names}, **overrides})


CAPACITY = 128  # static length of indices: one compile of the sparse gradient


def random_batch(rng, layout=LAYOUT, batch_size=BATCH, id_range=6):
    """indices, offsets and grad_output of a SUM-pooled batch with many duplicate ids.

    Ids come from ``[0, id_range)`` of each table, so most rows are touched several
    times and the others not at all; positions past the last offset (up to CAPACITY)
    are padding, which must be ignored.
    """
    lengths = rng.integers(0, 7, size=layout.num_features * batch_size)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = [rng.integers(0, min(id_range, layout.feature_rows[k // batch_size]), n)
           for k, n in enumerate(lengths)]
    pad = CAPACITY - offsets[-1]
    assert pad > 0
    indices = np.concatenate(ids + [rng.integers(0, 3, pad)]).astype(np.int32)
    grad_output = rng.normal(size=(batch_size, layout.total_dim)).astype(np.float32)
    return indices, offsets, grad_output


def sparse_grad(batch, layout=LAYOUT):
    indices, offsets, grad_output = batch
    return _sparse_grad(layout)(jnp.asarray(grad_output), jnp.asarray(indices), jnp.asarray(offsets))


@functools.cache
def _sparse_grad(layout):
    return jax.jit(functools.partial(embedding_bag_sparse_grad, layout=layout))


def merged_grads(batch, layout=LAYOUT) -> dict[tuple[int, int], np.ndarray]:
    """float64 summed gradient of each touched (table, row), straight from the bags."""
    indices, offsets, grad_output = batch
    batch_size = (len(offsets) - 1) // layout.num_features
    out: dict[tuple[int, int], np.ndarray] = {}
    for k in range(len(offsets) - 1):
        f = k // batch_size
        t, col = layout.feature_table_map[f], layout.output_offsets[f]
        g = grad_output[k % batch_size, col:col + layout.dims[t]].astype(np.float64)
        for p in range(offsets[k], offsets[k + 1]):
            key = (t, int(indices[p]))
            out[key] = out.get(key, 0.0) + g
    return out


# --- state as per-table float64 NumPy arrays -------------------------------------------

_POSITIVE = ("momentum1", "exp_avg_sq")  # accumulators of squares


def random_tables(config, rng, layout=LAYOUT):
    """float64 weights and state per table (state non-zero, squares positive)."""
    weights = [rng.normal(0.0, 0.3, size=(r, d)) for r, d in zip(layout.rows, layout.dims)]
    states = []
    for r, d in zip(layout.rows, layout.dims):
        s = {}
        for name in config.state_type._fields[1:]:
            shape = (r,) if name in config.state_type.row_fields else (r, d)
            x = rng.normal(0.0, 0.1, size=shape)
            s[name] = np.abs(x) if name in _POSITIVE else x
        states.append(s)
    return weights, states


def to_jax(config, weights, states, step, weight_dtype=jnp.float32, state_dtype=None,
           layout=LAYOUT):
    """The flat jaxrec buffers holding the same numbers."""
    flat_w = jnp.concatenate([jnp.ravel(jnp.asarray(w, jnp.float32)) for w in weights])
    state = optim.init_state(config, layout, state_dtype)
    buffers = {}
    for name in config.state_type._fields[1:]:
        dtype = getattr(state, name).dtype
        buffers[name] = jnp.concatenate(
            [jnp.ravel(jnp.asarray(s[name], jnp.float32)) for s in states]).astype(dtype)
    return flat_w.astype(weight_dtype), config.state_type(step=jnp.asarray(step, jnp.int32), **buffers)


def from_jax(config, weights, state, layout=LAYOUT):
    """float64 per-table copies of jaxrec's buffers."""
    w = [np.asarray(x, np.float64) for x in layout.split_embedding_weights(weights.astype(jnp.float32))]
    s = [{k: np.asarray(v.astype(jnp.float32), np.float64) for k, v in table.items()}
         for table in optim.split_optimizer_states(config, layout, state)]
    return w, s


def reference_step(config, weights, states, grads, step):
    """One fused step in float64 (in place); returns the number of rows max_norm rescaled."""
    t = step + 1
    clipped = 0
    for (table, r), g in grads.items():
        s = {k: v[r] for k, v in states[table].items()}
        w, s, c = _reference_row(config, weights[table][r].copy(), g.copy(), s, t)
        clipped += c
        weights[table][r] = w
        for k, v in s.items():
            states[table][k][r] = v
    return clipped


def _reference_row(c, w, g, s, t):
    name = type(c).__name__
    lr = c.learning_rate
    if name == "SGD":
        w = w - lr * g
    elif name == "Adagrad":
        s["momentum1"] = s["momentum1"] + g * g
        w = w - lr * g / (np.sqrt(s["momentum1"]) + c.eps)
    elif name == "RowWiseAdagrad":
        w0 = w
        if c.weight_decay_mode == "l2":
            g = g + c.weight_decay * w
        s["momentum1"] = s["momentum1"] + np.mean(g * g)
        w = w - lr * g / (np.sqrt(s["momentum1"]) + c.eps)
        if c.weight_decay_mode == "decoupled":
            w = w - lr * c.weight_decay * w0
    elif name in ("Adam", "PartialRowWiseAdam", "LAMB", "PartialRowWiseLAMB"):
        s["exp_avg"] = c.beta1 * s["exp_avg"] + (1 - c.beta1) * g
        sq = np.mean(g * g) if name.startswith("Partial") else g * g
        s["exp_avg_sq"] = c.beta2 * s["exp_avg_sq"] + (1 - c.beta2) * sq
        m_hat = s["exp_avg"] / (1 - c.beta1 ** t)
        v_hat = s["exp_avg_sq"] / (1 - c.beta2 ** t)
        r = m_hat / (np.sqrt(v_hat) + c.eps) + c.weight_decay * w
        if name.endswith("Adam"):
            w = w - lr * r
        else:
            wn, rn = np.linalg.norm(w), np.linalg.norm(r)
            ratio = wn / rn if wn > 0 and rn > 0 else 1.0
            w = w - lr * ratio * r
    elif name == "LarsSGD":
        wn, gn = np.linalg.norm(w), np.linalg.norm(g)
        denom = gn + c.weight_decay * wn
        lr_local = lr * c.eta * wn / denom if denom > 0 else 0.0
        s["momentum_buffer"] = c.momentum * s["momentum_buffer"] + lr_local * (g + c.weight_decay * w)
        w = w - s["momentum_buffer"]
    else:
        raise AssertionError(name)
    clipped = 0
    if c.max_norm > 0 and np.linalg.norm(w) > c.max_norm:
        w = w * (c.max_norm / np.linalg.norm(w))
        clipped = 1
    return w, s, clipped


def jitted_update(config, layout=LAYOUT):
    """The fused reference under jit, hyperparameters traced."""
    @jax.jit
    def step(weights, state, grad, hparams):
        return fused.fused_update_reference(weights, state, grad, layout=layout, config=config,
                                            hparams=hparams)
    return step
