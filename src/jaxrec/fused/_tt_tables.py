"""TT tables whose optimizer runs inside the backward: ``TTEmbeddingTables`` + ``tt_fused_lookup``.

FBTT's ``sparse=True`` mode in the jaxrec pattern of ``_tables.py``: the backward of
``tt_fused_lookup`` computes the gradient of every core (summed over all ids of the
batch), applies the optimizer to the cores and hands the *updated* tables back where a
gradient would go. Train with ``fused_value_and_grad``, ``make_functional_train_step``
or ``jaxrec.nn.make_train_step``, exactly as FBGEMM-style tables.

Optimizers: ``SGD`` and ``Adagrad`` (element-wise, FBTT's two), with the math of
``update_rows`` applied to the cores viewed as rows ``[r * p, q * r']``. A core entry
that gets no gradient is left exactly unchanged by both.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec import _step_guard
from jaxrec.fused._tables import _record_update
from jaxrec.ops.bounds_check import BoundsCheckMode, as_bounds_check_mode
from jaxrec.ops.tbe_layout import PoolingMode
from jaxrec.ops.tt_embedding import (
    TTSpec,
    check_bounds,
    tt_forward,
    tt_gradients,
    validate,
)
from jaxrec.ops.tt_init import init_tt_cores
from jaxrec.ops.tt_layout import TTLayout
from jaxrec.ops.tt_reference import tt_full_weight
from jaxrec.optim import _configs as C
from jaxrec.optim._rowwise import clip_output_gradient, update_rows
from jaxrec.optim._state import buffer_fields

TT_OPTIMIZERS = (C.SGD, C.Adagrad)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["cores", "slots", "step", "hparams"],
                   meta_fields=["layout", "config", "name"])
@dataclasses.dataclass(frozen=True)
class TTEmbeddingTables:
    """One TT table with its fused optimizer: a pytree.

    ``cores`` (T float32 arrays), ``slots`` (per core, the optimizer's buffers by name:
    ``{"momentum1": ...}`` for Adagrad, ``{}`` for SGD), ``step`` and ``hparams`` are
    leaves; ``layout``, ``config`` and ``name`` are static.
    """

    cores: tuple[jax.Array, ...]
    slots: tuple[dict[str, jax.Array], ...]
    step: jax.Array
    hparams: C.OptimizerHyperparams
    layout: TTLayout
    config: C.OptimizerConfig
    name: str = "tt"

    @classmethod
    def create(cls, layout: TTLayout, config: C.OptimizerConfig, *, key=None, cores=None,
               weight_dist: str = "approx-normal", name: str = "tt") -> TTEmbeddingTables:
        """New tables: ``cores`` as given, else ``init_tt_cores(key, layout, weight_dist)``."""
        if not isinstance(config, TT_OPTIMIZERS):
            raise TypeError(f"config must be jaxrec.optim.SGD or Adagrad (FBTT's fused optimizers "
                            f"for TT cores), got {type(config).__name__}")
        if cores is None:
            if key is None:
                raise ValueError("TTEmbeddingTables.create needs key= (to initialise the cores) "
                                 "or cores=")
            cores = init_tt_cores(key, layout, weight_dist)
        # Copies: a train step donates the tables, and must not delete the caller's arrays.
        cores = layout.validate_cores(jnp.array(c, copy=True) for c in cores)
        slots = tuple(_zero_slots(config, c.shape) for c in cores)
        return cls(cores, slots, jnp.zeros((), jnp.int32), config.hyperparams(), layout, config, name)

    def full_weight(self) -> jax.Array:
        """The dense ``[num_embeddings, D]`` table of the cores' rows."""
        return tt_full_weight(self.cores, layout=self.layout)

    materialize = full_weight

    def after_fused_update(self, updated: TTEmbeddingTables,
                           applied: jax.Array | None = None) -> TTEmbeddingTables:
        """The tables after one fused update whose results ``updated`` carries (_train_step.py);
        ``applied``: a bool scalar when a train step's guard gated the update."""
        step = self.step + (1 if applied is None else applied.astype(self.step.dtype))
        return dataclasses.replace(updated, step=step, hparams=self.hparams)


def _zero_slots(config, shape) -> dict[str, jax.Array]:
    return {k: jnp.zeros(shape, getattr(config, "state_dtype", "float32"))
            for k in buffer_fields(config.state_type)}


