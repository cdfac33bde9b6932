"""The row-wise math of every fused optimizer, written once in jnp.

``update_rows`` updates a batch of *unique* rows (duplicate ids already summed):
the fused kernels implement exactly these formulas and are tested against them.
All math runs in float32; weights and state are rounded to their dtypes when
stored: round to nearest, or for float16/bfloat16 weights with ``stochastic_rounding``
the deterministic stochastic rounding of ``jaxrec.optim._rounding``.
Notation per row: ``w, g`` of length D (the row's table dim), ``lr`` the learning
rate, ``t`` the step *after* the increment (1 on the first update), ``mean_D`` and
``‖·‖`` over the row's D columns.

Around every optimizer:

1. the optimizer's step (below);
2. ``max_norm > 0``: if ``‖w_new‖ > max_norm``, ``w_new *= max_norm / ‖w_new‖``
   (FBGEMM does this for rowwise Adagrad only; jaxrec for every optimizer).

``gradient_clipping`` is not applied here: as in FBGEMM's autograd function it clamps
the lookup's *output* gradient element-wise before the backward
(:func:`clip_output_gradient`), so a row's summed gradient may exceed ``max_gradient``
(duplicates add up) and the per-sample-weight gradient sees the clamped values too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrec.optim import _configs as C
from jaxrec.optim._rounding import rounding_bits, stochastic_round
from jaxrec.optim._state import buffer_fields

_F32 = jnp.float32


def clip_output_gradient(config: C.OptimizerConfig, hparams: C.OptimizerHyperparams, grad_output):
    """FBGEMM's ``gradient_clipping``: ``grad_output`` clamped element-wise to
    ``[-max_gradient, max_gradient]`` (unchanged when ``config.gradient_clipping`` is off).

    Apply it to the gradient of the lookup's output, before the backward; every fused
    path (``fused_update``, the fused tables) does.
    """
    if not config.gradient_clipping:
        return grad_output
    bound = jnp.asarray(hparams.max_gradient, grad_output.dtype)
    return jnp.clip(grad_output, -bound, bound)


def _safe_div(a, b):
    """``a / b`` where ``b > 0``, else 0 (no inf/NaN in either branch of the where)."""
    ok = b > 0
    return jnp.where(ok, a / jnp.where(ok, b, 1.0), 0.0)


def _row_sum(x):
    return jnp.sum(x, axis=-1)


def _sgd(c, h, w, g, s, t, d, mask):
    """EXACT_SGD: ``w -= lr * g``."""
    return w - h.learning_rate * g, {}


def _adagrad(c, h, w, g, s, t, d, mask):
    """EXACT_ADAGRAD, element-wise: ``m += g²; w -= lr * g / (sqrt(m) + eps)``."""
    m = s["momentum1"] + g * g
    return w - h.learning_rate * g / (jnp.sqrt(m) + h.eps), {"momentum1": m}


def _rowwise_adagrad(c, h, w, g, s, t, d, mask):
    """EXACT_ROWWISE_ADAGRAD, one ``m`` per row, in FBGEMM's multiplier/correction form::

        g_wd  = g + weight_decay * w   if mode == "l2" else g
        m    += mean_D(g_wd²)
        mult  = lr / (sqrt(m) + eps)                    (eps outside the square root)
        corr  = 1 - mult * weight_decay   ("l2": together, w -= mult * (g + wd * w))
                1 - lr * weight_decay     ("decoupled": on the pre-update weight)
                1                         ("none")
        w     = corr * w - mult * g
    """
    wd = h.weight_decay
    g_wd = g + wd * w if c.weight_decay_mode == "l2" else g
    m = s["momentum1"] + _row_sum(g_wd * g_wd) / d
    mult = h.learning_rate / (jnp.sqrt(m) + h.eps)
    if c.weight_decay_mode == "l2":
        w = (1.0 - mult * wd)[:, None] * w
    elif c.weight_decay_mode == "decoupled":
        w = (1.0 - h.learning_rate * wd) * w
    return w - mult[:, None] * g, {"momentum1": m}


def _moments(h, g, s, t, d, row_wise_v: bool):
    """Adam's moments and the bias-corrected step direction ``m̂ / (sqrt(v̂) + eps)``."""
    m = h.beta1 * s["exp_avg"] + (1.0 - h.beta1) * g
    sq = _row_sum(g * g) / d if row_wise_v else g * g
    v = h.beta2 * s["exp_avg_sq"] + (1.0 - h.beta2) * sq
    m_hat = m / (1.0 - jnp.power(h.beta1, t))
    v_hat = v / (1.0 - jnp.power(h.beta2, t))
    denom = jnp.sqrt(v_hat) + h.eps
    direction = m_hat / (denom[:, None] if row_wise_v else denom)
    return direction, {"exp_avg": m, "exp_avg_sq": v}


