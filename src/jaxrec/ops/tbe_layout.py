"""Where each table lives in the flat weight buffer of a table-batched embedding (TBE).

As in FBGEMM, all tables of a lookup share one flat buffer, so one kernel launch
serves every table and feature::

    # tables:  t0 (rows=4, dim=2)   t1 (rows=3, dim=3)
    # flat:    [t0 r0 | t0 r1 | t0 r2 | t0 r3 | t1 r0 | t1 r1 | t1 r2]
    #           0       2       4       6       8       11      14     (element offsets)
    # feature_table_map = [0, 1, 0]   (features f0 and f2 share t0)
    # pooled output [B, 7]: f0 -> cols 0:2, f1 -> cols 2:5, f2 -> cols 5:7

``TableLayout`` is static (hashable): it is part of the compiled program.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


class PoolingMode(enum.IntEnum):
    """FBGEMM's pooling modes, with FBGEMM's values."""

    SUM = 0
    MEAN = 1
    NONE = 2  # sequence embeddings: one row per id


def as_pooling_mode(pooling) -> PoolingMode:
    """A PoolingMode from itself, its value or its name (any case)."""
    if isinstance(pooling, str) and pooling.upper() in PoolingMode.__members__:
        return PoolingMode[pooling.upper()]
    try:
        return PoolingMode(pooling)
    except ValueError:
        raise ValueError(f"pooling must be PoolingMode.SUM (0), MEAN (1) or NONE (2), or their "
                         f"names; got {pooling!r}") from None


def per_sample_weights_operand(per_sample_weights, indices) -> jax.Array:
    """The kernels' per-sample-weights operand: ``float32[N]`` like ``indices``, checked,
    or ``float32[0]`` when unweighted (None). float16/bfloat16/float64 weights are cast
    to float32 (the kernels sum in float32 anyway)."""
    if per_sample_weights is None:
        return jnp.zeros((0,), jnp.float32)
    psw = jnp.asarray(per_sample_weights)
    if psw.shape != indices.shape or not jnp.issubdtype(psw.dtype, jnp.floating):
        raise ValueError(f"per_sample_weights must be a floating point array of shape "
                         f"{list(indices.shape)} like indices (float32, float16 or bfloat16), "
                         f"got {psw.dtype}{list(psw.shape)}")
    return psw.astype(jnp.float32)


def index_array(name: str, x) -> jax.Array:
    """``x`` as a jax integer array; host int64 values that int32 cannot hold need x64.

    Without ``jax_enable_x64`` JAX silently wraps int64 host values into int32 (2**31
    becomes -2**31), which would turn a bad id into another bad id or a wrong row.
    """
    if isinstance(x, (np.ndarray, list, tuple)) and not jax.config.jax_enable_x64:
        host = np.asarray(x)
        if host.size and np.issubdtype(host.dtype, np.integer):
            info = np.iinfo(np.int32)
            lo, hi = host.min(), host.max()
            if lo < info.min or hi > info.max:
                bad = lo if lo < info.min else hi
                raise ValueError(f"{name} holds {int(bad)}, outside int32, and jax_enable_x64 is "
                                 "off (JAX would wrap it silently); enable it with "
                                 "jax.config.update('jax_enable_x64', True) and pass int64 "
                                 f"{name}")
    return jnp.asarray(x)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableLayout:
    """Tables in one flat buffer and the table each feature looks up."""

    rows: tuple[int, ...]
    """Row count of each table."""
    dims: tuple[int, ...]
    """Embedding dimension of each table."""
    feature_table_map: tuple[int, ...]
    """Table of each feature (FBGEMM's name); several features may share a table."""

    def __post_init__(self):
        if len(self.rows) != len(self.dims) or not self.rows:
            raise ValueError(f"rows and dims must name the same tables (>= 1), got "
                             f"{len(self.rows)} row counts and {len(self.dims)} dims")
        if any(r < 1 for r in self.rows) or any(d < 1 for d in self.dims):
            raise ValueError(f"every table needs rows >= 1 and dim >= 1, got rows={self.rows}, "
                             f"dims={self.dims}")
        bad = [t for t in self.feature_table_map if not 0 <= t < len(self.rows)]
        if bad or not self.feature_table_map:
            raise ValueError(f"feature_table_map must list, for each feature, a table in "
                             f"[0, {len(self.rows)}); got {self.feature_table_map}")

    @classmethod
    def from_embedding_specs(cls, specs: Sequence[tuple[int, int]],
                             feature_table_map: Sequence[int] | None = None) -> TableLayout:
        """FBGEMM's ``embedding_specs`` as ``[(rows, dim), ...]``; one feature per table by default."""
        rows = tuple(int(r) for r, _ in specs)
        dims = tuple(int(d) for _, d in specs)
        ftm = tuple(range(len(rows))) if feature_table_map is None else tuple(int(t) for t in feature_table_map)
        return cls(rows=rows, dims=dims, feature_table_map=ftm)

    @property
    def num_tables(self) -> int:
        return len(self.rows)

    @property
    def num_features(self) -> int:
        return len(self.feature_table_map)

    @property
    def table_offsets(self) -> tuple[int, ...]:
        """Element offset of each table in the flat buffer (FBGEMM's ``weights_offsets``)."""
        sizes = np.asarray(self.rows, np.int64) * np.asarray(self.dims, np.int64)
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(sizes)[:-1]]))

    @property
    def row_offsets(self) -> tuple[int, ...]:
        """First row of each table among all tables' rows (the offsets of a per-row
        optimizer state buffer, FBGEMM's ``momentum1_offsets`` of a row-wise optimizer)."""
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.rows)[:-1]]))

    @property
    def num_weights(self) -> int:
        """Elements of the flat buffer."""
        return int(sum(r * d for r, d in zip(self.rows, self.dims)))

    @property
    def feature_dims(self) -> tuple[int, ...]:
        return tuple(self.dims[t] for t in self.feature_table_map)

    @property
    def feature_rows(self) -> tuple[int, ...]:
        return tuple(self.rows[t] for t in self.feature_table_map)

    @property
    def feature_first_rows(self) -> tuple[int, ...]:
        """First row of each feature's table among all tables' rows (the row keys' base)."""
        table_first_row = np.concatenate([[0], np.cumsum(self.rows, dtype=np.int64)[:-1]])
        return tuple(int(table_first_row[t]) for t in self.feature_table_map)

    @property
    def output_offsets(self) -> tuple[int, ...]:
        """Column of each feature in the pooled ``[B, total_dim]`` output (FBGEMM's ``D_offsets``)."""
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.feature_dims)]))

    @property
    def total_dim(self) -> int:
        return self.output_offsets[-1]

    def packed(self) -> np.ndarray:
        """The int32 layout operand of the kernels (``csrc/common/tbe.h``)."""
        offsets = self.table_offsets
        values = np.array([offsets[t] for t in self.feature_table_map] + list(self.feature_dims)
                          + list(self.feature_rows) + list(self.feature_first_rows)
                          + list(self.output_offsets), np.int64)
        return values.view(np.int32)

    def split_embedding_weights(self, weights: jax.Array) -> list[jax.Array]:
        """Per-table ``[rows, dim]`` views of the flat buffer (FBGEMM's name); a NumPy
        buffer gives NumPy views."""
        _check_weights(self, weights)
        return [flat_slice(weights, off, r * d).reshape(r, d)
                for off, r, d in zip(self.table_offsets, self.rows, self.dims)]

    def merge_embedding_weights(self, tables: Sequence[jax.Array]) -> jax.Array:
        """The flat buffer from per-table ``[rows, dim]`` arrays (inverse of the split)."""
        if len(tables) != self.num_tables:
            raise ValueError(f"expected {self.num_tables} tables, got {len(tables)}")
        for t, table in enumerate(tables):
            if tuple(table.shape) != (self.rows[t], self.dims[t]):
                raise ValueError(f"table {t} has shape {tuple(table.shape)}, the layout says "
                                 f"{(self.rows[t], self.dims[t])}")
        return jnp.concatenate([jnp.ravel(t) for t in tables])


