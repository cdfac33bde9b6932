"""Ids to the shard owners, pooled results back to the batch owners (inside ``shard_map``).

Input distribution. Ids are ragged, so instead of an all-to-all of variable-sized id
lists every device ``all_gather`` s the local KJTs (static capacity ``C``)::

    # device s holds  values [C], lengths [F, B], weights [C]   (its B samples)
    # all_gather  ->  values [N, C], lengths [N, F, B], weights [N, C]   on every device

Each device then builds, per group, the KJT of its slots for the global batch of
``N * B`` bags (bag ``s * B + b`` = sample b of device s): the ids of each slot's feature
that fall in the slot's rows, moved to the slot's virtual rows, in their original
order; the other ids are dropped (compacted away, not masked: a masked id would still
count as a touched row for the fused optimizer). Capacity ``N * C`` per group.

MEAN pooling is SUM pooling with per-sample weights ``w / L``, where ``L`` is the bag's
length on its source device, i.e. the global length: a row-wise shard sees only part of
a bag, and must still divide by the whole bag's length.

Output distribution (after each group's lookup of ``[N * B, S * D]``)::

    a2a groups     all_to_all over the batch  -> [N(source), B, width]  (from every device)
    reduce groups  psum_scatter over the batch -> [B, width]            (partial sums added)
    either         or already pooled from the rows sent back (``_row_return``)
    dp groups      the local [B, width]
    output column c = sum over k of [received | reduced | dp | 0][:, contributors[k][c]]

JAX differentiates all of it: the transpose of ``all_to_all`` is an ``all_to_all``, of
``psum_scatter`` an ``all_gather``, of ``all_gather`` a ``psum_scatter``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec.fused import fused_lookup
from jaxrec.ops import BoundsCheckMode, PoolingMode, embedding_bag_lookup
from jaxrec.ops.tbe_reference import bag_of_position
from jaxrec.parallel._layout import A2A, DP, REDUCE, Group, ShardedLayout


class Ids(NamedTuple):
    """KJTs of ``sources`` devices side by side: values ``[sources, C]``, lengths
    ``[sources, F, B]``, weights ``[sources, C]`` or None."""

    values: jax.Array
    lengths: jax.Array
    weights: jax.Array | None


def local_ids(values, lengths, weights, num_features: int) -> Ids:
    """This device's KJT as ``Ids`` of one source."""
    return Ids(values[None], lengths.reshape(1, num_features, -1),
               None if weights is None else weights[None])


def gather_ids(ids: Ids, axis: str) -> Ids:
    """Every device's KJT on every device (``all_gather`` over ``axis``)."""
    def gather(x):
        return None if x is None else jax.lax.all_gather(x[0], axis)
    return Ids(gather(ids.values), gather(ids.lengths), gather(ids.weights))


def _exclusive_cumsum(x, axis=-1):
    zeros = jnp.zeros(x.shape[:axis % x.ndim] + (1,), x.dtype)
    return jnp.concatenate([zeros, jnp.cumsum(x, axis=axis, dtype=x.dtype)], axis=axis)


