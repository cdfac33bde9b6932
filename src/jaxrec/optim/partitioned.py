"""The partitioned optimizer: optax on the dense parameters, the fused update on the tables.

One jitted step trains a whole model::

    tables = FusedEmbeddingTables.create(layout, RowWiseAdagrad(learning_rate=0.05), key=key)
    dense = optax.adam(1e-3)

    def loss_fn(params, tables, batch):
        acts = fused_lookup(tables, batch.indices, batch.offsets)
        return bce(mlp(params, acts), batch.labels)

    step = make_train_step(loss_fn, dense)
    opt_state = dense.init(params)
    params, opt_state, tables, loss = step(params, opt_state, tables, batch)

``make_train_step`` donates ``params``, ``opt_state`` and ``tables``: the fused kernel
then updates the tables and their optimizer state in the buffers they already occupy.
Without donation (``donate=False``) XLA keeps the old buffers alive and copies every
table and state buffer each step — O(table) instead of O(batch); see docs/fused.md for
the measured cost. After the step, the arrays passed in are invalid (donated); use
the returned ones.
"""

from __future__ import annotations

from collections import Counter

import jax
import optax

from jaxrec.optim.fused_tables import FusedEmbeddingTables, record_updates
from jaxrec.optim.tt_tables import TTEmbeddingTables

FUSED_TYPES = (FusedEmbeddingTables, TTEmbeddingTables)
"""Pytrees whose lookup's backward returns their updated selves (``after_fused_update``)."""


def _is_tables(x) -> bool:
    return isinstance(x, FUSED_TYPES)


def fused_value_and_grad(loss_fn, *, has_aux: bool = False):
    """``jax.value_and_grad`` for losses that use ``fused_lookup``.

    ``loss_fn(params, tables, *args)`` where ``tables`` is a pytree holding
    ``FusedEmbeddingTables`` and ``TTEmbeddingTables``. Returns a function giving ``(value, dense_grads, tables)``:
    ``value`` as ``jax.value_and_grad`` gives it (``(loss, aux)`` with ``has_aux``), the
    gradient of ``params``, and the tables after their fused update. Tables whose
    lookup did not reach the loss come back unchanged (step not advanced); a tables
    object looked up more than once raises ``ValueError``.
    """

    def value_and_grad(params, tables, *args, **kwargs):
        fused = jax.tree.leaves(tables, is_leaf=_is_tables)
        fused = [t for t in fused if _is_tables(t)]
        names = Counter(t.name for t in fused)
        clashes = sorted(n for n, c in names.items() if c > 1)
        if clashes:
            raise ValueError(f"fused tables names must be unique within a loss; {clashes} "
                             "name several. Give each a distinct name= in its create()")
        grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=has_aux, allow_int=True)
        with record_updates() as updates:
            value, (dense_grads, table_grads) = grad_fn(params, tables, *args, **kwargs)
        repeated = sorted(n for n, c in updates.items() if c > 1)
        if repeated:
            raise ValueError(
                f"tables {repeated} were looked up {[updates[n] for n in repeated]} times in one loss; "
                "their fused updates cannot be combined. Look each table up once: map all its "
                "features onto it in one TableLayout (feature_table_map) and make one fused_lookup call.")
        strangers = sorted(set(updates) - set(names))
        if strangers:
            raise ValueError(f"fused_lookup of tables {strangers} ran inside the loss, but those tables "
                             "were not passed in its tables argument, so their update would be lost")

        def take(old, new):
            if not _is_tables(old) or updates.get(old.name, 0) == 0:
                return old  # not looked up, or its output did not reach the loss
            return old.after_fused_update(new)

        new_tables = jax.tree.map(take, tables, table_grads, is_leaf=_is_tables)
        return value, dense_grads, new_tables

    return value_and_grad


def make_train_step(loss_fn, dense_optimizer: optax.GradientTransformation, *,
                    has_aux: bool = False, donate: bool = True):
    """A jitted ``step(params, opt_state, tables, *batch) -> (params, opt_state, tables, value)``.

    ``params`` are trained by ``dense_optimizer`` (optax), ``tables`` by their fused
    optimizers; ``value`` is the loss (``(loss, aux)`` with ``has_aux``). With ``donate``
    (the default, and what you want) the step updates everything in place.
    """
    value_and_grad = fused_value_and_grad(loss_fn, has_aux=has_aux)

    def step(params, opt_state, tables, *batch):
        value, grads, tables = value_and_grad(params, tables, *batch)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes int steps and floats
            updates, opt_state = dense_optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, tables, value

    return jax.jit(step, donate_argnums=(0, 1, 2) if donate else ())
