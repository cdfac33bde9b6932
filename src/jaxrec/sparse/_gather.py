"""Traceable gathers over jagged layouts with static output sizes.

Every re-layout of jagged data (``permute``, ``split``, ``concat``, ``__getitem__``,
``from_jt_dict``) is one *segment gather*: the output is a list of contiguous source
segments laid end to end, then zero padding up to a static output capacity::

    source values   [a0 a1 a2 | b0 | c0 c1 | pad pad]      segments a, b, c
    take (c, a)     [c0 c1 a0 a1 a2 | 0 0 0 ...]           out_capacity slots

Output slot ``p`` finds its segment with ``searchsorted`` over the output offsets, so the
cost is O(out_capacity * log(num_segments)) and no value outside a segment is ever read.

The entry points are jitted (static sizes) so that eager use compiles once per shape
instead of dispatching op by op; under an outer ``jit`` they are inlined.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@jax.jit
def exclusive_cumsum(lengths: jax.Array) -> jax.Array:
    """``[0, l0, l0+l1, ...]``: offsets (int32, one longer than ``lengths``)."""
    lengths = lengths.astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths, dtype=jnp.int32)])


def segment_gather_index(
    starts: jax.Array, seg_lengths: jax.Array, out_capacity: int
) -> tuple[jax.Array, jax.Array]:
    """Source index and validity of each of ``out_capacity`` output slots.

    Args:
      starts: int32[S], where segment ``s`` begins in the source.
      seg_lengths: int32[S], how many entries segment ``s`` has.
      out_capacity: static size of the output.

    Returns:
      ``(src, valid)``: int32[out_capacity] source positions (0 where invalid) and
      bool[out_capacity], True for the first ``sum(seg_lengths)`` slots.
    """
    num_segments = starts.shape[0]
    pos = jnp.arange(out_capacity, dtype=jnp.int32)
    if num_segments == 0:
        return jnp.zeros((out_capacity,), jnp.int32), jnp.zeros((out_capacity,), bool)
    out_offsets = exclusive_cumsum(seg_lengths)
    seg = jnp.searchsorted(out_offsets, pos, side="right").astype(jnp.int32) - 1
    seg = jnp.clip(seg, 0, num_segments - 1)
    valid = pos < out_offsets[-1]
    src = starts.astype(jnp.int32)[seg] + (pos - out_offsets[seg])
    return jnp.where(valid, src, 0), valid


def take_valid(x: jax.Array, src: jax.Array, valid: jax.Array) -> jax.Array:
    """``x[src]`` along axis 0 with invalid slots set to 0 (any trailing dims)."""
    out_shape = src.shape + x.shape[1:]
    if x.shape[0] == 0:
        return jnp.zeros(out_shape, x.dtype)
    gathered = jnp.take(x, jnp.clip(src, 0, x.shape[0] - 1), axis=0, mode="clip")
    mask = valid.reshape(valid.shape + (1,) * (x.ndim - 1))
    return jnp.where(mask, gathered, jnp.zeros((), x.dtype))


@functools.partial(jax.jit, static_argnums=3)
def gather_segments(
    arrays: tuple[jax.Array | None, ...],
    starts: jax.Array,
    seg_lengths: jax.Array,
    out_capacity: int,
) -> tuple[jax.Array | None, ...]:
    """Applies one segment gather to several aligned arrays (values, weights); None stays None."""
    src, valid = segment_gather_index(starts, seg_lengths, out_capacity)
    return tuple(None if a is None else take_valid(a, src, valid) for a in arrays)


@functools.partial(jax.jit, static_argnums=2)
def padded_dense(x: jax.Array, offsets: jax.Array, desired_length: int, padding_value) -> jax.Array:
    """``[N, desired_length, ...]``: bag ``i`` = ``x[offsets[i]:offsets[i+1]]``, cut or padded."""
    lengths = offsets[1:] - offsets[:-1]
    col = jnp.arange(desired_length, dtype=jnp.int32)
    src = offsets[:-1, None] + col[None, :]
    valid = col[None, :] < lengths[:, None]
    out_shape = src.shape + x.shape[1:]
    if x.shape[0] == 0:
        return jnp.full(out_shape, padding_value, x.dtype)
    gathered = jnp.take(x, jnp.clip(src, 0, x.shape[0] - 1), axis=0, mode="clip")
    mask = valid.reshape(valid.shape + (1,) * (x.ndim - 1))
    return jnp.where(mask, gathered, jnp.asarray(padding_value, x.dtype))
