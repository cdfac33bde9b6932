"""Row-wise quantized embedding rows: int8 and int4 codes with a per-row scale and bias.

The layout is FBGEMM's inference TBE (``IntNBitTableBatchedEmbeddingBagsCodegen``): each
row is ``uint8[4 + D * bits / 8]``, a float16 scale and a float16 bias first, then the
codes, two per byte for int4 (the even column in the low nibble)::

    row r:  [scale fp16 | bias fp16 | c0 c1 c2 ... ]        value[j] = scale * c[j] + bias

``bias`` is the row's minimum and ``scale = (max - min) / (2**bits - 1)``, both rounded to
float16 (the codes are computed with the rounded ones), so every value of the row comes
back within ``scale / 2`` of the float32 it was, plus float16's relative rounding of the
row's range (``quantization_error_bound``). A constant row has scale 0 and comes back
exactly. ``dequantize_rows`` is the reference of the quantized lookup's kernels
(``jaxrec.ops.quantized_lookup``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BITS = {"int8": 8, "int4": 4}
_SCALE_BIAS_BYTES = 4  # two float16


def row_bytes(dim: int, precision: str) -> int:
    """Bytes of one quantized row of ``dim`` columns (scale and bias included).

    The codes fill whole 32-bit words (4 int8 or 8 int4 columns), so that the lookup's
    CUDA kernel reads a row as words (csrc/common/quantized_lookup.h)."""
    bits = _bits(precision)
    if dim < 1 or dim * bits % 32:
        raise ValueError(f"{precision} rows pack {32 // bits} columns per 32-bit word: embedding_dim {dim} "
                         f"must be a positive multiple of {32 // bits}; keep this table in fp16 or fp32 "
                         f"(precisions={{table name: 'fp16'}})")
    return _SCALE_BIAS_BYTES + dim * bits // 8


def quantize_rows(weights, precision: str) -> np.ndarray:
    """``uint8[rows, row_bytes]`` of float ``weights [rows, dim]`` (module doc)."""
    bits = _bits(precision)
    w = np.asarray(weights, np.float32)
    if w.ndim != 2 or not np.isfinite(w).all():
        raise ValueError(f"weights must be a finite [rows, dim] array, got shape {w.shape}"
                         + ("" if np.isfinite(w).all() else " with NaN or Inf values"))
    row_bytes(w.shape[1], precision)  # checks the packing
    low, high = w.min(axis=1), w.max(axis=1)
    limit = float(np.finfo(np.float16).max)
    if np.abs(w).max(initial=0.0) > limit / 2:  # bias and scale are float16: they would overflow
        raise ValueError(f"weights reach {np.abs(w).max():g}; a row's float16 scale and bias hold "
                         f"values up to {limit / 2:g} in magnitude: keep such a table in fp32")
    bias = low.astype(np.float16)
    scale = ((high - bias.astype(np.float32)) / (2 ** bits - 1)).astype(np.float16)
    s32, b32 = scale.astype(np.float32)[:, None], bias.astype(np.float32)[:, None]
    codes = np.where(s32 > 0, np.rint((w - b32) / np.where(s32 > 0, s32, 1)), 0)
    codes = np.clip(codes, 0, 2 ** bits - 1).astype(np.uint8)
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    head = np.stack([scale, bias], axis=1).view(np.uint8).reshape(len(w), _SCALE_BIAS_BYTES)
    return np.concatenate([head, codes], axis=1)


def dequantize_rows(rows: jax.Array, precision: str) -> jax.Array:
    """float32 ``[..., dim]`` of quantized ``rows [..., row_bytes]`` (jnp, so that a lookup
    dequantizes only the rows it gathers)."""
    bits = _bits(precision)
    rows = jnp.asarray(rows, jnp.uint8)
    head = jax.lax.bitcast_convert_type(rows[..., :_SCALE_BIAS_BYTES].reshape(*rows.shape[:-1], 2, 2),
                                        jnp.float16).astype(jnp.float32)
    scale, bias = head[..., 0:1], head[..., 1:2]
    codes = rows[..., _SCALE_BIAS_BYTES:]
    if bits == 4:
        codes = jnp.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
    return codes.astype(jnp.float32) * scale + bias


def quantization_error_bound(weights, precision: str) -> np.ndarray:
    """Per row, the largest ``|dequantize(quantize(w)) - w|`` the layout allows: half a
    step, plus float16's rounding of the bias and of the step times the largest code."""
    bits = _bits(precision)
    w = np.asarray(weights, np.float32)
    low, high = w.min(axis=1), w.max(axis=1)
    step = (high - low) / (2 ** bits - 1)
    fp16 = 2.0 ** -11  # float16's unit roundoff
    return 0.5 * step * (1 + fp16) + fp16 * (np.abs(low) + (high - low)) + 1e-7 * np.abs(w).max(axis=1)


def _bits(precision: str) -> int:
    if precision not in BITS:
        raise ValueError(f"precision must be one of {tuple(BITS)}, got {precision!r}")
    return BITS[precision]
