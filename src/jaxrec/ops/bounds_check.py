"""``bounds_check_indices``: FBGEMM's check and correction of ids and offsets before a lookup.

Input is FBGEMM's TBE layout: ``offsets`` has ``T * B + 1`` entries, feature-major,
and ``indices`` has a static capacity ``N``; slots past the last offset are padding::

    #              b=0      b=1    <-- batch (B = 2)
    # feature 0    [3, 7]   []         rows_per_table = [10, 4]
    # feature 1    [2]      [9, 0]     (feature 1: id 9 is out of range)
    # indices = [3, 7, 2, 9, 0, <pad>, <pad>, <pad>]      (N = 8)
    # offsets = [0, 2, 2, 3, 5]                           (T * B + 1 = 5)

Modes (FBGEMM's ``BoundsCheckMode``, same values):

* ``FATAL``: raise an error that names the feature, its table, the bag and the bad
  offset or id: a ``JaxRuntimeError`` carrying that message, raised when the computation
  runs (under ``jit``, and also for an eager call, which JAX runs as a computation too).
* ``WARNING``: correct, and return in ``num_corrected`` how many bags and ids were
  corrected (FBGEMM's ``warning`` counter).
* ``IGNORE``: correct silently (``num_corrected`` is 0).
* ``NONE``: no check; the inputs come back unchanged.

Correction, as in FBGEMM: a bad id (negative or ``>= rows``) becomes row 0, and
every offset is clamped into ``[0, N]`` and made non-decreasing, so each bag stays
inside the indices. Closed form of FBGEMM's bag-by-bag loop:
``corrected[i] = max_{j <= i} clamp(offsets[j], 0, N)``. A bag counts as bad when
``!(0 <= start <= end <= N)`` for its corrected start (bag 0: its own start) and its
original end, which is what FBGEMM's loop sees.

Where jaxrec differs from FBGEMM, and why:

* FBGEMM requires ``offsets[-1] == len(indices)``; jaxrec's indices have a static
  capacity with padding after the last offset, so only ``offsets[-1] > N`` is bad.
* FBGEMM leaves the id ``-1`` alone (a pruned row of its inference TBE); jaxrec has no
  pruned rows, so ``-1`` is out of range like every other negative id.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec import _ffi, _step_guard

_TARGET = "jaxrec_bounds_check_indices"


class BoundsCheckMode(enum.IntEnum):
    """FBGEMM's bounds-check modes, with FBGEMM's values."""

    FATAL = 0
    WARNING = 1
    IGNORE = 2
    NONE = 3


class BoundsCheckResult(NamedTuple):
    indices: jax.Array
    """The ids, bad ones replaced by 0 (WARNING, IGNORE)."""
    offsets: jax.Array
    """The offsets, clamped and non-decreasing (WARNING, IGNORE)."""
    num_corrected: jax.Array
    """int32 scalar: bags plus ids corrected (WARNING only; 0 otherwise)."""


def bounds_check_indices(
    rows_per_table: Sequence[int] | jax.Array,
    indices: jax.Array,
    offsets: jax.Array,
    bounds_check_mode: BoundsCheckMode | int | str = BoundsCheckMode.WARNING,
    *,
    feature_names: Sequence[str] | None = None,
    table_names: Sequence[str] | None = None,
    backend: str = "auto",
) -> BoundsCheckResult:
    """Checks (and corrects) TBE ids and offsets in FBGEMM's layout; see the module doc.

    Args:
      rows_per_table: ``[T]`` row count of the table each feature looks up.
      indices: ``int32[N]`` or ``int64[N]`` ids; N is the static capacity.
      offsets: ``[T * B + 1]`` bag boundaries into ``indices`` (cast to its dtype).
      bounds_check_mode: a :class:`BoundsCheckMode`, its value or its name.
      feature_names: ``[T]`` names used in FATAL messages (default "feature t").
      table_names: ``[T]`` name of the table of each feature, for FATAL messages.
      backend: "auto", "kernel" or "reference" (see ``jaxrec._ffi.dispatch``).
    """
    mode = as_bounds_check_mode(bounds_check_mode)
    indices, offsets, rows = _validate(rows_per_table, indices, offsets)
    if mode == BoundsCheckMode.NONE:
        return BoundsCheckResult(indices, offsets, jnp.zeros((), jnp.int32))
    labels = tuple(feature_labels(rows.shape[0], feature_names, table_names))
    if mode == BoundsCheckMode.FATAL and _step_guard.active() is not None:
        # Inside a train step an error must not be raised while the step runs (its donated
        # buffers would be lost): correct as WARNING does, report, and let the step skip its
        # update and raise afterwards (jaxrec._step_guard).
        report = _fatal_report(rows, indices, offsets)
        _step_guard.report_fatal(report, _FatalMessage(labels, _batch_size(rows, offsets),
                                                       indices.shape[0]))
        indices, offsets, _ = _bounds_check(rows, indices, offsets, mode=BoundsCheckMode.IGNORE,
                                            labels=labels, backend=backend)
        return BoundsCheckResult(indices, offsets, jnp.zeros((), jnp.int32))
    result = BoundsCheckResult(*_bounds_check(rows, indices, offsets, mode=mode, labels=labels,
                                              backend=backend))
    if mode == BoundsCheckMode.WARNING:
        _step_guard.report_corrected(result.num_corrected)
    return result


def bounds_check_kernel(rows, indices, offsets, mode: BoundsCheckMode, labels: tuple[str, ...]):
    """The check by the handler of the platform being compiled for: ``(indices, offsets,
    num_corrected)``. For a kernel that takes checked input (the CPU lookup)."""
    return _bounds_check(rows, indices, offsets, mode=mode, labels=labels, backend="kernel")


def clip_rows(rows_per_table, dtype) -> np.ndarray:
    """Row counts as ids of ``dtype`` can name them: an id can never reach a larger count."""
    return np.minimum(np.asarray(rows_per_table, np.int64), np.iinfo(dtype).max)


# jit caches the lowering per static configuration, so eager calls do not retrace.
@functools.partial(jax.jit, static_argnames=("mode", "labels", "backend"))
def _bounds_check(rows, indices, offsets, *, mode, labels, backend):
    def kernel(rows, indices, offsets):
        call = jax.ffi.ffi_call(
            _TARGET,
            (jax.ShapeDtypeStruct(indices.shape, indices.dtype),
             jax.ShapeDtypeStruct(offsets.shape, offsets.dtype),
             jax.ShapeDtypeStruct((4,), jnp.int32)),
            input_output_aliases={1: 0},
            vmap_method="sequential",
            has_side_effect=mode == BoundsCheckMode.FATAL,
        )
        new_indices, new_offsets, report = call(rows, indices, offsets, mode=np.int32(mode),
                                                labels="\n".join(labels))
        return new_indices, new_offsets, report[0]

    def reference(rows, indices, offsets):
        return bounds_check_indices_reference(rows, indices, offsets, mode, labels)

    return _ffi.dispatch(kernel, reference, rows, indices, offsets, backend=backend)


def bounds_check_indices_reference(rows, indices, offsets, mode: BoundsCheckMode,
                                   labels: Sequence[str]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pure-jnp bounds check: the test oracle and the fallback where no handler is built."""
    found = _find_bad(rows, indices, offsets, mode)
    if mode == BoundsCheckMode.FATAL:
        # Raised when the computation runs (a JaxRuntimeError carrying this message).
        _step_guard.report_fatal(_report(indices, offsets, found),
                                 _FatalMessage(tuple(labels), _batch_size(rows, offsets),
                                               indices.shape[0]))
        return indices, offsets, jnp.zeros((), jnp.int32)
    count = jnp.sum(found.bad_bag, dtype=jnp.int32) + jnp.sum(found.bad_id, dtype=jnp.int32)
    num_corrected = count if mode == BoundsCheckMode.WARNING else jnp.zeros((), jnp.int32)
    return jnp.where(found.bad_id, 0, indices).astype(indices.dtype), found.corrected, num_corrected