def flat_slice(buffer, start: int, size: int):
    """``buffer[start:start + size]`` of a flat buffer: a view of a NumPy buffer. JAX slices
    an array outside ``jit`` with its bounds as int32 operands (``x[a:b]`` and ``lax.slice``
    alike), which overflow past 2**31 elements: there the slice is compiled with its
    bounds (one compile per slice, so only there)."""
    if isinstance(buffer, np.ndarray) or start + size < 2**31:
        return buffer[start:start + size]
    return _static_slice(buffer, start, size)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _static_slice(buffer, start, size):
    return jax.lax.slice(buffer, (start,), (start + size,))


def init_weights(key: jax.Array, layout: TableLayout, dtype=jnp.float32) -> jax.Array:
    """FBGEMM/TorchRec's default initialisation: table t ~ U(-sqrt(1/rows_t), sqrt(1/rows_t))."""
    keys = jax.random.split(key, layout.num_tables)

    def draw(t):
        r, d = layout.rows[t], layout.dims[t]
        return jax.random.uniform(keys[t], (r, d), jnp.float32, -np.sqrt(1.0 / r), np.sqrt(1.0 / r))

    return merge_drawn_tables(layout, draw, dtype)


IN_PLACE_BYTES = 1 << 30
"""Buffers from this size on are drawn table by table into one buffer (``merge_drawn_tables``)."""


