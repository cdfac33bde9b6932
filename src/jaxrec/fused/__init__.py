"""Tables whose optimizer runs inside the backward, as FBGEMM's TBE does ("fused").

The optimizer (``jaxrec.optim``: configs and their row-wise math) is applied to the rows a
batch touched, in place, inside the lookup's backward. This package holds:

- :func:`fused_update`: the explicit form, the TBE backward with the optimizer fused in
  (and :func:`fused_update_reference`, its jnp oracle).
- :class:`FusedEmbeddingTables` + :func:`fused_lookup`: its ``custom_vjp`` form, tables as a
  pytree whose backward hands back the *updated* tables; :class:`TTEmbeddingTables` +
  :func:`tt_fused_lookup`: the same for tensor-train tables.
- :func:`fused_value_and_grad` and :func:`make_functional_train_step`: differentiate and
  train such pytrees (optax on the dense parameters, one jitted donating step);
  :func:`guarded_update` is the pure step they jit. Flax NNX models train with
  ``jaxrec.nn.make_train_step`` instead.
- :func:`set_learning_rate`: a new rate for every fused table of a pytree, without
  recompiling (a config's ``learning_rate`` may also be an optax schedule).
"""

from jaxrec.fused._reference import fused_update_reference
from jaxrec.fused._tables import FusedEmbeddingTables, fused_lookup
from jaxrec.fused._train_step import (
    FunctionalTrainStep,
    fused_value_and_grad,
    guarded_update,
    make_functional_train_step,
    set_learning_rate,
)
from jaxrec.fused._tt_tables import TTEmbeddingTables, tt_fused_lookup
from jaxrec.fused._update import fused_update

__all__ = [
    "FunctionalTrainStep",
    "FusedEmbeddingTables",
    "TTEmbeddingTables",
    "fused_lookup",
    "fused_update",
    "fused_update_reference",
    "fused_value_and_grad",
    "guarded_update",
    "make_functional_train_step",
    "set_learning_rate",
    "tt_fused_lookup",
]
