"""The TBE backward with the optimizer fused in: ``fused_update`` (the explicit form).

The table gradient is never materialised. Given the gradient of the lookup's output,
every table row the batch touched is updated once, in place, with its duplicates'
gradients summed first (FBGEMM's ``EXACT_*`` optimizers)::

    acts = embedding_bag_lookup(weights, indices, offsets, layout=layout)
    act_grads = jax.grad(loss_of_acts)(acts)               # the dense part only
    weights, state = fused_update(weights, state, act_grads, indices, offsets,
                                  layout=layout, config=RowWiseAdagrad(learning_rate=0.05))

In place means: under ``jax.jit(..., donate_argnums=...)`` with ``weights`` and ``state``
donated, the kernel writes into the very buffers it was given (``input_output_aliases``),
so a step costs O(batch), not O(table). **Donate them**: without donation XLA must keep
the old buffers alive and copies the whole table (and its state) every step. Inside
one jit, ``grad_output`` must depend on the lookup's output (as a real gradient does):
otherwise XLA may schedule the in-place update before the lookup reads the table, and
copies the table to keep the lookup correct.

Kernels: the handler sorts the ids by table row (a radix sort over the bits of the row
count: CUB on the GPU, a parallel C++ one on the CPU), then one group of CUDA lanes
(docs/fused.md) or one CPU task per unique row sums the row's gradient in sorted order
and applies ``jaxrec.optim.update_rows``' math
(csrc/common/fused_optimizer.h) to the row and its state. Deterministic run to run. The
reference is ``embedding_bag_sparse_grad`` + ``jaxrec.fused.fused_update_reference``.

``gradient_clipping`` is FBGEMM's: ``grad_output`` is clamped element-wise to
``[-max_gradient, max_gradient]`` before the backward, so the rows' summed gradients
and the per-sample weights' gradient both come from the clamped values.

A row whose update would not be finite, as stored (a NaN or Inf in ``grad_output``, or
a rate so large that the row or its state overflows), is not written: it keeps its
weights and state. Inside a train step the guard counts such rows and treats the step
as non-finite (``jaxrec._step_guard``, docs/reliability.md); the explicit form returns
the count with ``return_nonfinite_rows=True``.

Bad ids never reach another table: with ``bounds_check_mode="NONE"`` an id outside its
feature's table is dropped (no row and no optimizer state is touched for it; its
per-sample-weight gradient is 0) and the offsets are clamped (docs/bounds_check.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec import _ffi
from jaxrec.fused._reference import reference_fits, update_reference
from jaxrec.ops.bounds_check import BoundsCheckMode, as_bounds_check_mode, bounds_check_indices
from jaxrec.ops.row_sort import check_row_keys_fit
from jaxrec.ops.tbe_layout import (
    PoolingMode,
    TableLayout,
    _check_weights,
    as_pooling_mode,
    index_array,
    per_sample_weights_operand,
)
from jaxrec.ops.tbe_reference import (
    clamp_offsets,
    embedding_bag_reference,
)
from jaxrec.ops.tbe_sparse_grad import embedding_bag_sparse_grad
from jaxrec.optim import _configs as C
from jaxrec.optim._rowwise import clip_output_gradient
from jaxrec.optim._state import buffer_fields, check_state

# OptimizerKind of csrc/common/fused_optimizer.h.
_KIND = {C.SGD: 0, C.Adagrad: 1, C.RowWiseAdagrad: 2, C.Adam: 3, C.PartialRowWiseAdam: 4,
         C.LAMB: 5, C.PartialRowWiseLAMB: 6, C.LarsSGD: 7}
_WEIGHT_DECAY_MODE = {"none": 0, "l2": 1, "decoupled": 2}
MAX_KERNEL_DIM = 1024
"""The CUDA kernel holds a row in one warp's registers, up to this dim; on the GPU, tables
of a larger dim use the jnp reference (same result, slower). The CPU kernel has no limit."""


def fused_update(weights: jax.Array, state, grad_output: jax.Array, indices: jax.Array,
                 offsets: jax.Array, *, layout: TableLayout, config: C.OptimizerConfig,
                 hparams: C.OptimizerHyperparams | None = None,
                 pooling: PoolingMode | int = PoolingMode.SUM, per_sample_weights=None,
                 bounds_check_mode: BoundsCheckMode | int | str = BoundsCheckMode.WARNING,
                 backend: str = "auto", return_per_sample_weights_grad: bool = False,
                 return_nonfinite_rows: bool = False):
    """One optimizer step on the rows the batch touched; returns ``(weights, state)``, then
    ``grad_per_sample_weights`` with ``return_per_sample_weights_grad`` and
    ``nonfinite_rows`` with ``return_nonfinite_rows``, in that order.

    Args:
      weights: the flat buffer of all tables (``init_weights``); donate it.
      state: ``jaxrec.optim.init_state(config, layout)`` or a previous result; donate it.
      grad_output: the gradient of ``embedding_bag_lookup``'s output for the same batch
        (``[B, total_dim]``, or ``[N, dim]`` for ``pooling=NONE``).
      indices, offsets, pooling, per_sample_weights: the batch, as given to the lookup.
      layout: the tables.
      config: the optimizer (static; hashable).
      hparams: traced numbers, ``config.hyperparams()`` when None: change the learning
        rate without recompiling (``hparams._replace(learning_rate=...)``).
      bounds_check_mode: as for the lookup, so both see the same corrected ids.
      backend: "auto", "kernel" or "reference".
      return_per_sample_weights_grad: also return the gradient of the lookup's output
        with respect to ``per_sample_weights`` (shape of ``indices``; 0 for padding and
        dropped ids), computed in the same pass from the rows before their update.
      return_nonfinite_rows: also return the int32 count of rows that kept their values
        because their update would not have been finite (module doc).
    """
    if return_per_sample_weights_grad and per_sample_weights is None:
        raise ValueError("return_per_sample_weights_grad=True needs per_sample_weights")
    weights, state, grad_psw, nonfinite_rows = _fused_update(
        weights, state, grad_output, indices, offsets, layout=layout, config=config,
        hparams=hparams, pooling=pooling, per_sample_weights=per_sample_weights,
        bounds_check_mode=bounds_check_mode, backend=backend)
    return ((weights, state) + ((grad_psw,) if return_per_sample_weights_grad else ())
            + ((nonfinite_rows,) if return_nonfinite_rows else ()))


def _fused_update(weights, state, grad_output, indices, offsets, *, layout, config, hparams,
                  pooling, per_sample_weights, bounds_check_mode, backend,
                  offsets_checked: bool = False):
    """``fused_update`` that also returns the per-sample weights' gradient (or None) and the
    int32 count of rows kept because their update would not stay finite.

    ``offsets_checked``: the caller ran ``bounds_check_indices`` (``fused_lookup``'s
    forward), so NONE here need not correct the offsets again."""
    op, hparams, grad_output, indices, offsets, per_sample_weights = _validate(
        weights, state, grad_output, indices, offsets, layout, config, hparams, pooling,
        per_sample_weights, backend)
    hparams = C.scheduled(config, hparams, state.step)
    if as_bounds_check_mode(bounds_check_mode) != BoundsCheckMode.NONE:
        indices, offsets, _ = bounds_check_indices(
            layout.feature_rows, indices, offsets, bounds_check_mode,
            table_names=[str(t) for t in layout.feature_table_map], backend=backend)
    elif not offsets_checked:
        offsets = clamp_offsets(offsets, indices.shape[0])
    grad_output = clip_output_gradient(config, hparams, grad_output)
    cuda = _kernel if max(layout.dims) <= MAX_KERNEL_DIM else _reference
    if backend == "auto" and not reference_fits(layout, indices.shape[0]):
        backend = "kernel"  # the kernels index with int64 whatever jax_enable_x64 says
    weights, state, grad_psw, nonfinite_rows = _ffi.dispatch(
        {"cpu": functools.partial(_kernel, op), "cuda": functools.partial(cuda, op)},
        functools.partial(_reference, op),
        weights, state, grad_output, indices, offsets, per_sample_weights, hparams, backend=backend)
    return weights, state, (grad_psw if op.weighted else None), nonfinite_rows


@dataclasses.dataclass(frozen=True)
class _Op:
    layout: TableLayout
    config: C.OptimizerConfig
    pooling: PoolingMode
    weighted: bool


def _kernel(op: _Op, weights, state, grad_output, indices, offsets, per_sample_weights, hparams):
    total_rows = check_row_keys_fit(op.layout, indices.dtype)
    names = buffer_fields(op.config.state_type)
    buffers = [getattr(state, name) for name in names]
    buffers += [jnp.zeros((0,), jnp.float32)] * (2 - len(buffers))
    # Operand 1 (weights) -> result 0; state buffers 6, 7 -> results 1, 2.
    aliases = {1: 0, **{6 + i: 1 + i for i in range(len(names))}}
    results = (jax.ShapeDtypeStruct(weights.shape, weights.dtype),
               *(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers),
               jax.ShapeDtypeStruct(per_sample_weights.shape, jnp.float32),
               jax.ShapeDtypeStruct((), jnp.int32))
    call = jax.ffi.ffi_call("jaxrec_tbe_fused_update", results, vmap_method="sequential",
                            input_output_aliases=aliases)
    config = op.config
    new_weights, state1, state2, grad_psw, nonfinite_rows = call(
        grad_output, weights, indices, offsets, per_sample_weights,
        jnp.asarray(op.layout.packed()), buffers[0], buffers[1], jnp.stack(hparams), jnp.asarray(state.step, jnp.int32),
        optimizer=np.int32(_KIND[type(config)]), pooling=np.int32(op.pooling),
        weight_decay_mode=np.int32(_WEIGHT_DECAY_MODE[getattr(config, "weight_decay_mode", "none")]),
        stochastic_rounding=np.int32(config.stochastic_rounding),
        seed=np.array(config.seed, np.uint32).view(np.int32)[()],  # the same 32 bits
        max_dim=np.int32(max(op.layout.dims)), total_rows=np.int64(total_rows))
    new_buffers = dict(zip(names, (state1, state2)))
    return new_weights, type(state)(step=state.step + 1, **new_buffers), grad_psw, nonfinite_rows


def _reference(op: _Op, weights, state, grad_output, indices, offsets, per_sample_weights, hparams):
    psw = per_sample_weights if op.weighted else None
    sparse = embedding_bag_sparse_grad(grad_output, indices, offsets, layout=op.layout,
                                       pooling=op.pooling, per_sample_weights=psw)
    grad_psw = per_sample_weights
    if op.weighted:
        grad_psw = _per_sample_weight_grad(op, weights, grad_output, indices, offsets, psw)
    weights, state, nonfinite_rows = update_reference(weights, state, sparse, layout=op.layout,
                                                      config=op.config, hparams=hparams)
    return weights, state, grad_psw, nonfinite_rows


def _per_sample_weight_grad(op, weights, grad_output, indices, offsets, per_sample_weights):
    def f(psw):
        return embedding_bag_reference(weights, indices, offsets, psw, layout=op.layout,
                                       pooling=op.pooling, output_dtype=jnp.float32)

    return jax.vjp(f, per_sample_weights)[1](grad_output)[0]


def _validate(weights, state, grad_output, indices, offsets, layout, config, hparams, pooling,
              per_sample_weights, backend):
    if not isinstance(layout, TableLayout):
        raise TypeError(f"layout must be a jaxrec.ops.TableLayout, got {type(layout).__name__}")
    _check_weights(layout, weights)
    if isinstance(config, C.NoOptimizer):
        raise ValueError("NoOptimizer has no fused update: take the table gradient with jax.grad "
                         "of embedding_bag_lookup (or embedding_bag_sparse_grad) and apply optax")
    if type(config) not in _KIND:
        raise TypeError(f"config must be a jaxrec.optim optimizer config, got {type(config).__name__}")
    check_state(config, layout, state)
    hparams = config.hyperparams() if hparams is None else hparams
    if not isinstance(hparams, C.OptimizerHyperparams):
        raise TypeError(f"hparams must be an OptimizerHyperparams (config.hyperparams()), got "
                        f"{type(hparams).__name__}")
    hparams = C.OptimizerHyperparams(*(jnp.asarray(x, jnp.float32) for x in hparams))
    pooling = as_pooling_mode(pooling)
    indices, offsets = index_array("indices", indices), index_array("offsets", offsets)
    if indices.ndim != 1 or indices.dtype not in (jnp.int32, jnp.int64):
        raise TypeError(f"indices must be a 1-D int32 or int64 array, got {indices.dtype}{list(indices.shape)}")
    if offsets.ndim != 1 or not jnp.issubdtype(offsets.dtype, jnp.integer):
        raise TypeError(f"offsets must be a 1-D integer array, got {offsets.dtype}{list(offsets.shape)}")
    offsets = offsets.astype(indices.dtype)
    num_bags = offsets.shape[0] - 1
    if num_bags % layout.num_features:
        raise ValueError(f"offsets has {offsets.shape[0]} entries, which is not T * B + 1 for the "
                         f"layout's T = {layout.num_features} features")
    if pooling == PoolingMode.NONE:
        want = (indices.shape[0], layout.dims[0])
    else:
        want = (num_bags // layout.num_features, layout.total_dim)
    grad_output = jnp.asarray(grad_output)
    if tuple(grad_output.shape) != want:
        raise ValueError(f"grad_output must have the lookup output's shape {want} for this batch "
                         f"and pooling {pooling.name}, got {tuple(grad_output.shape)}")
    grad_output = grad_output.astype(jnp.float32)
    weighted = per_sample_weights is not None
    if weighted and pooling == PoolingMode.NONE:
        raise ValueError("per_sample_weights need pooling SUM or MEAN")
    per_sample_weights = per_sample_weights_operand(per_sample_weights, indices)
    if backend not in ("auto", "kernel", "reference"):
        raise ValueError(f"backend must be 'auto', 'kernel' or 'reference', got {backend!r}")
    return _Op(layout, config, pooling, weighted), hparams, grad_output, indices, offsets, per_sample_weights
