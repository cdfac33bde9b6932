"""A batch's positions sorted by the table row each reads: what the sorted backward walks,
one run of equal keys per table row (the fused update's handlers sort the same way
inside themselves, csrc/cpu/row_sort.h and csrc/cuda/row_sort.cuh).

:func:`sort_by_row` returns ``(sorted_keys, sorted_positions, sorted_bags)``:

* the key of position ``p`` is the first row of its feature's table among all tables'
  rows (tables in the layout's order) plus its id; a position outside every bag, or
  whose id is not a row of its table, has the dtype's max, and sorts last;
* the sort is stable: within a run the positions ascend (the kernels sum a row's
  gradient in that fixed order, so results are the same run to run);
* ``sorted_bags`` holds each sorted position's bag (``bag_of_position``: -1 before the
  first bag, ``T * B`` after the last).

Offsets must already be corrected (non-decreasing, inside ``[0, N]``). On the CPU a
handler sorts with a parallel radix sort over just the bits of the row count (XLA's CPU
sort is a comparison sort on one thread: it took 40-70% of the fused update); elsewhere
XLA sorts (a CUB radix sort on the GPU) and :func:`sort_by_row_reference` is the oracle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec import _ffi
from jaxrec.ops.tbe_layout import TableLayout
from jaxrec.ops.tbe_reference import bag_of_position, row_keys


def sort_by_row_reference(layout: TableLayout, indices: jax.Array, offsets: jax.Array):
    n = indices.shape[0]
    bag = bag_of_position(offsets, n)
    key = row_keys(layout, indices, bag, offsets.shape[0] - 1)
    sorted_key, sorted_position = jax.lax.sort_key_val(key, jnp.arange(n, dtype=indices.dtype))
    return sorted_key, sorted_position, bag[sorted_position]


def _sort_by_row_cpu(layout: TableLayout, indices: jax.Array, offsets: jax.Array):
    result = jax.ShapeDtypeStruct(indices.shape, indices.dtype)
    call = jax.ffi.ffi_call("jaxrec_sort_by_row", (result, result, result), vmap_method="sequential")
    return call(indices, offsets, jnp.asarray(layout.feature_rows, indices.dtype),
                jnp.asarray(layout.feature_first_rows, indices.dtype))


def check_row_keys_fit(layout: TableLayout, dtype) -> int:
    """The layout's row count (its tables' rows in all), after checking that every row key
    fits ``dtype`` below its max (the sentinel)."""
    total_rows = sum(layout.rows)
    if total_rows > np.iinfo(dtype).max:
        raise ValueError(f"the layout's tables hold {total_rows} rows in all, more than {np.dtype(dtype)} row "
                         "keys can number: pass int64 indices (with jax_enable_x64)")
    return total_rows


def sort_by_row(layout: TableLayout, indices: jax.Array, offsets: jax.Array, *, backend: str = "auto"):
    """``(sorted_keys, sorted_positions, sorted_bags)`` of the batch; see the module doc.

    ``indices`` and ``offsets`` share one dtype (int32 or int64), which the results take;
    every row key must fit it below its max.
    """
    check_row_keys_fit(layout, indices.dtype)
    return _ffi.dispatch({"cpu": lambda i, o: _sort_by_row_cpu(layout, i, o)},
                         lambda i, o: sort_by_row_reference(layout, i, o), indices, offsets, backend=backend)