class _Found(NamedTuple):
    corrected: jax.Array  # the corrected offsets
    bad_bag: jax.Array    # [T * B] bool
    bad_id: jax.Array     # [N] bool
    safe_bag: jax.Array   # [N] each position's bag, clipped
    num_rows: jax.Array   # [N] rows of each position's table


def _find_bad(rows, indices, offsets, mode: BoundsCheckMode) -> _Found:
    """The bad bags and ids, as FBGEMM's loop sees them (FATAL: by the given offsets,
    the others: by the corrected ones)."""
    n = indices.shape[0]
    num_bags = offsets.shape[0] - 1
    corrected = jax.lax.cummax(jnp.clip(offsets, 0, n))
    start = jnp.concatenate([offsets[:1], corrected[1:-1]])
    end = offsets[1:]
    bad_bag = (start < 0) | (start > end) | (end > n)

    used = offsets if mode == BoundsCheckMode.FATAL else corrected
    position = jnp.arange(n, dtype=indices.dtype)
    bag = jnp.searchsorted(used, position, side="right").astype(indices.dtype) - 1
    in_bag = (bag >= 0) & (bag < num_bags)
    safe_bag = jnp.clip(bag, 0, max(num_bags - 1, 0))
    batch_size = _batch_size(rows, offsets)
    num_rows = rows[safe_bag // batch_size] if num_bags else jnp.zeros_like(indices)
    bad_id = in_bag & ((indices < 0) | (indices >= num_rows))
    return _Found(corrected, bad_bag, bad_id, safe_bag, num_rows)


def _report(indices, offsets, found: _Found) -> jax.Array:
    """FATAL's report, one vector of the ids' dtype: ``[any bad, any bad bag, bag, start,
    end, any bad id, position, id, id's bag, rows]`` (``_FatalMessage`` reads it)."""
    n, num_bags = indices.shape[0], offsets.shape[0] - 1
    first_bag = jnp.argmax(found.bad_bag) if num_bags else 0
    first_id = jnp.argmax(found.bad_id) if n else 0
    pick = (lambda x: x[first_id]) if n else (lambda x: 0)
    any_bag, any_id = jnp.any(found.bad_bag), jnp.any(found.bad_id)
    parts = (any_bag | any_id, any_bag, first_bag, offsets[first_bag], offsets[first_bag + 1],
             any_id, first_id, pick(indices), pick(found.safe_bag), pick(found.num_rows))
    return jnp.stack([jnp.asarray(x).astype(indices.dtype) for x in parts])


@jax.jit
def _fatal_report(rows, indices, offsets) -> jax.Array:
    """FATAL's report without raising (a train step raises it after the step)."""
    return _report(indices, offsets, _find_bad(rows, indices, offsets, BoundsCheckMode.FATAL))


def _batch_size(rows, offsets) -> int:
    return (offsets.shape[0] - 1) // rows.shape[0] if rows.shape[0] else 1


@dataclasses.dataclass(frozen=True)
class _FatalMessage:
    """FATAL's error text from a ``_report`` vector (after its leading "any bad")."""

    labels: tuple
    batch_size: int
    num_indices: int

    def __call__(self, any_bad, any_bad_bag, bag, start, end, any_bad_id, position, index,
                 id_bag, num_rows) -> str:
        if any_bad_bag:
            return bad_offsets_message(self.labels, self.batch_size, bag, start, end,
                                       self.num_indices)
        return bad_index_message(self.labels, self.batch_size, id_bag, position, index, num_rows)



def _where(labels: Sequence[str], batch_size: int, bag: int) -> str:
    feature, sample = divmod(bag, batch_size) if batch_size else (0, 0)
    label = labels[feature] if feature < len(labels) else f"feature {feature}"
    return f"bounds_check_indices (FATAL): {label}, bag {sample}: "


def bad_offsets_message(labels, batch_size, bag, start, end, num_indices) -> str:
    """The FATAL message for a bad bag; the C++ handlers write the same text."""
    return (f"{_where(labels, batch_size, bag)}offsets[{bag}]={start}, offsets[{bag + 1}]={end} "
            f"is not a range inside indices of size {num_indices}. Fix the offsets, or pass "
            "bounds_check_mode=WARNING or IGNORE to clamp them.")


def bad_index_message(labels, batch_size, bag, position, index, num_rows) -> str:
    """The FATAL message for a bad id; the C++ handlers write the same text."""
    return (f"{_where(labels, batch_size, bag)}indices[{position}]={index} is out of range for a "
            f"table of {num_rows} rows. Fix the ids, or pass bounds_check_mode=WARNING or IGNORE "
            "to map bad ids to row 0.")


def as_bounds_check_mode(mode) -> BoundsCheckMode:
    """A BoundsCheckMode from itself, its value or its name (any case)."""
    if isinstance(mode, str) and mode.upper() in BoundsCheckMode.__members__:
        return BoundsCheckMode[mode.upper()]
    try:
        return BoundsCheckMode(mode)
    except ValueError:
        legal = ", ".join(f"{m.name} ({m.value})" for m in BoundsCheckMode)
        raise ValueError(f"bounds_check_mode must be one of {legal}; got {mode!r}") from None


def feature_labels(num_features: int, feature_names, table_names) -> list[str]:
    """The FATAL messages' name of each feature: "feature 'f' of table 't'"."""
    for name, value in (("feature_names", feature_names), ("table_names", table_names)):
        if value is not None and len(value) != num_features:
            raise ValueError(f"{name} has {len(value)} entries but rows_per_table has "
                             f"{num_features}; pass one name per feature")
    labels = []
    for t in range(num_features):
        label = f"feature '{feature_names[t]}'" if feature_names is not None else f"feature {t}"
        if table_names is not None:
            label += f" of table '{table_names[t]}'"
        labels.append(label)
    return labels


def _validate(rows_per_table, indices, offsets):
    indices = jnp.asarray(indices)
    offsets = jnp.asarray(offsets)
    if indices.ndim != 1 or indices.dtype not in (jnp.int32, jnp.int64):
        raise TypeError(f"indices must be a 1-D int32 or int64 array, got {indices.dtype}"
                        f"{list(indices.shape)}")
    if offsets.ndim != 1 or not jnp.issubdtype(offsets.dtype, jnp.integer) or offsets.shape[0] < 1:
        raise TypeError(f"offsets must be a 1-D integer array of T * B + 1 entries, got "
                        f"{offsets.dtype}{list(offsets.shape)}")
    if indices.shape[0] >= 2**31:
        raise ValueError(f"indices has {indices.shape[0]} entries; jaxrec supports < 2**31 per call")
    if not isinstance(rows_per_table, jax.Array):
        rows_per_table = np.asarray(rows_per_table, dtype=np.int64)
        if rows_per_table.ndim != 1 or (rows_per_table < 0).any():
            raise ValueError(f"rows_per_table must be a 1-D list of row counts >= 0, got "
                             f"{rows_per_table.tolist()}")
        rows_per_table = clip_rows(rows_per_table, indices.dtype)
    rows = jnp.asarray(rows_per_table, dtype=indices.dtype)
    num_features, num_bags = rows.shape[0], offsets.shape[0] - 1
    if (num_features == 0 and num_bags) or (num_features and num_bags % num_features):
        raise ValueError(f"offsets has {offsets.shape[0]} entries, which is not T * B + 1 for "
                         f"T = len(rows_per_table) = {num_features}; pass one row count per "
                         "feature and B + 1 offsets per feature (the last one shared)")
    return indices, offsets.astype(indices.dtype), rows
