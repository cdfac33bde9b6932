"""Table-batched embedding bags (TBE): FBGEMM's lookup as one XLA custom call.

``embedding_bag_lookup`` is the FBGEMM-layout entry point: flat ``indices``,
``offsets`` of ``T * B + 1`` entries in FBGEMM's feature-major order, optional
``per_sample_weights``; it returns ``[B, total_dim]`` (``[N, dim]`` for NONE)::

    # layout: t0 (rows=10, dim=4), t1 (rows=6, dim=2); feature_table_map = [0, 1]
    #              b=0       b=1        <-- batch (B = 2)
    # feature 0    [1, 5]    []                 output [2, 6]:
    # feature 1    [2]       [0, 3, 3]          row b = [pool(f0, b) | pool(f1, b)]
    # indices = [1, 5, 2, 0, 3, 3, <pad>...]; offsets = [0, 2, 2, 3, 6]

Pooling (FBGEMM's ``PoolingMode``): SUM; MEAN (an empty bag gives zeros); NONE
(sequence embeddings: row p of the output is the row of ``indices[p]``, zeros on
padding; all features must then share one dim). Sums run in float32 whatever the
weight dtype, in a fixed order (deterministic).

Gradients (``jax.grad`` through a ``custom_vjp``): the dense gradient of the flat
weight buffer (FBGEMM's ``optimizer=NONE``: plain optax can train the tables) and
the gradient of the per-sample weights. With MEAN pooling and per-sample weights
the output is ``sum_p w_p * row_p / L``, and jaxrec differentiates exactly that:
``d/dw_p = <g, row_p> / L`` (the consistent choice; FBGEMM's kernels are not
uniform about the 1/L there). ``embedding_bag_sparse_grad`` (tbe_sparse_grad.py)
gives the same gradient as unique rows and their summed gradients.

The bounds check (``bounds_check_mode``, FBGEMM's modes; default WARNING) is done by the
CUDA forward kernel as it reads the ids, with the corrections, WARNING's count and
FATAL's message of ``bounds_check_indices``; the gradients apply the same correction
in jnp where they read the ids. On the CPU and in the reference the lookup runs
``bounds_check_indices`` first (docs/bounds_check.md, "Where the check runs").

No bounds-check mode reads or writes outside a feature's own table. With
``bounds_check_mode="NONE"`` (docs/bounds_check.md, "What NONE does with a bad id"):
an id outside ``[0, rows)`` of its feature's table contributes nothing (no row is
read; its row gradient is dropped and its per-sample-weight gradient is 0; MEAN still
divides by the bag's length L, dropped ids included). Offsets under NONE are read
memory-safely: the CUDA forward kernel clamps each bag into ``[0, N]``; the CPU
forward, the references and every gradient use the other modes' correction
(``clamp_offsets``: clamped and non-decreasing). Both agree whenever the offsets are
non-decreasing; for decreasing offsets (input NONE promises not to have) the CUDA
forward's bags may overlap where the others' do not. The correction is a scan over
T * B + 1 offsets that cost the GPU lookup up to a third of its time, so the CUDA
forward leaves it out (docs/bounds_check.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec import _ffi, _step_guard
from jaxrec.ops import bounds_check as bc
from jaxrec.ops.bounds_check import BoundsCheckMode, as_bounds_check_mode
from jaxrec.ops.row_sort import sort_by_row
from jaxrec.ops.tbe_layout import (
    PoolingMode,
    TableLayout,
    _check_weights,
    as_pooling_mode,
    index_array,
    per_sample_weights_operand,
)
from jaxrec.ops.tbe_reference import (
    bag_of_position,
    clamp_offsets,
    embedding_bag_reference,
    valid_ids,
)


def embedding_bag_lookup(
    weights: jax.Array,
    indices: jax.Array,
    offsets: jax.Array,
    *,
    layout: TableLayout,
    pooling: PoolingMode | int = PoolingMode.SUM,
    per_sample_weights: jax.Array | None = None,
    output_dtype=jnp.float32,
    bounds_check_mode: BoundsCheckMode | int | str = BoundsCheckMode.WARNING,
    backend: str = "auto",
    feature_names: Sequence[str] | None = None,
    table_names: Sequence[str] | None = None,
) -> jax.Array:
    """Pooled (or sequence) embeddings of every feature in one launch; see the module doc.

    Args:
      weights: the flat buffer of all tables (``init_weights``), f32, f16 or bf16.
      indices: ``int32[N]`` / ``int64[N]`` ids; N is a static capacity. Host int64
        ids beyond int32 need ``jax_enable_x64`` (a ValueError says so).
      offsets: ``[T * B + 1]`` bag boundaries, feature-major (FBGEMM's order).
      layout: the tables and the table of each feature.
      pooling: ``PoolingMode.SUM``, ``MEAN`` or ``NONE`` (or the name).
      per_sample_weights: optional ``[N]`` weight of each id (SUM and MEAN); float32,
        float16 or bfloat16 (used as float32).
      output_dtype: float32, float16 or bfloat16.
      bounds_check_mode: how bad ids and offsets are handled before the lookup
        (``bounds_check_indices``). NONE skips the check and costs nothing: a bad id
        then contributes nothing (a zero row; 0 gradients) and bad offsets are clamped
        (see the module doc); no mode reads outside the feature's table. The WARNING
        count is not returned here: call ``bounds_check_indices`` yourself to read it.
      backend: "auto", "kernel" or "reference".
      feature_names, table_names: ``[T]`` names of the features and of their tables, for
        FATAL's message (default: their indices).
    """
    config, indices, offsets, per_sample_weights = prepare_lookup(
        weights, indices, offsets, layout=layout, pooling=pooling, per_sample_weights=per_sample_weights,
        output_dtype=output_dtype, bounds_check_mode=bounds_check_mode, backend=backend,
        feature_names=feature_names, table_names=table_names)
    out, num_corrected = lookup_and_count(config)(weights, per_sample_weights, indices, offsets)
    report_corrected(config, num_corrected)
    return out


def prepare_lookup(weights, indices, offsets, *, layout, pooling, per_sample_weights, output_dtype,
                   bounds_check_mode, backend, feature_names, table_names):
    """Validates a lookup and settles its bounds check: ``(config, indices, offsets,
    per_sample_weights)`` for ``lookup_and_count(config)`` (``embedding_bag_lookup`` and
    ``jaxrec.fused.fused_lookup`` share it)."""
    config, indices, offsets, per_sample_weights = _validate(
        weights, indices, offsets, layout, pooling, per_sample_weights, output_dtype, backend)
    mode = as_bounds_check_mode(bounds_check_mode)
    table_names = table_names or [str(t) for t in layout.feature_table_map]
    labels = tuple(bc.feature_labels(layout.num_features, feature_names, table_names))
    if mode == BoundsCheckMode.FATAL and _step_guard.active() is not None:
        # Inside a train step FATAL must not raise while the step runs: bounds_check_indices
        # records the finding for the step and corrects as IGNORE; nothing is left to find.
        indices, offsets, _ = bc.bounds_check_indices(
            layout.feature_rows, indices, offsets, mode, feature_names=feature_names,
            table_names=table_names, backend=backend)
        mode = BoundsCheckMode.IGNORE
    return (dataclasses.replace(config, bounds_check_mode=mode, labels=labels), indices, offsets,
            per_sample_weights)


def report_corrected(config: _Config, num_corrected: jax.Array) -> None:
    """WARNING's count, into the running train step's statistics (jaxrec._step_guard)."""
    if config.bounds_check_mode == BoundsCheckMode.WARNING:
        _step_guard.report_corrected(num_corrected)


def corrected_for_gradients(config: _Config, indices, offsets):
    """The ids and offsets the gradients read: NONE's clamped offsets, and under the
    checked modes also the bad ids of bags made row 0, as the forward read them (FATAL's
    forward has passed, so there is nothing to correct). In jnp, from the expressions the
    gradients compute anyway (XLA computes them once): no searchsorted, no extra pass."""
    n = indices.shape[0]
    offsets = clamp_offsets(offsets, n)
    if config.bounds_check_mode == BoundsCheckMode.NONE:
        return indices, offsets
    num_bags = offsets.shape[0] - 1
    bag = bag_of_position(offsets, n)
    in_bag = (bag >= 0) & (bag < num_bags)
    bad = in_bag & ~valid_ids(config.layout, indices, bag, num_bags)
    return jnp.where(bad, jnp.zeros_like(indices), indices), offsets


@dataclasses.dataclass(frozen=True)
class _Config:
    layout: TableLayout
    pooling: PoolingMode
    output_dtype: str
    weighted: bool
    backend: str
    bounds_check_mode: BoundsCheckMode = BoundsCheckMode.NONE
    labels: tuple[str, ...] = ()  # one per feature, for FATAL's message


def lookup_and_count(config: _Config):
    """The lookup ``(weights, per_sample_weights, indices, offsets) -> (output,
    num_corrected)``; ``num_corrected`` is WARNING's count (int32), outside autodiff."""

    def lookup(weights, per_sample_weights, indices, offsets):
        out, num_corrected = forward_and_count(config, weights, per_sample_weights, indices, offsets)
        return _with_gradient(config)(weights, per_sample_weights, indices, offsets, out), num_corrected

    return lookup


def forward_and_count(config: _Config, weights, per_sample_weights, indices, offsets):
    """The forward kernel (or reference) on values that autodiff does not trace, so that its
    integer count is a plain value; a ``custom_vjp`` then attaches the gradient to the
    output (``_with_gradient``, ``jaxrec.fused``)."""
    weights, per_sample_weights = jax.lax.stop_gradient((weights, per_sample_weights))
    return _ffi.dispatch({"cpu": functools.partial(_forward_kernel_cpu, config),
                          "cuda": functools.partial(_forward_kernel_cuda, config)},
                         functools.partial(_forward_reference, config),
                         weights, per_sample_weights, indices, offsets, backend=config.backend)


@functools.cache
def _with_gradient(config: _Config):
    """``out`` itself, with the lookup's gradient with respect to the weights and the
    per-sample weights."""

    @jax.custom_vjp
    def attach(weights, per_sample_weights, indices, offsets, out):
        return out

    def forward(weights, per_sample_weights, indices, offsets, out):
        return out, (weights, per_sample_weights, indices, offsets)

    def backward(residuals, grad_output):
        weights, per_sample_weights, indices, offsets = residuals
        indices, offsets = corrected_for_gradients(config, indices, offsets)
        grad_weights, grad_psw = _ffi.dispatch(
            {"cpu": functools.partial(_backward_kernel_cpu, config),
             "cuda": functools.partial(_backward_kernel_cuda, config)},
            functools.partial(_backward_reference, config),
            grad_output, weights, per_sample_weights, indices, offsets, backend=config.backend)
        return grad_weights.astype(weights.dtype), grad_psw, None, None, None

    attach.defvjp(forward, backward)
    return attach


def _output_shape(config: _Config, indices, offsets) -> tuple[int, int]:
    if config.pooling == PoolingMode.NONE:
        return indices.shape[0], config.layout.dims[0]
    return (offsets.shape[0] - 1) // config.layout.num_features, config.layout.total_dim


def _rows_operand(config: _Config, dtype) -> jax.Array:
    """Each feature's row count, as the standalone check takes it (ids of ``dtype``)."""
    return jnp.asarray(bc.clip_rows(config.layout.feature_rows, dtype), dtype)


def _no_count():
    return jnp.zeros((), jnp.int32)


def _forward_kernel_cpu(config: _Config, weights, per_sample_weights, indices, offsets):
    # The CPU handler takes corrected offsets only: bounds_check_indices' CPU kernel first.
    mode = config.bounds_check_mode
    if mode == BoundsCheckMode.NONE:
        offsets, num_corrected = clamp_offsets(offsets, indices.shape[0]), _no_count()
    else:
        rows = _rows_operand(config, indices.dtype)
        indices, offsets, num_corrected = bc.bounds_check_kernel(rows, indices, offsets, mode,
                                                                 config.labels)
    out = jax.ShapeDtypeStruct(_output_shape(config, indices, offsets), config.output_dtype)
    call = jax.ffi.ffi_call("jaxrec_tbe_forward", out, vmap_method="sequential")
    out = call(weights, indices, offsets, per_sample_weights, jnp.asarray(config.layout.packed()),
               pooling=np.int32(config.pooling))
    return out, num_corrected


def _forward_kernel_cuda(config: _Config, weights, per_sample_weights, indices, offsets):
    # The check runs in the forward kernel (csrc/cuda/tbe_forward.cu); report[0] is WARNING's count.
    results = (jax.ShapeDtypeStruct(_output_shape(config, indices, offsets), config.output_dtype),
               jax.ShapeDtypeStruct((4,), jnp.int32))
    batch_size = (offsets.shape[0] - 1) // config.layout.num_features
    schedule = _warp_schedule(config.layout.feature_dims, batch_size)
    call = jax.ffi.ffi_call("jaxrec_tbe_forward", results, vmap_method="sequential")
    out, report = call(weights, indices, offsets, per_sample_weights, jnp.asarray(config.layout.packed()),
                       jnp.asarray(schedule), pooling=np.int32(config.pooling),
                       num_warps=np.int64(schedule[config.layout.num_features]),
                       bounds_check_mode=np.int32(config.bounds_check_mode),
                       labels="\n".join(config.labels))
    warning = config.bounds_check_mode == BoundsCheckMode.WARNING
    return out, (report[0] if warning else _no_count())


@functools.cache
def _warp_schedule(dims: tuple[int, ...], batch_size: int) -> np.ndarray:
    """int32[2T+1] for csrc/cuda/tbe_util.cuh: each feature's first warp, then its lane-group shift.

    A bag of dim D gets 2^shift lanes, shift = ceil(log2(ceil(D / 4))) capped at 5 (a
    warp): 4 columns per lane, so small dims pack several bags into one warp.
    """
    shifts = np.array([min(5, int(np.ceil(np.log2(max(1, -(-d // 4)))))) for d in dims])
    warps = -(-batch_size // (32 >> shifts))
    start = np.concatenate([[0], np.cumsum(warps)])
    return np.concatenate([start, shifts]).astype(np.int32)


def _forward_reference(config: _Config, weights, per_sample_weights, indices, offsets):
    mode, num_corrected = config.bounds_check_mode, _no_count()
    if mode != BoundsCheckMode.NONE:
        rows = _rows_operand(config, indices.dtype)
        indices, offsets, num_corrected = bc.bounds_check_indices_reference(
            rows, indices, offsets, mode, config.labels)
    out = embedding_bag_reference(
        weights, indices, clamp_offsets(offsets, indices.shape[0]),
        per_sample_weights if config.weighted else None,
        layout=config.layout, pooling=config.pooling, output_dtype=config.output_dtype)
    return out, num_corrected


def _grad_shapes(weights, per_sample_weights):
    return (jax.ShapeDtypeStruct(weights.shape, jnp.float32),
            jax.ShapeDtypeStruct(per_sample_weights.shape, jnp.float32))


def _backward_kernel_cpu(config: _Config, grad_output, weights, per_sample_weights, indices, offsets):
    call = jax.ffi.ffi_call("jaxrec_tbe_backward", _grad_shapes(weights, per_sample_weights),
                            vmap_method="sequential")
    return call(grad_output, weights, indices, offsets, per_sample_weights,
                jnp.asarray(config.layout.packed()), pooling=np.int32(config.pooling))


def _backward_kernel_cuda(config: _Config, grad_output, weights, per_sample_weights, indices, offsets):
    # The (table row, position) pairs sorted (by XLA: a CUB radix sort on the GPU); the
    # kernel then sums each row's contributions in that fixed order, without atomics.
    sorted_key, sorted_position, sorted_bag = sort_by_row(config.layout, indices, offsets)
    call = jax.ffi.ffi_call("jaxrec_tbe_backward_sorted", _grad_shapes(weights, per_sample_weights),
                            vmap_method="sequential")
    return call(grad_output, weights, indices, offsets, per_sample_weights,
                jnp.asarray(config.layout.packed()), sorted_key, sorted_position, sorted_bag,
                pooling=np.int32(config.pooling))


def _backward_reference(config: _Config, grad_output, weights, per_sample_weights, indices, offsets):
    unchecked = dataclasses.replace(config, bounds_check_mode=BoundsCheckMode.NONE)  # corrected already

    def f(w, psw):
        return _forward_reference(unchecked, w, psw, indices, offsets)[0]

    _, vjp = jax.vjp(f, weights.astype(jnp.float32), per_sample_weights)
    grad_weights, grad_psw = vjp(grad_output.astype(config.output_dtype))
    return grad_weights, grad_psw


# --- validation ----------------------------------------------------------------------


def _validate(weights, indices, offsets, layout, pooling, per_sample_weights, output_dtype, backend):
    if not isinstance(layout, TableLayout):
        raise TypeError(f"layout must be a jaxrec.ops.TableLayout, got {type(layout).__name__}")
    _check_weights(layout, weights)
    pooling = as_pooling_mode(pooling)
    output_dtype = jnp.dtype(output_dtype)
    if output_dtype not in (jnp.float32, jnp.float16, jnp.bfloat16):
        raise TypeError(f"output_dtype must be float32, float16 or bfloat16, got {output_dtype}")
    indices, offsets = index_array("indices", indices), index_array("offsets", offsets)
    if indices.ndim != 1 or indices.dtype not in (jnp.int32, jnp.int64):
        raise TypeError(f"indices must be a 1-D int32 or int64 array, got {indices.dtype}{list(indices.shape)}")
    if offsets.ndim != 1 or not jnp.issubdtype(offsets.dtype, jnp.integer):
        raise TypeError(f"offsets must be a 1-D integer array, got {offsets.dtype}{list(offsets.shape)}")
    offsets = offsets.astype(indices.dtype)
    num_features = layout.num_features
    if (offsets.shape[0] - 1) % num_features:
        raise ValueError(f"offsets has {offsets.shape[0]} entries, which is not T * B + 1 for the "
                         f"layout's T = {num_features} features; pass B + 1 offsets per feature "
                         "(feature-major, the last one shared)")
    if sum(layout.rows) >= np.iinfo(indices.dtype).max:
        raise ValueError(f"the tables have {sum(layout.rows)} rows in all, too many for "
                         f"{indices.dtype} ids; enable jax_enable_x64 and pass int64 indices")
    if pooling == PoolingMode.NONE:
        if len(set(layout.feature_dims)) != 1:
            raise ValueError(f"pooling=NONE needs one dim for all features, got {layout.feature_dims}")
        if per_sample_weights is not None:
            raise ValueError("per_sample_weights need pooling SUM or MEAN; pooling=NONE has no bags to weight")
    config = _Config(layout, pooling, output_dtype.name, per_sample_weights is not None, backend)
    return config, indices, offsets, per_sample_weights_operand(per_sample_weights, indices)