def group_input(ids: Ids, slots: dict[str, jax.Array], mean_feature: np.ndarray, *,
                weighted: bool, need_weights: bool):
    """``(values, offsets, per_sample_weights)`` of one group's slots (module doc).

    ``slots``: this device's rows of ``Group.slot_arrays`` (``slot_of_feature [F]``,
    ``slot_feature [S]``, ``offset``, ``lo``, ``hi [S]``). Bags are slot-major, then source,
    then sample; ``per_sample_weights`` is None unless ``need_weights``.
    """
    values, lengths, weights = ids
    sources, cap = values.shape
    num_features, batch = lengths.shape[1:]
    dtype = values.dtype
    flat_lengths = lengths.reshape(sources, num_features * batch).astype(dtype)
    offsets = _exclusive_cumsum(flat_lengths)                              # [sources, F*B+1]
    bag = jax.vmap(bag_of_position, in_axes=(0, None))(offsets, cap)       # [sources, C]
    valid = (bag >= 0) & (bag < num_features * batch)
    bag = jnp.clip(bag, 0, num_features * batch - 1)
    feature, sample = bag // batch, bag % batch

    slot = jnp.where(valid, slots["slot_of_feature"].astype(dtype)[feature], -1)
    safe = jnp.maximum(slot, 0)
    lo, hi = slots["lo"].astype(dtype)[safe], slots["hi"].astype(dtype)[safe]
    keep = (slot >= 0) & (values >= lo) & (values < hi)
    virtual = values - lo + slots["offset"].astype(dtype)[safe]

    # Kept ids per source bag, then the group's lengths [S, sources, B].
    source = jnp.arange(sources, dtype=dtype)[:, None]
    segment = (source * (num_features * batch) + bag).ravel()
    kept = jax.ops.segment_sum(keep.astype(dtype).ravel(), segment,
                               num_segments=sources * num_features * batch)
    kept = kept.reshape(sources, num_features, batch)
    slot_feature = slots["slot_feature"]
    group_lengths = jnp.where((slot_feature >= 0)[:, None, None],
                              kept[:, jnp.maximum(slot_feature, 0), :].transpose(1, 0, 2), 0)
    group_offsets = _exclusive_cumsum(group_lengths.ravel())

    # Destination of each kept id: its bag's start + its rank among the kept ids of the bag.
    count = _exclusive_cumsum(keep.astype(dtype).ravel())
    bag_start = jnp.take_along_axis(offsets, bag, axis=1) + source * cap
    rank = count[:-1].reshape(sources, cap) - count[bag_start]
    group_bag = (safe * sources + source) * batch + sample
    dest = jnp.where(keep, group_offsets[group_bag] + rank, sources * cap).ravel()
    out_values = jnp.zeros((sources * cap,), dtype).at[dest].set(virtual.ravel(), mode="drop")

    psw = None
    if need_weights:
        w = weights.astype(jnp.float32) if weighted else jnp.ones(values.shape, jnp.float32)
        if mean_feature.any():
            length = jnp.take_along_axis(flat_lengths, bag, axis=1).astype(jnp.float32)
            w = jnp.where(jnp.asarray(mean_feature)[feature], w / jnp.maximum(length, 1.0), w)
        psw = jnp.zeros((sources * cap,), jnp.float32).at[dest].set(w.ravel(), mode="drop")
    return out_values, group_offsets, psw


class Windows(NamedTuple):
    """Each source's ids of the features of ``S`` slots, read from fixed windows
    (``feature_windows``); ``[S, sources, ...]`` each."""

    ids: jax.Array         # [S, sources, W] the window's ids (garbage where not inside)
    inside: jax.Array      # [S, sources, W] True for the feature's real ids
    position: jax.Array    # [S, sources, W] their positions in the source's KJT
    bag_length: jax.Array  # [S, sources, B]
    bag_start: jax.Array   # [S, sources, B + 1] within the window


def feature_windows(ids: Ids, feature: jax.Array, window: int) -> Windows:
    """The ids of feature ``feature[s]`` (-1: none) of every source, ``window`` positions
    from where that feature starts in the source's KJT (``max_ids_per_bag``: a source's
    ids of one feature are contiguous and fit ``B * max_ids_per_bag`` positions)."""
    values, lengths, _ = ids
    cap = values.shape[1]
    dtype = values.dtype
    real = feature >= 0
    f = jnp.maximum(feature, 0)
    lengths = lengths.astype(dtype)
    feature_start = _exclusive_cumsum(lengths.sum(-1))[:, :-1]            # [sources, F]
    bag_length = jnp.where(real[:, None, None], lengths[:, f, :].transpose(1, 0, 2), 0)
    bag_start = _exclusive_cumsum(bag_length)                              # [S, sources, B+1]
    inside = jnp.arange(window, dtype=dtype) < bag_start[..., -1:]         # [S, sources, W]
    position = jnp.clip(feature_start.T[f][..., None] + jnp.arange(window, dtype=dtype), 0, cap - 1)
    source = jnp.arange(values.shape[0])[None, :, None]
    return Windows(values[source, position], inside, position, bag_length, bag_start)


def window_samples(windows: Windows) -> jax.Array:
    """``[S, sources, W]``: the sample (bag) of each window position (B past the last)."""
    num_slots, sources, batch = windows.bag_length.shape
    flat = windows.bag_start.reshape(num_slots * sources, batch + 1)
    sample = jax.vmap(bag_of_position, in_axes=(0, None))(flat, windows.ids.shape[-1])
    return sample.reshape(windows.ids.shape)


