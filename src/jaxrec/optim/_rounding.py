"""Stochastic rounding of float16/bfloat16 weights, deterministic given a seed and step.

The jnp twin of ``StochasticRound`` / ``RoundingBits`` in csrc/common/fused_optimizer.h:
the same integer hash in uint32 arithmetic, so kernel and reference draw the same bits.
A float32 value ``x`` is rounded to a type that keeps ``23 - drop`` mantissa bits by
adding ``drop`` random low bits to its bit pattern and truncating them: it rounds up with
probability equal to the dropped fraction, so the rounding is unbiased. bfloat16 drops
16 bits; float16 drops 13 (exact in its normal range; below it the final conversion
rounds to nearest). inf and NaN pass through.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_DROP = {"bfloat16": 16, "float16": 13}


def _mix(x: jax.Array) -> jax.Array:
    """The "lowbias32" integer hash (uint32 wrap-around arithmetic)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def rounding_bits(seed: int, step, keys: jax.Array, width: int) -> jax.Array:
    """uint32[n, width] random bits of row ``keys[i]`` (its index among all tables' rows), column j."""
    x = _mix(jnp.uint32(seed) ^ _mix(jnp.asarray(step).astype(jnp.uint32)))
    keys = jnp.asarray(keys)
    x = _mix(x ^ keys.astype(jnp.uint32))  # the low 32 bits (wrap-around conversion)
    high = (keys >> 32).astype(jnp.uint32) if keys.dtype.itemsize == 8 else jnp.zeros_like(x)
    x = _mix(x ^ high)
    return _mix(x[:, None] ^ jnp.arange(width, dtype=jnp.uint32))


def stochastic_round(x: jax.Array, dtype, bits: jax.Array) -> jax.Array:
    """float32 ``x`` rounded stochastically to float16/bfloat16 ``dtype`` with random ``bits``."""
    drop = _DROP[jnp.dtype(dtype).name]
    mask = jnp.uint32((1 << drop) - 1)
    raw = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    finite = (raw & jnp.uint32(0x7F800000)) != jnp.uint32(0x7F800000)
    rounded = jax.lax.bitcast_convert_type((raw + (bits & mask)) & ~mask, jnp.float32)
    return jnp.where(finite, rounded, x).astype(dtype)
