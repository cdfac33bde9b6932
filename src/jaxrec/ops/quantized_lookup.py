"""``quantized_lookup``: FBGEMM's inference TBE lookup over quantized, read-only tables.

Every feature in one launch, each table at its own precision (mixed in one call)::

    # tables: t0 int8 [rows 1000, 4 + 64] (dim 64), t1 fp16 [rows 50, 16]
    # feature_tables = [0, 0, 1]: features 0 and 1 read t0, feature 2 reads t1
    out = quantized_lookup([t0, t1], ["int8", "fp16"], [0, 0, 1], indices, offsets)
    # out [B, 64 + 64 + 16]; offsets [3 * B + 1], FBGEMM's feature-major bags

A table is float32 ``[rows, dim]`` ("fp32"), float16 ``[rows, dim]`` ("fp16"), or
``uint8`` rows of ``jaxrec.ops.quantized_rows`` ("int8", "int4": a float16 scale and
bias, then the codes). Pooling SUM, MEAN (an empty bag gives zeros) or NONE (row p of
the output ``[N, dim]`` is the dequantized row of ``indices[p]``, zeros on padding; all
features share one dim); per-sample weights weight the ids of SUM and MEAN; the output
is float32, float16 or bfloat16, summed in float32.

Bad input: an id outside ``[0, rows)`` of its table reads row 0 (FBGEMM's correction,
the collections' default WARNING mode, without the count: a served model has nobody to
warn), and no read leaves the operands: the kernels clamp each bag into ``[0, N]``, the
reference clamps the offsets and makes them non-decreasing (``clamp_offsets``); both
agree whenever the offsets do not decrease, as a KJT's never do.

The kernels (csrc/{cpu,cuda}/quantized_lookup.*) run where built, the jnp reference
(:func:`quantized_lookup_reference`, which dequantizes the gathered rows) elsewhere.
There is no gradient: ``jax.grad`` through the lookup raises a ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec import _ffi
from jaxrec.ops.quantized_rows import BITS, dequantize_rows, row_bytes
from jaxrec.ops.tbe_layout import PoolingMode, as_pooling_mode
from jaxrec.ops.tbe_reference import bag_of_position, clamp_offsets, position_scale

# precision -> bits of a column in the kernels' attribute; the dtype of its table.
PRECISION_BITS = {"fp32": 32, "fp16": 16, **BITS}
_TABLE_DTYPES = {"fp32": jnp.float32, "fp16": jnp.float16, "int8": jnp.uint8, "int4": jnp.uint8}
MAX_FEATURES_PER_CALL = 64  # csrc/common/quantized_lookup.h's kMaxQuantizedFeatures


def table_dim(table, precision: str) -> int:
    """Columns of a table of ``precision`` (its row width for fp32 / fp16)."""
    width = table.shape[1]
    return width if precision in ("fp32", "fp16") else (width - 4) * 8 // BITS[precision]


def quantized_lookup(tables: Sequence[jax.Array], precisions: Sequence[str], feature_tables: Sequence[int],
                     indices: jax.Array, offsets: jax.Array, *, pooling: PoolingMode | int | str = PoolingMode.SUM,
                     per_sample_weights: jax.Array | None = None, output_dtype=jnp.float32,
                     backend: str = "auto") -> jax.Array:
    """``[B, sum of the features' dims]`` pooled (``[N, dim]`` for NONE); module doc."""
    tables = tuple(jnp.asarray(t) for t in tables)
    precisions, feature_tables = tuple(precisions), tuple(int(t) for t in feature_tables)
    pooling = as_pooling_mode(pooling)
    indices, offsets = jnp.asarray(indices), jnp.asarray(offsets)
    _validate(tables, precisions, feature_tables, indices, offsets, pooling, per_sample_weights, output_dtype)
    psw = (jnp.zeros((0,), jnp.float32) if per_sample_weights is None
           else jnp.asarray(per_sample_weights, jnp.float32))
    return _lookup(_Lookup(precisions, feature_tables, pooling, jnp.dtype(output_dtype), backend),
                   indices, offsets, psw, *tables)


@dataclasses.dataclass(frozen=True)
class _Lookup:
    """What a lookup is, static under jit: its tables' precisions, each feature's table,
    pooling, output dtype and backend."""

    precisions: tuple[str, ...]
    feature_tables: tuple[int, ...]
    pooling: PoolingMode
    output_dtype: np.dtype
    backend: str


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup(lookup: _Lookup, indices, offsets, psw, *tables):
    """The lookup in calls of at most ``MAX_FEATURES_PER_CALL`` features (the kernels' limit)."""
    batch = (offsets.shape[0] - 1) // len(lookup.feature_tables)
    pieces = []
    for first in range(0, len(lookup.feature_tables), MAX_FEATURES_PER_CALL):
        chosen = lookup.feature_tables[first:first + MAX_FEATURES_PER_CALL]
        used = sorted(set(chosen))  # the tables of this call, renumbered
        call = _Call(tuple(lookup.precisions[t] for t in used), tuple(used.index(t) for t in chosen),
                     lookup.pooling, lookup.output_dtype)
        piece_offsets = offsets[first * batch:(first + len(chosen)) * batch + 1]
        pieces.append(_ffi.dispatch(call.kernel, call.reference, indices, piece_offsets, psw,
                                    *(tables[t] for t in used), backend=lookup.backend))
    if len(pieces) == 1:
        return pieces[0]
    if lookup.pooling == PoolingMode.NONE:  # each call wrote its own features' positions, zeros elsewhere
        return sum(p.astype(jnp.float32) for p in pieces).astype(lookup.output_dtype)
    return jnp.concatenate(pieces, axis=1)


def _lookup_fwd(lookup, *args):
    return _lookup(lookup, *args), None


def _lookup_bwd(lookup, _, g):
    raise ValueError("a quantized embedding table has no gradient: it is for serving. Train the "
                     "float model (EmbeddingBagCollection) and quantize it again")


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


class _Call:
    """One launch: its tables' precisions, each feature's table among them, pooling, output."""

    def __init__(self, precisions, feature_tables, pooling, output_dtype):
        self.precisions, self.feature_tables = precisions, feature_tables
        self.pooling, self.output_dtype = pooling, output_dtype

    def _out_shape(self, indices, offsets, tables):
        dims = [table_dim(tables[t], self.precisions[t]) for t in self.feature_tables]
        if self.pooling == PoolingMode.NONE:
            return (indices.shape[0], dims[0])
        return ((offsets.shape[0] - 1) // len(self.feature_tables), sum(dims))

    def kernel(self, indices, offsets, psw, *tables):
        out = jax.ShapeDtypeStruct(self._out_shape(indices, offsets, tables), self.output_dtype)
        call = jax.ffi.ffi_call("jaxrec_quantized_lookup", out, vmap_method="sequential")
        return call(indices, offsets, psw, *tables, pooling=np.int32(self.pooling),
                    feature_tables=np.asarray(self.feature_tables, np.int64),
                    bits=np.asarray([PRECISION_BITS[p] for p in self.precisions], np.int64))

    def reference(self, indices, offsets, psw, *tables):
        return quantized_lookup_reference(tables, self.precisions, self.feature_tables, indices, offsets,
                                          pooling=self.pooling,
                                          per_sample_weights=psw if psw.shape[0] else None,
                                          output_dtype=self.output_dtype)


def quantized_lookup_reference(tables, precisions, feature_tables, indices, offsets, *,
                               pooling=PoolingMode.SUM, per_sample_weights=None,
                               output_dtype=jnp.float32) -> jax.Array:
    """The lookup in jnp: each feature's gathered rows dequantized (``dequantize_rows``) and
    pooled; the oracle of the kernels and their fallback (module doc)."""
    pooling = as_pooling_mode(pooling)
    num_features, n = len(feature_tables), indices.shape[0]
    batch = (offsets.shape[0] - 1) // num_features
    offsets = clamp_offsets(offsets, n)
    bag = bag_of_position(offsets, n)
    scale = position_scale(offsets, per_sample_weights, bag, pooling)  # 0 outside bags
    feature = jnp.where((bag >= 0) & (bag < num_features * batch), bag // max(batch, 1), -1)
    blocks, sequence = [], None
    for f, t in enumerate(feature_tables):
        table, precision = tables[t], precisions[t]
        mine = feature == f
        ids = jnp.where(mine & (indices >= 0) & (indices < table.shape[0]), indices, 0)
        rows = jnp.take(table, ids, axis=0)
        vectors = rows.astype(jnp.float32) if precision in ("fp32", "fp16") else dequantize_rows(rows, precision)
        if pooling == PoolingMode.NONE:
            mine_rows = jnp.where(mine[:, None], vectors, 0.0)
            sequence = mine_rows if sequence is None else sequence + mine_rows
        else:
            segment = jnp.where(mine, bag - f * batch, batch)
            pooled = jax.ops.segment_sum(vectors * scale[:, None], segment, num_segments=batch + 1)
            blocks.append(pooled[:batch])
    out = sequence if pooling == PoolingMode.NONE else jnp.concatenate(blocks, axis=1)
    return out.astype(output_dtype)


def _validate(tables, precisions, feature_tables, indices, offsets, pooling, per_sample_weights, output_dtype):
    if len(precisions) != len(tables):
        raise ValueError(f"precisions must give one precision per table: {len(precisions)} for {len(tables)} tables")
    if not feature_tables:
        raise ValueError("feature_tables must name each feature's table; got none")
    for t, (table, precision) in enumerate(zip(tables, precisions)):
        if precision not in PRECISION_BITS:
            raise ValueError(f"precisions[{t}] must be one of {tuple(PRECISION_BITS)}, got {precision!r}")
        want = jnp.dtype(_TABLE_DTYPES[precision])
        if table.ndim != 2 or table.dtype != want or table.shape[0] < 1:
            raise ValueError(f"tables[{t}] ({precision}) must be {want.name}[rows >= 1, row width], got "
                             f"{table.dtype.name}{list(table.shape)}; quantize rows with "
                             "jaxrec.ops.quantized_rows.quantize_rows")
        dim = table_dim(table, precision)
        if precision in BITS:
            row_bytes(dim, precision)  # whole 32-bit words of codes, else a ValueError naming the fix
        elif dim * PRECISION_BITS[precision] % 32:
            raise ValueError(f"tables[{t}] (fp16) needs an even dim, got {dim}; keep it in fp32")
    bad = [t for t in feature_tables if not 0 <= t < len(tables)]
    if bad:
        raise ValueError(f"feature_tables {bad} name no table of the {len(tables)} given")
    if indices.ndim != 1 or indices.dtype not in (jnp.int32, jnp.int64) or offsets.dtype != indices.dtype:
        raise ValueError(f"indices and offsets must be 1-D, both int32 or both int64; got "
                         f"{indices.dtype}{list(indices.shape)} and {offsets.dtype}{list(offsets.shape)}")
    if offsets.ndim != 1 or offsets.shape[0] < 1 or (offsets.shape[0] - 1) % len(feature_tables):
        raise ValueError(f"offsets must hold F * B + 1 entries for F = {len(feature_tables)} features, got "
                         f"{offsets.shape[0]}")
    if per_sample_weights is not None and jnp.shape(per_sample_weights) != indices.shape:
        raise ValueError(f"per_sample_weights must match indices' shape {indices.shape}, got "
                         f"{jnp.shape(per_sample_weights)}")
    if jnp.dtype(output_dtype) not in (jnp.float32, jnp.float16, jnp.bfloat16):
        raise ValueError(f"output_dtype must be float32, float16 or bfloat16, got {jnp.dtype(output_dtype)}")
    if pooling == PoolingMode.NONE:
        dims = {table_dim(tables[t], precisions[t]) for t in feature_tables}
        if len(dims) > 1:
            raise ValueError(f"pooling NONE gives one row per id: every feature needs one dim, got {sorted(dims)}")