def _adam(c, h, w, g, s, t, d, mask):
    """ADAM (= optax.adamw with eps_root=0)::

        m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g²;  m̂ = m / (1-b1^t);  v̂ = v / (1-b2^t)
        w -= lr * (m̂ / (sqrt(v̂) + eps) + weight_decay * w)

    ``t`` is the global step: a row seen for the first time at step 100 gets step 100's
    bias correction (FBGEMM's default; its ``use_rowwise_bias_correction`` is not modelled).
    """
    direction, new = _moments(h, g, s, t, d, row_wise_v=False)
    return w - h.learning_rate * (direction + h.weight_decay * w), new


def _partial_rowwise_adam(c, h, w, g, s, t, d, mask):
    """PARTIAL_ROWWISE_ADAM: as ADAM but one ``v`` per row, ``v = b2 v + (1-b2) mean_D(g²)``."""
    direction, new = _moments(h, g, s, t, d, row_wise_v=True)
    return w - h.learning_rate * (direction + h.weight_decay * w), new


def _lamb_step(h, w, direction, mask):
    r = jnp.where(mask, direction + h.weight_decay * w, 0.0)
    w_norm = jnp.sqrt(_row_sum(w * w))
    r_norm = jnp.sqrt(_row_sum(r * r))
    ok = (w_norm > 0) & (r_norm > 0)
    ratio = jnp.where(ok, w_norm / jnp.where(ok, r_norm, 1.0), 1.0)
    return w - h.learning_rate * ratio[:, None] * r


def _lamb(c, h, w, g, s, t, d, mask):
    """LAMB, Adam's moments per element::

        r = m̂ / (sqrt(v̂) + eps) + weight_decay * w
        w -= lr * (‖w‖ / ‖r‖) * r        (ratio 1 when ‖w‖ or ‖r‖ is 0)

    FBGEMM does not guard the ratio: there ``‖w‖ = 0`` gives ratio 0 (a zero row never
    moves) and ``‖r‖ = 0`` gives NaN. jaxrec uses 1 in both cases, as optax.lamb does.
    """
    direction, new = _moments(h, g, s, t, d, row_wise_v=False)
    return _lamb_step(h, w, direction, mask), new


def _partial_rowwise_lamb(c, h, w, g, s, t, d, mask):
    """PARTIAL_ROWWISE_LAMB: LAMB with one ``v`` per row, ``v = b2 v + (1-b2) mean_D(g²)``."""
    direction, new = _moments(h, g, s, t, d, row_wise_v=True)
    return _lamb_step(h, w, direction, mask), new


def _lars_sgd(c, h, w, g, s, t, d, mask):
    """LARS_SGD, one local learning rate per row::

        lr_local = lr * eta * ‖w‖ / (‖g‖ + weight_decay * ‖w‖)   (0 when the denominator is 0)
        mom = momentum * mom + lr_local * (g + weight_decay * w);   w -= mom

    As FBGEMM: ``‖w‖ = 0`` gives ``lr_local = 0``. The guard only replaces FBGEMM's 0/0 NaN
    (then ``g + weight_decay * w = 0``, so the step does not depend on it). optax.lars
    differs: its denominator is ``‖g + weight_decay * w‖`` and its ratio is 1 on zero norms.
    """
    w_norm = jnp.sqrt(_row_sum(w * w))
    g_norm = jnp.sqrt(_row_sum(g * g))
    lr_local = _safe_div(h.learning_rate * h.eta * w_norm, g_norm + h.weight_decay * w_norm)
    mom = h.momentum * s["momentum_buffer"] + lr_local[:, None] * (g + h.weight_decay * w)
    return w - mom, {"momentum_buffer": mom}


_RULES = {
    C.SGD: _sgd,
    C.Adagrad: _adagrad,
    C.RowWiseAdagrad: _rowwise_adagrad,
    C.Adam: _adam,
    C.PartialRowWiseAdam: _partial_rowwise_adam,
    C.LAMB: _lamb,
    C.PartialRowWiseLAMB: _partial_rowwise_lamb,
    C.LarsSGD: _lars_sgd,
}