def merge_drawn_tables(layout: TableLayout, draw, dtype) -> jax.Array:
    """The flat ``dtype`` buffer whose table t is ``draw(t)``, a float32 ``[rows, dim]`` array.

    Small buffers are drawn whole and concatenated. From ``IN_PLACE_BYTES`` on, each table
    is drawn under ``jit`` straight into a donated buffer, so the peak is the buffer plus
    one table in ``dtype``, not the float32 tables plus their concatenation plus the cast:
    MLPerf DCNv2's 26 tables are 52 GB in bfloat16, and 208 GB the other way. Both paths
    give the same values. ``draw`` must be traceable."""
    dtype = jnp.dtype(dtype)
    # The buffer as [n / width, width] rows with every table starting on a row, so that the
    # update's start index fits int32 even when the element offsets do not.
    width = int(np.gcd.reduce(np.asarray((*layout.table_offsets, layout.num_weights), np.int64)))
    rows = layout.num_weights // max(width, 1)
    if layout.num_weights * dtype.itemsize < IN_PLACE_BYTES or rows > np.iinfo(np.int32).max:
        return layout.merge_embedding_weights([draw(t) for t in range(layout.num_tables)]).astype(dtype)
    flat = jnp.zeros((layout.num_weights,), dtype)
    for t, offset in enumerate(layout.table_offsets):
        def write(buffer, t=t, start=offset // width):
            table = draw(t).astype(dtype).reshape(-1, width)
            return jax.lax.dynamic_update_slice(buffer.reshape(rows, width), table, (start, 0)).reshape(-1)
        flat = jax.jit(write, donate_argnums=0)(flat)
    return flat


def _check_weights(layout: TableLayout, weights) -> None:
    if weights.ndim != 1 or weights.shape[0] != layout.num_weights:
        raise ValueError(f"weights must be the flat buffer of {layout.num_weights} elements "
                         f"(sum of rows * dim over the tables); got shape {tuple(weights.shape)}. "
                         "Build it with init_weights() or layout.merge_embedding_weights().")
    if weights.dtype not in (jnp.float32, jnp.float16, jnp.bfloat16):
        raise TypeError(f"weights must be float32, float16 or bfloat16, got {weights.dtype}")
