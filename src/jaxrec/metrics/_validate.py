"""Input checks shared by every metric: one float64 value per example, rows of weight 0 dropped.

Weights are per-example (a batch's padding mask, or importance weights). A row of weight 0
does not count at all: its label and score are not even checked, since padding rows may
hold anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

# What an input may hold (besides NaN, never allowed among the rows that count).
REAL = "real"
BINARY = "binary"  # 0 or 1
UNIT = "unit"  # in [0, 1]


def _as_float64(name: str, x: ArrayLike) -> np.ndarray:
    a = np.asarray(x)
    # "V": ml_dtypes' bfloat16 and float8 types, which numpy converts like any float.
    if a.dtype.kind in "biufV" and a.dtype.names is None:
        try:
            return a.astype(np.float64).reshape(-1)
        except (TypeError, ValueError):
            pass
    raise TypeError(
        f"{name} must be an array of real numbers, got dtype {a.dtype}; pass a numeric array "
        "(e.g. np.asarray(jax.device_get(x)))."
    )


def _index(flat: int, shape: tuple[int, ...]) -> str:
    """``flat`` as an index into an array of ``shape`` (a tuple unless the array is 1-D)."""
    if len(shape) == 1:
        return str(flat)
    return str(tuple(int(i) for i in np.unravel_index(flat, shape)))


def weighted_rows(
    arrays: Sequence[tuple[str, ArrayLike, str]], weights: ArrayLike | None
) -> tuple[list[np.ndarray], np.ndarray]:
    """``arrays`` (``(name, value, kind)``, all of one shape) and ``weights`` as flat float64
    arrays holding only the rows with weight > 0. Raises ``ValueError`` naming the argument."""
    names = [name for name, _, _ in arrays]
    shape = np.shape(arrays[0][1])
    values = []
    for name, x, _ in arrays:
        if np.shape(x) != shape:
            raise ValueError(
                f"{name} has shape {np.shape(x)} but {names[0]} has shape {shape}; pass one "
                f"value per example in each (e.g. reshape both to (-1,))."
            )
        values.append(_as_float64(name, x))
    if weights is None:
        w = np.ones(values[0].size)
    else:
        if np.shape(weights) != shape:
            raise ValueError(
                f"weights has shape {np.shape(weights)} but {names[0]} has shape {shape}; "
                "pass one weight per example (e.g. the batch's mask)."
            )
        w = _as_float64("weights", weights)
        bad = ~(np.isfinite(w) & (w >= 0))  # NaN fails both
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"weights must be finite and >= 0, got {w[i]} at index {_index(i, shape)}; "
                "use 0 to drop an example (e.g. a padding row) and 1 to count it once."
            )
    keep = w > 0
    out = []
    for (name, _, kind), v in zip(arrays, values):
        nan = np.isnan(v) & keep
        if nan.any():
            raise ValueError(
                f"{name} has {int(nan.sum())} NaN value(s) among the examples with weight > 0 "
                f"(first at index {_index(int(np.argmax(nan)), shape)}); check the model for "
                "divergence, or give those rows weight 0."
            )
        if kind == BINARY:
            bad = ((v != 0) & (v != 1)) & keep
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(
                    f"{name} must be 0 or 1, got {v[i]} at index {_index(i, shape)}; "
                    f"binarize them first (e.g. {name} > 0.5)."
                )
        elif kind == UNIT:
            bad = ((v < 0) | (v > 1)) & keep
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(
                    f"{name} must lie in [0, 1], got {v[i]} at index {_index(i, shape)}; "
                    "pass probabilities (sigmoid(logits)), not logits."
                )
        out.append(v[keep])
    return out, w[keep]


def require_examples(weights: np.ndarray) -> None:
    """Raises unless at least one example counts (``weights`` as :func:`weighted_rows` returns)."""
    if weights.size == 0:
        raise ValueError(
            "no example has weight > 0 (the inputs are empty, or every weight is 0, e.g. an "
            "all-padding batch); pass at least one example with weight > 0."
        )
