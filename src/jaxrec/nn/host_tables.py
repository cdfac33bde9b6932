"""Fused tables held in host memory, and host-placed tables in a collection
(``EmbeddingBagConfig(placement="host")``, docs/host_memory.md).

``new_host_tables`` builds a group's fused tables with the weights and every optimizer-state
buffer in host memory (JAX's ``"pinned_host"``); host-cached groups (nn/host_cache.py) keep
their full tables so, and host-placed groups are such tables, held by their ``FusedTables``
variable like any other group's.

A host-placed group has no cache: each lookup reads the batch's rows over PCIe (FBGEMM's
``MANAGED`` placement, with the rows read once per batch instead of once per id)::

    distinct = the batch's distinct rows of the group, sorted (jnp.unique)
    scratch  = those rows and their optimizer state, gathered into device memory
               (the row-copy handler, in host-address order: at the PCIe copy rate)
    the lookup and the fused update run on the scratch, a table of one row per id
    the backward of the gather writes the updated rows back to their host rows

The written-back host tables are the "gradient" that the fused train step hands back as
the new tables (jaxrec/fused/_tables.py). A forward pass outside a step only reads. The
scratch has a row for every id of the batch, so no batch is too large for it, and it
lives only inside the step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec._mesh import default_device
from jaxrec.fused import FusedEmbeddingTables
from jaxrec.ops.host_cache import HOST_MEMORY, copy_rows
from jaxrec.ops.tbe_layout import TableLayout


def buffers(tables: FusedEmbeddingTables) -> list:
    """The weights and each optimizer-state buffer (the step counter is not one)."""
    return [tables.weights, *(getattr(tables.state, n) for n in tables.config.state_names)]


def with_buffers(tables: FusedEmbeddingTables, new) -> FusedEmbeddingTables:
    """``tables`` holding ``new`` (in ``buffers``' order)."""
    names = tables.config.state_names
    return dataclasses.replace(tables, weights=new[0], state=tables.state._replace(**dict(zip(names, new[1:]))))


def new_host_tables(like: FusedEmbeddingTables, layout: TableLayout, draw, name: str) -> FusedEmbeddingTables:
    """Fused tables of ``layout`` with ``like``'s optimizer and dtypes, every buffer in host
    memory: table ``t``'s weights are ``draw(t)`` (float32 ``[rows, dim]``), the optimizer
    state zero, the step ``like``'s (copied: no array is shared with ``like``). The device
    holds one drawn table at a time."""
    total = sum(layout.rows)
    per_row = [b.size // sum(like.layout.rows) for b in buffers(like)]
    weights = place_in_host_memory(np.zeros((total * per_row[0],), like.weights.dtype))
    for t, (first, rows) in enumerate(zip(layout.row_offsets, layout.rows)):
        weights = _copy_table(weights, draw(t).astype(weights.dtype).reshape(-1), first, rows, total)
    state = [place_in_host_memory(np.zeros((total * w,), b.dtype)) for w, b in zip(per_row[1:], buffers(like)[1:])]
    fresh = dataclasses.replace(like, hparams=like.config.hyperparams(), layout=layout, name=name,
                                state=like.state._replace(step=jnp.array(like.state.step)))  # arrays of its own
    return with_buffers(fresh, [weights, *state])


def place_in_host_memory(x: np.ndarray) -> jax.Array:
    """A NumPy array placed in the default device's host memory, never on the device (NumPy's
    zeros are pages not yet touched)."""
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(default_device(), memory_kind=HOST_MEMORY))


@functools.partial(jax.jit, static_argnums=(2, 3, 4), donate_argnums=0)
def _copy_table(flat: jax.Array, table: jax.Array, first: int, rows: int, total: int) -> jax.Array:
    """``flat`` (``total`` rows in host memory) with rows ``[first, first + rows)`` set to
    ``table``, by the row-copy handler (host memory takes no jnp update)."""
    at = jnp.arange(rows, dtype=jnp.int32)
    return copy_rows(flat, first + at, table, at, dst_num_rows=total, src_num_rows=rows)


def batch_rows(tables: FusedEmbeddingTables, rows: jax.Array, valid: jax.Array):
    """``(ids, scratch)`` of a host-placed group (module doc): ``rows``, each entry's row of
    the group's tables (``int32[N]``, used where ``valid``), as rows of ``scratch`` (-1
    where not valid), the fused tables of the batch's distinct rows in device memory, one
    table of ``N`` rows that every feature looks up."""
    total = sum(tables.layout.rows)
    key = jnp.where(valid, rows, total)
    distinct, inverse = jnp.unique(key, size=key.shape[0], fill_value=total, return_inverse=True)
    ids = jnp.where(valid, inverse.reshape(-1).astype(jnp.int32), -1)
    return ids, _gathered(tables, distinct.astype(jnp.int32))


def _scratch_layout(layout: TableLayout, n: int) -> TableLayout:
    return TableLayout(rows=(n,), dims=(layout.dims[0],), feature_table_map=(0,) * layout.num_features)


@jax.custom_vjp
def _gathered(tables: FusedEmbeddingTables, distinct: jax.Array) -> FusedEmbeddingTables:
    """The scratch tables of rows ``distinct`` of ``tables`` (past the last row: zeros);
    the backward writes the scratch's cotangent (its updated rows) back to them."""
    n, total = distinct.shape[0], sum(tables.layout.rows)
    at = jnp.arange(n, dtype=jnp.int32)
    scratch = [copy_rows(jnp.zeros((b.size // total * n,), b.dtype), at, b, distinct, dst_num_rows=n,
                         src_num_rows=total) for b in buffers(tables)]
    return with_buffers(dataclasses.replace(tables, layout=_scratch_layout(tables.layout, n)), scratch)


def _gathered_forward(tables, distinct):
    return _gathered(tables, distinct), (tables, distinct)


def _gathered_backward(residuals, cotangent):
    tables, distinct = residuals
    n, total = distinct.shape[0], sum(tables.layout.rows)
    at = jnp.arange(n, dtype=jnp.int32)
    written = [copy_rows(b, distinct, c, at, dst_num_rows=total, src_num_rows=n)
               for b, c in zip(buffers(tables), buffers(cotangent))]
    back = dataclasses.replace(cotangent, layout=tables.layout)
    return with_buffers(back, written), np.zeros(distinct.shape, jax.dtypes.float0)


_gathered.defvjp(_gathered_forward, _gathered_backward)
