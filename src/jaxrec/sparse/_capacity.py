"""Capacity buckets and host-side conversion/validation for the jagged types.

A jagged container has a *static* capacity: the size of its ``values`` array. Host data
(Python lists, NumPy arrays) is padded up to a capacity bucket so that batches of slightly
different sizes share one compiled program::

    ids in the batch   1..8   9..16   17..32   33..64   ...
    capacity              8      16       32       64   ...   (next power of two, minimum 8)

Arrays that are already ``jax.Array`` s (possibly traced) keep their size as the capacity.
Checks that need values (negative lengths, ``sum(lengths) > capacity``) run only when the
arrays are concrete; under ``jit`` they are the caller's contract.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MIN_CAPACITY = 8
"""The smallest capacity bucket that host-side constructors pick."""

_INT32_MAX = np.iinfo(np.int32).max
_INT32_MIN = np.iinfo(np.int32).min


def capacity_bucket(n: int, minimum: int = MIN_CAPACITY) -> int:
    """The capacity that host-side constructors pick for ``n`` values.

    The next power of two that is ``>= max(n, minimum)``: 0..8 -> 8, 9 -> 16, 1000 -> 1024.
    """
    if n < 0:
        raise ValueError(f"capacity_bucket needs n >= 0, got n={n}.")
    if minimum < 1:
        raise ValueError(f"capacity_bucket needs minimum >= 1, got minimum={minimum}.")
    n = max(int(n), int(minimum))
    return 1 << (n - 1).bit_length()


def is_traced(x: Any) -> bool:
    """True when ``x`` is a tracer (its values are unknown at trace time)."""
    return isinstance(x, jax.core.Tracer)


def is_host(x: Any) -> bool:
    """True for host data (lists, tuples, NumPy arrays, scalars): not a ``jax.Array``."""
    return not isinstance(x, jax.Array)


def concrete_or_none(x: Any) -> np.ndarray | None:
    """``x`` as a NumPy array if its values are known now, else ``None``."""
    if x is None or is_traced(x):
        return None
    return np.asarray(x)


def host_int_array(name: str, x: Any) -> np.ndarray:
    """Host integer data as int32 (int64 when it needs it and ``jax_enable_x64`` is on)."""
    arr = np.asarray(x)
    if arr.size == 0 and arr.dtype.kind == "f":  # [] parses as float64
        arr = arr.astype(np.int32)
    if arr.dtype.kind not in "iu":
        raise TypeError(
            f"{name} must hold integers, got dtype {arr.dtype}; pass e.g. "
            f"np.asarray({name}, np.int32)."
        )
    x64 = jax.config.jax_enable_x64
    if arr.dtype == np.int64 and x64 and isinstance(x, np.ndarray):
        return arr  # the user asked for int64 explicitly
    if arr.size and (arr.max() > _INT32_MAX or arr.min() < _INT32_MIN):
        if x64:
            return arr.astype(np.int64)
        raise ValueError(
            f"{name} holds values outside int32 (min {arr.min()}, max {arr.max()}); enable "
            "64-bit ids with jax.config.update('jax_enable_x64', True) or remap the ids."
        )
    return arr.astype(np.int32)


def host_float_array(name: str, x: Any) -> np.ndarray:
    """Host floating-point data as float32 (or its own float dtype if it has one)."""
    arr = np.asarray(x)
    if arr.dtype.kind in "iub" or (arr.size == 0 and arr.dtype == np.float64):
        return arr.astype(np.float32)
    if not jnp.issubdtype(arr.dtype, jnp.floating):  # bfloat16's numpy kind is "V"
        raise TypeError(f"{name} must hold floats, got dtype {arr.dtype}.")
    if arr.dtype == np.float64 and not (jax.config.jax_enable_x64 and isinstance(x, np.ndarray)):
        return arr.astype(np.float32)
    return arr


def check_lengths(name: str, lengths: Any, num_values: int) -> None:
    """Checks concrete lengths: non-negative and summing to at most ``num_values``."""
    host = concrete_or_none(lengths)
    if host is None:
        return
    if host.size and host.min() < 0:
        bad = int(np.flatnonzero(host < 0)[0])
        raise ValueError(
            f"{name} must be >= 0, got {name}[{bad}]={int(host[bad])}; a bag with no ids has "
            "length 0."
        )
    total = int(host.sum(dtype=np.int64))
    if total > num_values:
        raise ValueError(
            f"{name} sum to {total} but values has only {num_values} entries; pass one value "
            "per id (len(values) >= sum(lengths))."
        )


def check_capacity_arg(capacity: Any) -> int | None:
    if capacity is None:
        return None
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 0:
        raise ValueError(
            f"capacity must be a non-negative Python int (static), got capacity={capacity!r}."
        )
    return int(capacity)


def _fit(name: str, x: Any, capacity: int) -> Any:
    """Pads ``x`` (host or jax) along axis 0 to ``capacity``; errors if it is longer."""
    n = x.shape[0]
    if capacity < n:
        raise ValueError(
            f"{name} has {n} ids but capacity={capacity}; pass capacity>={n} or split the batch."
        )
    if capacity == n:
        return x
    pad = [(0, capacity - n)] + [(0, 0)] * (x.ndim - 1)
    return np.pad(x, pad) if is_host(x) else jax.numpy.pad(x, pad)


def _as_lengths(name: str, x: Any) -> Any:
    if is_host(x):
        return host_int_array(name, x)
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(
            f"{name} must hold integers, got dtype {x.dtype}; cast with .astype(int32)."
        )
    return x


def prepare_jagged(
    values: Any,
    weights: Any,
    lengths: Any,
    offsets: Any,
    capacity: Any,
    *,
    integer_values: bool,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """Validates and converts constructor arguments to ``(values, weights, lengths)``.

    Host ``values`` are padded to ``capacity`` or, if it is None, to ``capacity_bucket``;
    jax ``values`` keep their size unless ``capacity`` is larger. Lengths become int32.
    """
    jnp = jax.numpy
    capacity = check_capacity_arg(capacity)
    if lengths is None and offsets is None:
        raise ValueError("pass lengths=... or offsets=... to describe the bags of values.")

    # lengths (from offsets if needed)
    if lengths is None:
        offsets = _as_lengths("offsets", offsets)
        if offsets.ndim != 1 or offsets.shape[0] < 1:
            raise ValueError(
                f"offsets must be 1-D with N+1 >= 1 entries (starting at 0), got shape {offsets.shape}."
            )
        host_off = concrete_or_none(offsets)
        if host_off is not None and host_off[0] != 0:
            raise ValueError(f"offsets must start at 0, got offsets[0]={int(host_off[0])}.")
        lengths = offsets[1:] - offsets[:-1]
        name = "offsets differences (lengths)"
    else:
        lengths = _as_lengths("lengths", lengths)
        name = "lengths"
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {lengths.shape}; flatten it first.")

    # values
    if is_host(values):
        arr = np.asarray(values)
        if arr.ndim == 0:
            raise ValueError(f"values must be at least 1-D, got the scalar {values!r}.")
        if integer_values or arr.dtype.kind in "iu" or (arr.size == 0 and arr.ndim == 1):
            values = host_int_array("values", values)
        else:
            values = host_float_array("values", values)
    else:
        if values.ndim == 0:
            raise ValueError("values must be at least 1-D, got a scalar array.")
        if integer_values and not np.issubdtype(values.dtype, np.integer):
            raise TypeError(
                f"KeyedJaggedTensor values must be integer ids, got dtype {values.dtype}; cast "
                "with .astype(jnp.int32), or use JaggedTensor for float values."
            )
    if integer_values and values.ndim != 1:
        raise ValueError(f"KeyedJaggedTensor values must be 1-D ids, got shape {values.shape}.")
    n = values.shape[0]

    # weights
    if weights is not None:
        if is_host(weights):
            weights = host_float_array("weights", weights)
        elif not jnp.issubdtype(weights.dtype, jnp.floating):  # bfloat16 and float16 too
            raise TypeError(
                f"weights must be floating point, got dtype {weights.dtype}; cast with "
                ".astype(jnp.float32)."
            )
        if weights.shape != (n,):
            raise ValueError(
                f"weights must have shape ({n},), one weight per entry of values, got shape "
                f"{weights.shape}."
            )

    if capacity is None:
        capacity = capacity_bucket(n) if is_host(values) else n
    values = _fit("values", values, capacity)
    if weights is not None:
        weights = _fit("weights", weights, capacity)
    check_lengths(name, lengths, n)

    lengths = jnp.asarray(lengths).astype(jnp.int32)
    values = jnp.asarray(values)
    weights = None if weights is None else jnp.asarray(weights)
    return values, weights, lengths
