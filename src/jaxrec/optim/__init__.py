"""Fused optimizers of FBGEMM's set: configs, state and their row-wise math in jnp.

The optimizer is applied row-wise inside the TBE backward ("fused"), to the unique
rows of a batch only, as FBGEMM's ``EXACT_*`` optimizers do. This package holds
the configs (:class:`SGD`, :class:`RowWiseAdagrad`, ...), their state
(:func:`init_state`, flat buffers laid out like the weights), the math written once
(:func:`update_rows`) and the jnp reference of the fused update
(:func:`fused_update_reference`), which the kernels are tested against.

The fused update itself is :func:`fused_update` (the explicit form). Its
``custom_vjp`` form is :func:`fused_lookup` over :class:`FusedEmbeddingTables`,
trained by :func:`make_train_step` (optax on the dense parameters, the fused update
on the tables, one jitted step with everything donated).
"""

from jaxrec._step_guard import NonFiniteError, StepStats
from jaxrec.optim._configs import (
    ALL_OPTIMIZERS,
    LAMB,
    SGD,
    Adagrad,
    Adam,
    LarsSGD,
    NoOptimizer,
    OptimizerConfig,
    OptimizerHyperparams,
    PartialRowWiseAdam,
    PartialRowWiseLAMB,
    RowWiseAdagrad,
    set_learning_rate,
)
from jaxrec.optim._fused import fused_update_reference
from jaxrec.optim._rowwise import update_rows
from jaxrec.optim._state import (
    AdagradState,
    AdamState,
    LAMBState,
    LarsSGDState,
    NoOptimizerState,
    PartialRowWiseAdamState,
    PartialRowWiseLAMBState,
    RowWiseAdagradState,
    SGDState,
    init_state,
    merge_optimizer_states,
    row_offsets,
    split_optimizer_states,
    state_offsets,
)
from jaxrec.optim.fused_tables import FusedEmbeddingTables, fused_lookup
from jaxrec.optim.fused_update import fused_update
from jaxrec.optim.partitioned import TrainStep, fused_value_and_grad, guarded_update, make_train_step
from jaxrec.optim.tt_tables import TTCacheState, TTEmbeddingTables, tt_fused_lookup

__all__ = [
    "ALL_OPTIMIZERS",
    "LAMB",
    "SGD",
    "Adagrad",
    "AdagradState",
    "Adam",
    "AdamState",
    "FusedEmbeddingTables",
    "LAMBState",
    "LarsSGD",
    "LarsSGDState",
    "NoOptimizer",
    "NoOptimizerState",
    "OptimizerConfig",
    "OptimizerHyperparams",
    "PartialRowWiseAdam",
    "PartialRowWiseAdamState",
    "PartialRowWiseLAMB",
    "PartialRowWiseLAMBState",
    "RowWiseAdagrad",
    "RowWiseAdagradState",
    "SGDState",
    "TTCacheState",
    "TTEmbeddingTables",
    "fused_lookup",
    "fused_update",
    "fused_update_reference",
    "fused_value_and_grad",
    "init_state",
    "make_train_step",
    "NonFiniteError",
    "StepStats",
    "TrainStep",
    "guarded_update",
    "tt_fused_lookup",
    "row_offsets",
    "set_learning_rate",
    "merge_optimizer_states",
    "split_optimizer_states",
    "state_offsets",
    "update_rows",
]