def window_weights(ids: Ids, windows: Windows, feature: jax.Array, mean_feature: np.ndarray, *,
                   weighted: bool) -> jax.Array:
    """``[S, sources, W]`` float32 per-sample weights of the window positions: the KJT's
    weights (or 1), divided by the bag's length for MEAN features."""
    if weighted:
        source = jnp.arange(ids.values.shape[0])[None, :, None]
        w = ids.weights[source, windows.position].astype(jnp.float32)
    else:
        w = jnp.ones(windows.ids.shape, jnp.float32)
    if not mean_feature.any():
        return w
    batch = windows.bag_length.shape[-1]
    sample = jnp.clip(window_samples(windows), 0, batch - 1)
    length = jnp.take_along_axis(windows.bag_length, sample, axis=2)
    mean = jnp.asarray(mean_feature)[jnp.maximum(feature, 0)][:, None, None]
    return jnp.where(mean, w / jnp.maximum(length, 1).astype(jnp.float32), w)


def window_input(ids: Ids, slots: dict[str, jax.Array], mean_feature: np.ndarray, window: int,
                 *, weighted: bool, need_weights: bool):
    """``group_input`` over windows: the same ``(values, offsets, per_sample_weights)``, from
    only the ids of this device's slots' features (``max_ids_per_bag``).

    Gathering each (slot, source)'s window (``feature_windows``) gives ``[S, sources, W]``
    ids already in the group's bag order (slot, source, sample), so the compaction is one
    running count. Capacity ``S * sources * W`` instead of ``sources * C``: a table-wise
    device reads the ids of its own features only.
    """
    dtype = ids.values.dtype
    feature = slots["slot_feature"]                                        # [S]
    windows = feature_windows(ids, feature, window)
    num_slots, sources = windows.bag_length.shape[:2]
    lo, hi, offset = (slots[k].astype(dtype)[:, None, None] for k in ("lo", "hi", "offset"))
    keep = (windows.inside & (windows.ids >= lo) & (windows.ids < hi)).ravel()
    kept_before = _exclusive_cumsum(keep.astype(dtype))                    # [S*sources*W + 1]
    window_start = (jnp.arange(num_slots * sources, dtype=dtype) * window).reshape(num_slots, sources, 1)
    starts = (window_start + jnp.minimum(windows.bag_start[..., :-1], window)).ravel()  # NONE: cut
    offsets = jnp.concatenate([kept_before[starts], kept_before[-1:]])
    size = num_slots * sources * window
    dest = jnp.where(keep, kept_before[:-1], size)
    out_values = jnp.zeros((size,), dtype).at[dest].set((windows.ids - lo + offset).ravel(),
                                                         mode="drop")
    psw = None
    if need_weights:
        w = window_weights(ids, windows, feature, mean_feature, weighted=weighted)
        psw = jnp.zeros((size,), jnp.float32).at[dest].set(w.ravel(), mode="drop")
    return out_values, offsets, psw


def truncate_bags(values, lengths, weights, max_ids: np.ndarray):
    """This device's KJT with every bag of feature f cut to its first ``max_ids[f]`` ids
    (the correction of a bag longer than ``max_ids_per_bag``; ``lengths [F, B]``)."""
    dtype = values.dtype
    cap = values.shape[0]
    limit = jnp.asarray(max_ids, dtype)[:, None]
    offsets = _exclusive_cumsum(lengths.ravel().astype(dtype))
    bag = bag_of_position(offsets, cap)
    inside = (bag >= 0) & (bag < lengths.size)
    safe = jnp.clip(bag, 0, lengths.size - 1)
    rank = jnp.arange(cap, dtype=dtype) - offsets[safe]
    keep = inside & (rank < jnp.broadcast_to(limit, lengths.shape).ravel()[safe])
    dest = jnp.where(keep, _exclusive_cumsum(keep.astype(dtype))[:-1], cap)
    values = jnp.zeros_like(values).at[dest].set(values, mode="drop")
    if weights is not None:
        weights = jnp.zeros_like(weights).at[dest].set(weights, mode="drop")
    return values, jnp.minimum(lengths, limit.astype(lengths.dtype)), weights


def lookup(table, group: Group, values, offsets, psw, *, fused: bool, backend: str):
    """One group's SUM-pooled lookup ``[bags, S * D]`` (MEAN is in ``psw``)."""
    kwargs = {"pooling": PoolingMode.SUM, "per_sample_weights": psw,
              "bounds_check_mode": BoundsCheckMode.NONE, "backend": backend}
    if fused:
        return fused_lookup(table, values, offsets, **kwargs)
    return embedding_bag_lookup(table, values, offsets, layout=group.layout, **kwargs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def own_rows(x, axis: str, batch: int):
    """This device's ``batch`` rows of ``x`` (a result computed alike on every device for
    the global batch). Backward: the cotangents of every device, gathered, so that each
    copy of the computation receives the gradient of the whole batch."""
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * batch, batch)