def update_rows(config: C.OptimizerConfig, hparams: C.OptimizerHyperparams, weights, grads,
                state_rows, *, dims=None, keys=None):
    """One optimizer step on a batch of unique rows; see the module doc and each rule.

    Args:
      config: the optimizer (its static fields; its numbers come from ``hparams``).
      hparams: ``config.hyperparams()``, possibly traced.
      weights: ``[n, D]`` rows (float32, float16 or bfloat16).
      grads: ``[n, D]`` summed gradients of those rows (``gradient_clipping`` is applied
        before the backward, to the output gradient: see :func:`clip_output_gradient`).
      state_rows: ``config.state_type`` whose ``step`` is the count of updates so far and
        whose buffers hold the rows' state: ``[n, D]`` per element, ``[n]`` per row.
      dims: optional ``int[n]``: row i uses its first ``dims[i]`` columns (tables of a
        smaller dim in a ``[n, max_dim]`` batch); other columns are returned unchanged.
      keys: ``int[n]``, each row's index among all tables' rows; needed when
        ``config.stochastic_rounding`` rounds float16/bfloat16 weights (it seeds the bits).

    Returns:
      ``(new_weights, new_state_rows)`` in the input dtypes, ``step`` incremented.
    """
    rule = _RULES.get(type(config))
    if rule is None:
        if isinstance(config, C.NoOptimizer):
            raise ValueError("NoOptimizer has no update: take the table gradient instead "
                             "(jax.grad of embedding_bag_lookup, or embedding_bag_sparse_grad) "
                             "and apply optax to it")
        raise TypeError(f"config must be a jaxrec.optim optimizer config, got {type(config).__name__}")
    if not isinstance(hparams, C.OptimizerHyperparams):
        raise TypeError(f"hparams must be an OptimizerHyperparams (config.hyperparams()), "
                        f"got {type(hparams).__name__}")
    if type(state_rows) is not config.state_type:
        raise TypeError(f"state_rows must be a {config.state_type.__name__}, got "
                        f"{type(state_rows).__name__}")
    weights, grads = jnp.asarray(weights), jnp.asarray(grads)
    if weights.ndim != 2 or grads.shape != weights.shape:
        raise ValueError(f"weights and grads must both be [n, D], got {tuple(weights.shape)} "
                         f"and {tuple(grads.shape)}")
    n, width = weights.shape
    h = jax.tree.map(lambda x: jnp.asarray(x, _F32), hparams)

    if dims is None:
        mask = jnp.ones((n, width), bool)
        d = jnp.full((n,), width, _F32)
    else:
        dims = jnp.asarray(dims)
        mask = jnp.arange(width, dtype=dims.dtype) < dims[:, None]
        d = jnp.maximum(dims, 1).astype(_F32)
    w = jnp.where(mask, weights.astype(_F32), 0.0)
    g = jnp.where(mask, grads.astype(_F32), 0.0)

    step = jnp.asarray(state_rows.step) + 1
    t = step.astype(_F32)
    names = buffer_fields(config.state_type)
    old = {name: getattr(state_rows, name) for name in names}
    s = {name: jnp.where(mask, x.astype(_F32), 0.0) if x.ndim == 2 else x.astype(_F32)
         for name, x in old.items()}
    w_new, new = rule(config, h, w, g, s, t, d, mask)

    w_new = jnp.where(mask, w_new, 0.0)
    norm = jnp.sqrt(_row_sum(w_new * w_new))
    clip = (h.max_norm > 0) & (norm > h.max_norm)
    w_new = w_new * jnp.where(clip, h.max_norm / jnp.where(clip, norm, 1.0), 1.0)[:, None]

    if config.stochastic_rounding and weights.dtype != jnp.float32:
        if keys is None:
            raise ValueError("update_rows: stochastic_rounding of float16/bfloat16 weights needs "
                             "keys (each row's index among all tables' rows) to draw its bits")
        w_new = stochastic_round(w_new, weights.dtype, rounding_bits(config.seed, step, keys, width))
    out_w = jnp.where(mask, w_new.astype(weights.dtype), weights)
    out_s = {name: (jnp.where(mask, new[name].astype(x.dtype), x) if x.ndim == 2
                    else new[name].astype(x.dtype)) for name, x in old.items()}
    return out_w, config.state_type(step=step, **out_s)