def tt_fused_lookup(tables: TTEmbeddingTables, indices, offsets, *,
                    pooling: PoolingMode | int | str = PoolingMode.SUM, per_sample_weights=None,
                    num_features: int = 1,
                    bounds_check_mode: BoundsCheckMode | int | str = BoundsCheckMode.WARNING,
                    backend: str = "auto") -> jax.Array:
    """``tt_embedding_bag`` of ``tables`` whose backward is the fused update (module doc).

    Differentiate it with ``fused_value_and_grad`` or a train step only.
    """
    if not isinstance(tables, TTEmbeddingTables):
        raise TypeError(f"tables must be TTEmbeddingTables, got {type(tables).__name__}")
    _, indices, offsets, psw, spec = validate(tables.cores, indices, offsets, tables.layout, pooling,
                                              per_sample_weights, num_features, backend)
    if as_bounds_check_mode(bounds_check_mode) != BoundsCheckMode.NONE:
        indices, offsets = check_bounds(spec, indices, offsets, bounds_check_mode)
    return _fused(spec, tables.config, tables.name)(tables, psw, indices, offsets)


@functools.cache
def _fused(spec: TTSpec, config, name: str):
    def forward_only(tables, psw, indices, offsets):
        return tt_forward(spec, tables.cores, psw, indices, offsets)

    lookup = jax.custom_vjp(forward_only)

    def forward(tables, psw, indices, offsets):
        return forward_only(tables, psw, indices, offsets), (tables, psw, indices, offsets)

    def backward(residuals, grad_output):
        tables, psw, indices, offsets = residuals
        _record_update(name)
        tables = dataclasses.replace(tables, hparams=C.scheduled(config, tables.hparams, tables.step))
        gate = _step_guard.table_gate(name, grad_output)  # on the raw gradient: clip hides Inf
        grad_output = clip_output_gradient(config, tables.hparams, grad_output)
        grad_cores, grad_psw = tt_gradients(spec, grad_output, tables.cores, psw, indices, offsets)
        step_state = functools.partial(config.state_type, step=tables.step)
        cores, slots = [], []
        for core, grad, slot in zip(tables.cores, grad_cores, tables.slots):
            rows = (core.shape[0] * core.shape[1], -1)
            new, state = update_rows(config, tables.hparams, core.reshape(rows), grad.reshape(rows),
                                     step_state(**{k: v.reshape(rows) for k, v in slot.items()}))
            cores.append(new.reshape(core.shape))
            slots.append({k: getattr(state, k).reshape(core.shape) for k in slot})
        updated = dataclasses.replace(tables, cores=tuple(cores), slots=tuple(slots))
        # As the kernels keep a row whose update would not stay finite, a TT table keeps its
        # whole update (its cores are shared by every row); the step's guard is told.
        # Counted only where the guard let the update through, as the kernels count.
        stays_finite = _step_guard.all_finite(jax.tree.leaves(_trained(updated)))
        kept = ~stays_finite if gate is None else gate & ~stays_finite
        _step_guard.report_nonfinite_rows(kept.astype(jnp.int32))
        updated = _keep_unless(stays_finite if gate is None else gate & stays_finite, updated, tables)
        # The updated tables take the place of the gradient; the int step has none
        # (after_fused_update increments it), nor do the hyperparameters.
        updated = dataclasses.replace(updated, step=_no_grad(tables.step),
                                      hparams=jax.tree.map(jnp.zeros_like, tables.hparams))
        return updated, (grad_psw if spec.weighted else jnp.zeros_like(psw)), None, None

    lookup.defvjp(forward, backward)
    return lookup


def _trained(tables: TTEmbeddingTables) -> dict:
    """The fields a fused update changes: the cores and their slots."""
    return {"cores": tables.cores, "slots": tables.slots}


def _keep_unless(gate, updated: TTEmbeddingTables, old: TTEmbeddingTables) -> TTEmbeddingTables:
    """``updated``'s cores and slots where ``gate``, else ``old``'s."""
    fields = _trained(updated)
    kept = jax.tree.map(lambda new, before: jnp.where(gate, new, before), fields,
                        {k: getattr(old, k) for k in fields})
    return dataclasses.replace(updated, **kept)


def _no_grad(x):
    return np.zeros(x.shape, jax.dtypes.float0)
