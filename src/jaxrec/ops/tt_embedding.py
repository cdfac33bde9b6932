"""Tensor-train embedding bags (FBTT-Embedding): ``tt_embedding_bag``, one XLA custom call.

The table is ``layout.num_cores`` cores (``tt_layout.py`` draws the layout). Each id's
row is the chain of core slices its digits select; bags are pooled SUM or MEAN with
optional per-sample weights, as ``embedding_bag_lookup`` does::

    # TT table E = 11M rows, D = 64: cores [1,200,4,32] [32,220,4,32] [32,250,4,1] (3.8 MB)
    #               b=0             b=1
    # ids           [17, 10999999]  []        -> out [2, 64]: out[0] = row(17) + row(10999999)
    # offsets = [0, 2, 2]                                     out[1] = 0

Several features may read the one table: ``offsets`` then has ``F * B + 1`` entries
(feature-major) and the output is ``[B, F * D]``.

On the GPU the forward and the gradient are CUDA kernels (``csrc/cuda/tt_embedding.cu``):
one warp per id contracts the chain in shared memory; the pooling sums each bag in
position order (deterministic). The gradient of the cores sums the contributions of all
ids with float32 atomics, so its last bits may differ between runs (as FBTT's). A
position whose per-sample weight is exactly 0 is skipped (it adds nothing).
Elsewhere (CPU) the op is the pure-jnp reference (``tt_reference.py``): a TT lookup is a
chain of small GEMMs, which XLA's CPU backend already runs well, so there is no CPU kernel.

Gradients (``jax.grad``): the dense gradient of every core (optax can train them) and of
the per-sample weights. The fused form (optimizer in the backward) is
``jaxrec.fused.TTEmbeddingTables`` / ``tt_fused_lookup``.

Bad input never reads outside the cores: ``validate`` clamps the offsets into
``[0, N]`` non-decreasing (``clamp_offsets``; a no-op on valid offsets), and with
``bounds_check_mode="NONE"`` an id outside ``[0, num_embeddings)`` contributes nothing
(no row; zero gradients), as in ``embedding_bag_lookup`` (docs/bounds_check.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec import _ffi
from jaxrec.ops.bounds_check import BoundsCheckMode, as_bounds_check_mode, bounds_check_indices
from jaxrec.ops.tbe_layout import PoolingMode, as_pooling_mode, index_array, per_sample_weights_operand
from jaxrec.ops.tbe_reference import clamp_offsets
from jaxrec.ops.tt_layout import TTLayout
from jaxrec.ops.tt_reference import bags_to_batch, batch_to_bags, tt_embedding_bag_reference

_MAX_CORES = 4  # the kernels take four core operands; unused ones are empty


def tt_embedding_bag(cores, indices: jax.Array, offsets: jax.Array, *, layout: TTLayout,
                     pooling: PoolingMode | int | str = PoolingMode.SUM,
                     per_sample_weights: jax.Array | None = None, num_features: int = 1,
                     bounds_check_mode: BoundsCheckMode | int | str = BoundsCheckMode.WARNING,
                     backend: str = "auto") -> jax.Array:
    """Pooled rows of a TT table, ``float32[B, F * D]``; see the module doc.

    Args:
      cores: the ``layout.num_cores`` float32 cores, core t shaped ``layout.core_shapes[t]``.
      indices: ``int32[N]`` / ``int64[N]`` ids in ``[0, num_embeddings)``; N is a static capacity.
      offsets: ``[F * B + 1]`` bag boundaries, feature-major.
      layout: the table's ``TTLayout``.
      pooling: SUM or MEAN (an empty bag gives zeros).
      per_sample_weights: optional ``float32[N]``.
      num_features: F, the features that read this table (their bags side by side).
      bounds_check_mode: how bad ids and offsets are handled first (``bounds_check_indices``);
        under NONE a bad id contributes nothing (see the module doc).
      backend: "auto", "kernel" or "reference".
    """
    cores, indices, offsets, psw, spec = validate(cores, indices, offsets, layout, pooling,
                                                  per_sample_weights, num_features, backend)
    if as_bounds_check_mode(bounds_check_mode) != BoundsCheckMode.NONE:
        indices, offsets = check_bounds(spec, indices, offsets, bounds_check_mode)
    return _lookup(spec)(cores, psw, indices, offsets)


@dataclasses.dataclass(frozen=True)
class TTSpec:
    """The static part of one TT lookup."""

    layout: TTLayout
    pooling: PoolingMode
    num_features: int
    weighted: bool
    backend: str


def check_bounds(spec: TTSpec, indices, offsets, mode):
    indices, offsets, _ = bounds_check_indices(
        (spec.layout.num_embeddings,) * spec.num_features, indices, offsets, mode,
        table_names=["tt"] * spec.num_features, backend=spec.backend)
    return indices, offsets


@functools.cache
def _lookup(spec: TTSpec):
    @jax.custom_vjp
    def lookup(cores, psw, indices, offsets):
        return tt_forward(spec, cores, psw, indices, offsets)

    def forward(cores, psw, indices, offsets):
        return lookup(cores, psw, indices, offsets), (cores, psw, indices, offsets)

    def backward(residuals, grad_output):
        cores, psw, indices, offsets = residuals
        grad_cores, grad_psw = tt_gradients(spec, grad_output, cores, psw, indices, offsets)
        return grad_cores, grad_psw, None, None

    lookup.defvjp(forward, backward)
    return lookup


def tt_forward(spec: TTSpec, cores, psw, indices, offsets) -> jax.Array:
    """``[B, F * D]`` without a custom_vjp (the fused lookup wraps it in its own)."""
    return _ffi.dispatch({"cuda": functools.partial(_forward_kernel, spec)},
                         functools.partial(_forward_reference, spec),
                         cores, psw, indices, offsets, backend=spec.backend)


def tt_gradients(spec: TTSpec, grad_output, cores, psw, indices, offsets):
    """``(grad of each core, grad of the per-sample weights)`` for the output gradient."""
    return _ffi.dispatch({"cuda": functools.partial(_backward_kernel, spec)},
                         functools.partial(_backward_reference, spec),
                         grad_output, cores, psw, indices, offsets, backend=spec.backend)


# --- CUDA ---------------------------------------------------------------------------


def _shape_attrs(spec: TTSpec) -> dict:
    layout = spec.layout
    return dict(pooling=np.int32(spec.pooling), num_embeddings=np.int64(layout.num_embeddings),
                p_shapes=np.asarray(layout.p_shapes, np.int64),
                q_shapes=np.asarray(layout.q_shapes, np.int64),
                ranks=np.asarray(layout.ranks, np.int64))


def _padded_cores(cores) -> list[jax.Array]:
    return list(cores) + [jnp.zeros((0,), jnp.float32)] * (_MAX_CORES - len(cores))


def _forward_kernel(spec: TTSpec, cores, psw, indices, offsets):
    num_bags, dim = offsets.shape[0] - 1, spec.layout.embedding_dim
    out_types = (jax.ShapeDtypeStruct((num_bags, dim), jnp.float32),
                 jax.ShapeDtypeStruct((indices.shape[0], dim), jnp.float32))  # row scratch
    call = jax.ffi.ffi_call("jaxrec_tt_forward", out_types, vmap_method="sequential")
    pooled, _ = call(indices, offsets, psw, *_padded_cores(cores), **_shape_attrs(spec))
    return bags_to_batch(pooled, spec.num_features)


def _backward_kernel(spec: TTSpec, grad_output, cores, psw, indices, offsets):
    grad_bags = batch_to_bags(grad_output.astype(jnp.float32), spec.num_features)
    padded = _padded_cores(cores)
    out_types = tuple(jax.ShapeDtypeStruct(c.shape, jnp.float32) for c in padded) + (
        jax.ShapeDtypeStruct(psw.shape, jnp.float32),)
    call = jax.ffi.ffi_call("jaxrec_tt_backward", out_types, vmap_method="sequential")
    *grads, grad_psw = call(grad_bags, indices, offsets, psw, *padded, **_shape_attrs(spec))
    return tuple(grads[: len(cores)]), grad_psw


# --- reference ----------------------------------------------------------------------


def _forward_reference(spec: TTSpec, cores, psw, indices, offsets):
    return tt_embedding_bag_reference(cores, indices, offsets, psw if spec.weighted else None,
                                      layout=spec.layout, pooling=spec.pooling,
                                      num_features=spec.num_features)


def _backward_reference(spec: TTSpec, grad_output, cores, psw, indices, offsets):
    _, vjp = jax.vjp(lambda c, w: _forward_reference(spec, c, w, indices, offsets), tuple(cores), psw)
    grad_cores, grad_psw = vjp(grad_output.astype(jnp.float32))
    return tuple(grad_cores), grad_psw


# --- validation -----------------------------------------------------------------------


def validate(cores, indices, offsets, layout, pooling, per_sample_weights, num_features, backend):
    """Checked operands and the static spec of a lookup (shared with the fused lookup)."""
    if not isinstance(layout, TTLayout):
        raise TypeError(f"layout must be a jaxrec.ops.TTLayout, got {type(layout).__name__}")
    cores = layout.validate_cores(cores)
    pooling = as_pooling_mode(pooling)
    if pooling not in (PoolingMode.SUM, PoolingMode.MEAN):
        raise ValueError(f"TT embedding bags pool SUM or MEAN, got pooling={pooling.name}")
    indices, offsets = index_array("indices", indices), index_array("offsets", offsets)
    if indices.ndim != 1 or indices.dtype not in (jnp.int32, jnp.int64):
        raise TypeError(f"indices must be a 1-D int32 or int64 array, got "
                        f"{indices.dtype}{list(indices.shape)}")
    if offsets.ndim != 1 or offsets.shape[0] < 1 or not jnp.issubdtype(offsets.dtype, jnp.integer):
        raise TypeError(f"offsets must be a 1-D integer array of F * B + 1 entries, got "
                        f"{offsets.dtype}{list(offsets.shape)}")
    # Every bag inside [0, N], none overlapping, whatever the bounds-check mode (TT
    # lookups are compute-bound: this scan over F * B + 1 offsets is free).
    offsets = clamp_offsets(offsets.astype(indices.dtype), indices.shape[0])
    if isinstance(num_features, bool) or not isinstance(num_features, (int, np.integer)) or (
            num_features < 1 or (offsets.shape[0] - 1) % num_features):
        raise ValueError(f"offsets has {offsets.shape[0]} entries, which is not F * B + 1 for "
                         f"num_features F = {num_features!r}; pass B + 1 offsets per feature "
                         "(feature-major, the last one shared)")
    weighted = per_sample_weights is not None
    psw = per_sample_weights_operand(per_sample_weights, indices)
    if backend not in ("auto", "kernel", "reference"):
        raise ValueError(f"backend must be 'auto', 'kernel' or 'reference', got {backend!r}")
    return cores, indices, offsets, psw, TTSpec(layout, pooling, int(num_features), weighted, backend)

