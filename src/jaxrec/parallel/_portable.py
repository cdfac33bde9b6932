"""Tables in their portable form <-> the per-device group buffers of a sharded collection.

The *portable* form of a table is what the unsharded module holds: the whole
``[rows, dim]`` table (and each optimizer state buffer as ``[rows, dim]`` or ``[rows]``).
It does not depend on the plan or on the number of devices, so checkpoints save it and
any plan on any mesh can load it::

    portable  t0 [800, 64], t1 [500, 64], t2 [300, 64]
      | pack
    group buffer, global [N * R * D], sharded over the axis: device d's block is its
    virtual table [R, D] (see _layout.py), zeros past its last shard
      | unpack
    portable again (bit for bit)

Both run on the host in NumPy: the arrays pass through host memory once (no compile, no
device holds more than its own blocks), so the host needs room for the largest group.
Portable arrays are placed row-sharded over the mesh when their row count is a multiple
of the device count, else replicated (NamedSharding needs even blocks). With several
processes (docs/multiprocess.md) every process gathers the whole buffers to its host
(``to_host``, an all-gather) and places its own blocks: each host needs room for the
largest group, as in one process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrec._mesh import to_host
from jaxrec.parallel._layout import DP, Group, ShardedLayout
from jaxrec.parallel._types import ShardingType


def portable_sharding(mesh, axis: str, shape: tuple[int, ...]) -> NamedSharding:
    """Rows split over ``axis`` when they divide evenly, else replicated."""
    n = mesh.shape[axis]
    if len(shape) >= 1 and shape[0] % n == 0:
        return NamedSharding(mesh, P(axis))
    return NamedSharding(mesh, P())


def pack_group(group: Group, num_devices: int, arrays: Mapping[int, np.ndarray], per_row: bool,
               dtype) -> np.ndarray:
    """The global buffer of ``group`` from portable ``arrays`` (``{table index: array}``)."""
    dtype = jnp.dtype(dtype)
    if group.kind == DP:
        pieces = sorted(group.pieces, key=lambda p: p.offset)
        return np.concatenate([to_host(arrays[p.table]).astype(dtype).ravel() for p in pieces])
    rows, dim = group.layout.rows[0], group.layout.dims[0]
    out = np.zeros((num_devices, rows) + (() if per_row else (dim,)), dtype)
    hosts = {t: to_host(x) for t, x in arrays.items()}
    for p in group.pieces:
        block = hosts[p.table][p.row_lo:p.row_hi]
        out[p.device, p.offset:p.offset + p.row_hi - p.row_lo] = (
            block if per_row else block[:, p.col_lo:p.col_hi])
    return out.reshape(-1)


def unpack(layout: ShardedLayout, buffers: Sequence[np.ndarray], per_row: bool
           ) -> list[np.ndarray]:
    """Each table's portable array from the group ``buffers`` (one per group, in order)."""
    found: dict[int, list] = {t: [] for t in range(len(layout.tables))}
    n = layout.world_size
    for group, buf in zip(layout.groups, buffers):
        buf = to_host(buf)
        if group.kind == DP:
            gl = group.layout
            starts = gl.row_offsets if per_row else gl.table_offsets
            for p in group.pieces:
                rows, dim = gl.rows[p.offset], gl.dims[p.offset]
                size = rows if per_row else rows * dim
                block = buf[starts[p.offset]:starts[p.offset] + size]
                found[p.table].append((p, block if per_row else block.reshape(rows, dim)))
            continue
        rows, dim = group.layout.rows[0], group.layout.dims[0]
        x = buf.reshape((n, rows) if per_row else (n, rows, dim))
        for p in group.pieces:
            found[p.table].append((p, x[p.device, p.offset:p.offset + p.row_hi - p.row_lo]))
    out = []
    for t, pieces in found.items():
        if layout.kinds[t] == ShardingType.COLUMN_WISE:
            pieces.sort(key=lambda pb: pb[0].col_lo)
            out.append(np.concatenate([b for _, b in pieces], axis=1))
        else:
            pieces.sort(key=lambda pb: pb[0].row_lo)
            out.append(np.concatenate([b for _, b in pieces], axis=0))
    return out
