"""The jnp reference of the fused sparse update: gather rows, ``update_rows``, scatter back.

The oracle of the fused CUDA/C++ kernels and their portable fallback. Only the rows
named in the ``SparseRowGrad`` are read and written (each exactly once: duplicates
were merged by ``embedding_bag_sparse_grad``); every other weight and state value
stays bit-identical. A row whose new weights or state would not all be finite, as
stored (a NaN or Inf gradient, or an update that overflows), is not written: it keeps
its values, as in the kernels (csrc/common/fused_optimizer.h, ``RowStaysFinite``).
``step`` advances once per call, for all tables. As in FBGEMM the update is lazy: a row
outside the batch keeps its moments (no decay) and gets no weight decay, where a dense
optax step would touch every row::

    # sparse_grad: tables=[0, 1, 0, -1], rows=[3, 0, 1, 0], num_unique=3  (entry 3 is padding)
    # weights  [t0 r0 | t0 r1 | t0 r2 | t0 r3 | t1 r0 | t1 r1 | t1 r2]
    #                   ^^^^^           ^^^^^   ^^^^^                   <- gathered, updated,
    # per-row state     [t0r0 t0r1 t0r2 t0r3 | t1r0 t1r1 t1r2]             scattered back
    #                         ^^^^      ^^^^   ^^^^
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec.ops.tbe_layout import TableLayout
from jaxrec.ops.tbe_sparse_grad import SparseRowGrad
from jaxrec.optim import _configs as C
from jaxrec.optim._rowwise import update_rows
from jaxrec.optim._state import buffer_fields, check_state, state_offsets


def reference_fits(layout: TableLayout, num_rows: int) -> bool:
    """Whether the reference can index the weights: int32 offsets unless jax_enable_x64."""
    index_dtype = jnp.int64 if jax.config.jax_enable_x64 else jnp.int32
    return layout.num_weights < np.iinfo(index_dtype).max - num_rows


def fused_update_reference(weights: jax.Array, state, sparse_grad: SparseRowGrad, *,
                           layout: TableLayout, config: C.OptimizerConfig,
                           hparams: C.OptimizerHyperparams | None = None):
    """Apply ``config``'s optimizer to the rows of ``sparse_grad``; returns ``(weights, state)``.

    Args:
      weights: the flat buffer of all tables (``init_weights``).
      state: ``init_state(config, layout)`` or a previous result.
      sparse_grad: unique rows and their summed gradients (``embedding_bag_sparse_grad``).
      layout: the tables.
      config: the optimizer; static (hashable), e.g. bound with ``functools.partial``.
      hparams: traced numbers, ``config.hyperparams()`` when None. Pass them as a ``jit``
        argument to change the learning rate without recompiling.
    """
    weights, state, _ = update_reference(weights, state, sparse_grad, layout=layout,
                                         config=config, hparams=hparams)
    return weights, state


def update_reference(weights, state, sparse_grad, *, layout, config, hparams=None):
    """``fused_update_reference`` that also returns ``nonfinite_rows``, the int32 count of
    rows kept because their update would not stay finite (the kernels' result)."""
    if not isinstance(layout, TableLayout):
        raise TypeError(f"layout must be a jaxrec.ops.TableLayout, got {type(layout).__name__}")
    if weights.ndim != 1 or weights.shape[0] != layout.num_weights:
        raise ValueError(f"weights must be the flat buffer of {layout.num_weights} elements "
                         f"(init_weights / layout.merge_embedding_weights), got shape "
                         f"{tuple(weights.shape)}")
    if jnp.dtype(weights.dtype).name not in ("float32", "float16", "bfloat16"):
        raise TypeError(f"weights must be float32, float16 or bfloat16, got {weights.dtype}")
    if isinstance(config, C.NoOptimizer):
        raise ValueError("NoOptimizer has no fused update: apply optax to the table gradient "
                         "(jax.grad of embedding_bag_lookup, or SparseRowGrad.to_dense)")
    check_state(config, layout, state)
    hparams = config.hyperparams() if hparams is None else hparams
    if not isinstance(sparse_grad, SparseRowGrad):
        raise TypeError(f"sparse_grad must be a jaxrec.ops.SparseRowGrad "
                        f"(embedding_bag_sparse_grad), got {type(sparse_grad).__name__}")
    n, width = sparse_grad.grads.shape
    max_dim = max(layout.dims)
    if width < max_dim or sparse_grad.tables.shape != (n,) or sparse_grad.rows.shape != (n,):
        raise ValueError(f"sparse_grad must hold tables[N], rows[N] and grads[N, >= {max_dim}] "
                         f"(the layout's largest dim); got {tuple(sparse_grad.tables.shape)}, "
                         f"{tuple(sparse_grad.rows.shape)} and {(n, width)}")
    index_dtype = jnp.int64 if jax.config.jax_enable_x64 else jnp.int32
    if not reference_fits(layout, n):
        raise ValueError(f"the tables have {layout.num_weights} weights, too many for "
                         f"{np.dtype(index_dtype).name} offsets; enable jax_enable_x64")

    num_unique = jnp.asarray(sparse_grad.num_unique).astype(index_dtype)
    valid = (jnp.arange(n, dtype=index_dtype) < num_unique) & (sparse_grad.tables >= 0)
    table = jnp.where(valid, sparse_grad.tables, 0).astype(index_dtype)
    row = jnp.where(valid, sparse_grad.rows, 0).astype(index_dtype)
    dims = jnp.asarray(layout.dims, index_dtype)[table]
    cols = jnp.arange(max_dim, dtype=index_dtype)
    in_row = valid[:, None] & (cols < dims[:, None])

    def element_index(offsets):  # [n, max_dim]; out-of-row columns read the row start
        start = jnp.asarray(offsets, index_dtype)[table] + row * dims
        return start[:, None] + jnp.where(in_row, cols, 0)

    def row_index(offsets):  # [n]
        return jnp.asarray(offsets, index_dtype)[table] + row

    w_index = element_index(layout.table_offsets)
    index = {}
    for name in buffer_fields(config.state_type):
        per_row = name in config.state_type.row_fields
        offsets = state_offsets(config, layout, name)
        index[name] = (row_index if per_row else element_index)(offsets)
    state_rows = config.state_type(step=state.step, **{
        name: getattr(state, name)[index[name]] for name in index})

    keys = jnp.asarray(layout.row_offsets, index_dtype)[table] + row
    new_w, new_state = update_rows(config, hparams, weights[w_index], sparse_grad.grads[:, :max_dim],
                                   state_rows, dims=jnp.where(valid, dims, 0), keys=keys)

    # What would be stored, and whether all of a row's values are finite.
    stored = {"": (weights, new_w, w_index)}
    stored.update({name: (getattr(state, name), getattr(new_state, name), idx)
                   for name, idx in index.items()})
    stays_finite = valid
    for buf, values, idx in stored.values():
        finite = jnp.isfinite(values.astype(buf.dtype))
        if idx.ndim == 2:
            finite = jnp.all(finite | ~in_row, axis=1)
        stays_finite = stays_finite & finite
    nonfinite_rows = jnp.sum(valid & ~stays_finite, dtype=jnp.int32)

    # Entries that must not be written go to an out-of-range index and are dropped.
    def scatter(buf, values, idx):
        keep = stays_finite if idx.ndim == 1 else in_row & stays_finite[:, None]
        idx = jnp.where(keep, idx, buf.shape[0])
        return buf.at[idx].set(values.astype(buf.dtype), mode="drop")

    weights = scatter(*stored.pop(""))
    buffers = {name: scatter(*args) for name, args in stored.items()}
    return weights, config.state_type(step=new_state.step, **buffers), nonfinite_rows
