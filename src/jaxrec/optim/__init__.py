"""Fused optimizers of FBGEMM's set: their configs, their state and their row-wise math.

Like optax, this package holds only optimizers: the configs (:class:`SGD`,
:class:`RowWiseAdagrad`, ...; ``learning_rate`` a number or an optax schedule), their
state (:func:`init_state`: flat buffers laid out like the weights, with
:func:`split_optimizer_states` / :func:`merge_optimizer_states` to read and write them per
table) and their math, written once in jnp (:func:`update_rows`). The kernels that apply
it inside the backward, and the tables and train steps built on them, are
``jaxrec.fused``.
"""

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
)
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
    split_optimizer_states,
)

__all__ = [
    "ALL_OPTIMIZERS",
    "LAMB",
    "SGD",
    "Adagrad",
    "AdagradState",
    "Adam",
    "AdamState",
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
    "init_state",
    "merge_optimizer_states",
    "split_optimizer_states",
    "update_rows",
]