def _own_rows_fwd(x, axis, batch):
    return own_rows(x, axis, batch), None


def _own_rows_bwd(axis, batch, _, ct):
    return (jax.lax.all_gather(ct, axis, tiled=True),)


own_rows.defvjp(_own_rows_fwd, _own_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def repeated(x, copies: int):
    """``x``, fed to a computation that each of ``copies`` devices repeats alike (the
    data-parallel lookup of the global batch): every copy's backward yields the whole
    gradient, so the sum over the copies is divided by their number."""
    return x


def _repeated_fwd(x, copies):
    return x, None


def _repeated_bwd(copies, _, ct):
    return (ct / copies,)


repeated.defvjp(_repeated_fwd, _repeated_bwd)


def assemble(layout: ShardedLayout, outputs: dict[str, list], axis: str, batch: int,
             comm_dtype=jnp.float32) -> jax.Array:
    """The ``[B, total_dim]`` pooled output of this device's samples (module doc).

    ``outputs[A2A]``, ``outputs[REDUCE]``: ``(x, pooled)`` per group, in group order: the
    group's lookup for the global batch, or (pooled) this device's bags already in the
    layout that the collective gives (``_row_return``); ``outputs[DP]``: ``[B, width]``.
    ``comm_dtype``: what the all-to-all and the reduce-scatter carry (the cotangents too:
    the transpose of a cast is a cast); the result is float32 again."""
    n = layout.world_size
    parts = []
    sent = [x for x, pooled in outputs[A2A] if not pooled]
    if sent:
        sent = jnp.concatenate(sent, axis=1).astype(comm_dtype)            # [N*B, W]
        received = jax.lax.all_to_all(sent, axis, 0, 0, tiled=True)         # [N(source)*B, W]
        received = received.astype(jnp.float32).reshape(n, batch, -1).transpose(1, 0, 2)
        received = _split(received, [x.shape[1] for x, pooled in outputs[A2A] if not pooled])
    if outputs[A2A]:  # [B, N(source), a2a width]: each group's columns, in group order
        parts.append(jnp.concatenate(
            [x.reshape(batch, n, -1) if pooled else received.pop(0)
             for x, pooled in outputs[A2A]], axis=2).reshape(batch, -1))
    partials = [x for x, pooled in outputs[REDUCE] if not pooled]
    if partials:
        partial = jnp.concatenate(partials, axis=1).astype(comm_dtype)     # [N*B, W]
        reduced = jax.lax.psum_scatter(partial, axis, scatter_dimension=0, tiled=True)
        reduced = _split(reduced.astype(jnp.float32), [x.shape[1] for x in partials])
    for x, pooled in outputs[REDUCE]:
        parts.append(x if pooled else reduced.pop(0))
    if outputs[DP]:
        parts.append(jnp.concatenate(outputs[DP], axis=1))
    parts.append(jnp.zeros((batch, 1), jnp.float32))
    return sum_columns(jnp.concatenate(parts, axis=1), layout.contributors)


def _split(x, widths) -> list[jax.Array]:
    return jnp.split(x, np.cumsum(widths)[:-1], axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def sum_columns(x, contributors: tuple[tuple[int, ...], ...]):
    """``sum_k x[:, contributors[k]]`` (``ShardedLayout.contributors``; the last column of
    ``x`` is zeros). Every other column of ``x`` feeds exactly one output column, so the
    backward is a gather too (XLA would transpose the gathers into a scatter-add of the
    whole ``[B, width]``)."""
    out = x[:, np.asarray(contributors[0])]
    for columns in contributors[1:]:
        out = out + x[:, np.asarray(columns)]
    return out


def _sum_columns_fwd(x, contributors):
    return sum_columns(x, contributors), x.shape[1]


def _sum_columns_bwd(contributors, width, ct):
    ct = jnp.concatenate([ct, jnp.zeros((ct.shape[0], 1), ct.dtype)], axis=1)
    return (ct[:, _feeds(contributors, width)],)


@functools.cache
def _feeds(contributors: tuple[tuple[int, ...], ...], width: int) -> np.ndarray:
    """``[width]``: the output column that each column of ``x`` feeds (``total_dim``: none)."""
    total = len(contributors[0])
    feeds = np.full(width, total, np.int64)
    for columns in contributors:
        for c, j in enumerate(columns):
            if j != width - 1:  # the zero column feeds many; its gradient is dropped
                assert feeds[j] == total, f"column {j} feeds two output columns"
                feeds[j] = c
    return feeds


sum_columns.defvjp(_sum_columns_fwd, _sum_columns_bwd)
