"""Initial TT cores: ``init_tt_cores(key, layout, weight_dist)``.

The dense tables of jaxrec (TorchRec's default) start as ``U(-1/sqrt(n), 1/sqrt(n))``:
entries of standard deviation ``sigma = 1/sqrt(3 n)``. Every TT distribution is scaled to
that ``sigma`` of the *full table's* entries (``n = num_embeddings``), so a TT table and
a dense one start with the same magnitude. An entry of the full table is a sum of
``R = r[1] * ... * r[T-1]`` products of T core entries; with i.i.d. zero-mean cores of
variance ``s²`` its variance is ``R * s^(2T)``, hence ``s = (sigma² / R) ** (1 / 2T)``.

``weight_dist`` (FBTT's names, jaxrec's definitions):

* ``"uniform"`` / ``"normal"``: the *cores'* entries are i.i.d. ``U(-a, a)`` / ``N(0, s²)``
  of that variance. The table's entries are then sums of products: close to normal for
  large ranks, heavy-tailed for small ones.
* ``"approx-normal"``: the *table's* entries follow ``N(0, sigma²)`` approximately: normal
  cores as above, which by the central limit theorem over the rank paths gives
  near-normal entries (excess kurtosis ``3 * (prod_t (1 + 2 / r_t) - 1)`` over the inner
  ranks: about 0.8 at ranks 16, 16) — the default, as in FBTT.
* ``"approx-uniform"``: the *table's* entries follow ``U(-1/sqrt(n), 1/sqrt(n))``
  approximately. Rank channel 0 of every core carries a factor ``X_t`` with
  ``-log|X_t| ~ Gamma(1/T)``, so that ``prod_t |X_t| = exp(-Gamma(1))`` is exactly ``U(0, 1)``;
  a random sign on the first core makes the product ``U(-1, 1)``. The other rank channels
  hold small normal entries (relative size ``NOISE``), so the product is only
  approximately uniform and every rank channel gets gradients (a pure rank-1 start
  would never leave rank 1). FBTT builds its "approx-uniform" with a saw-tooth
  construction for three cores only; this one is defined for any number of cores, but is
  rough for four cores with small slices, and its signs are balanced over all p0 * q0
  slices of core 0, so a table using only some of them (``prod(p) > num_embeddings``)
  can be off-centre (an xfail test records it).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxrec.ops.tt_layout import TTLayout

WEIGHT_DISTS = ("uniform", "normal", "approx-uniform", "approx-normal")
NOISE = 0.05
"""Relative size of the off-channel entries of "approx-uniform"."""


def table_std(layout: TTLayout) -> float:
    """``sigma = 1/sqrt(3 n)``: the entry std of jaxrec's default dense table."""
    return 1.0 / math.sqrt(3.0 * layout.num_embeddings)


def init_tt_cores(key: jax.Array, layout: TTLayout,
                  weight_dist: str = "approx-normal") -> tuple[jax.Array, ...]:
    """The T initial cores, float32, of shapes ``layout.core_shapes``; see the module doc."""
    if weight_dist not in WEIGHT_DISTS:
        raise ValueError(f"weight_dist must be one of {WEIGHT_DISTS}, got {weight_dist!r}")
    keys = jax.random.split(key, layout.num_cores)
    if weight_dist == "approx-uniform":
        return _approx_uniform(keys, layout)
    s = _core_std(layout)
    if weight_dist == "uniform":
        a = s * math.sqrt(3.0)
        return tuple(jax.random.uniform(k, shape, jnp.float32, -a, a)
                     for k, shape in zip(keys, layout.core_shapes))
    return tuple(s * jax.random.normal(k, shape, jnp.float32)
                 for k, shape in zip(keys, layout.core_shapes))


def _core_std(layout: TTLayout) -> float:
    paths = math.prod(layout.ranks)
    return (table_std(layout) ** 2 / paths) ** (1.0 / (2 * layout.num_cores))


def _approx_uniform(keys, layout: TTLayout) -> tuple[jax.Array, ...]:
    num_cores = layout.num_cores
    bound = 1.0 / math.sqrt(layout.num_embeddings)
    # Each core's channel-0 factor is scaled by bound^(1/T), so the product spans +-bound.
    per_core = bound ** (1.0 / num_cores)
    cores = []
    for t, (k, shape) in enumerate(zip(keys, layout.core_shapes)):
        k_gamma, k_sign, k_noise = jax.random.split(k, 3)
        r_in, p, q, r_out = shape
        factor = jnp.exp(-jax.random.gamma(k_gamma, 1.0 / num_cores, (p, q), jnp.float32))
        if t == 0:  # balanced signs: half of the (i0, j0) slices positive, half negative
            order = jax.random.permutation(k_sign, p * q).reshape(p, q)
            factor = factor * jnp.where(2 * order < p * q, 1.0, -1.0).astype(jnp.float32)
        # Noise channels: a path through any nonzero channel multiplies T noise-sized
        # entries, so the perturbation of an entry stays ~NOISE relative to bound.
        paths = math.prod(layout.ranks)
        noise_std = per_core * NOISE * paths ** (-1.0 / (2 * num_cores))
        core = noise_std * jax.random.normal(k_noise, shape, jnp.float32)
        core = core.at[0, :, :, 0].set(per_core * factor)
        cores.append(core)
    return tuple(cores)
