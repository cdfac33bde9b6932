"""Training an NNX model whose tables may be fused: ``PartitionedOptimizer`` + ``make_train_step``.

::

    model = DLRM(ebc, ..., rngs=nnx.Rngs(0))        # ebc built with optimizer=RowWiseAdagrad(...)
    optimizer = PartitionedOptimizer(model, optax.adam(1e-3))

    def loss_fn(model, batch):
        logits = model(batch.dense, batch.sparse)
        return bce(logits, batch.labels, batch.mask)

    train_step = make_train_step(loss_fn)
    loss = train_step(model, optimizer, batch)       # model and optimizer updated in place

The step splits the model into its ``nnx.Param`` s (trained by the optax optimizer), its
``FusedTables`` (trained by their fused optimizer inside the backward) and the rest (e.g.
RNG counters, carried through), and runs ``jaxrec.optim.make_train_step`` on them: one
jitted function that donates parameters, optax state and tables, so every table and slot
is updated in the buffer it already occupies. A model with plain tables (``nnx.Param``)
goes through the same step: optax then trains its tables too, from dense gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrec import optim
from jaxrec.nn._tables import FusedTables


class PartitionedOptimizer:
    """The optax optimizer of a model's ``nnx.Param`` s; ``FusedTables`` train themselves.

    ``opt_state`` is optax's state (a pytree: checkpoint it with the model's state) and
    ``step`` the number of steps taken.
    """

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation):
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(f"tx must be an optax.GradientTransformation (e.g. optax.adam(1e-3)), "
                            f"got {tx!r}")
        self.tx = tx
        self.opt_state = tx.init(nnx.state(model, nnx.Param))
        self.step = 0


def split_for_training(model: nnx.Module):
    """``(graphdef, params, fused tables, rest)`` of ``model``."""
    return nnx.split(model, nnx.Param, FusedTables, ...)


def write_back(model: nnx.Module, before: tuple, after: tuple) -> None:
    """``nnx.update(model, *after)``, where ``before`` are the states that ``nnx.split`` gave
    for ``model`` and ``after`` the step's new ones, of the same structure.

    Where flax's split states hold the model's own Variables, each is set directly: a
    second walk of the model's graph (``nnx.update``) took about a fifth of the host's
    time to issue a DLRM step."""
    def variables(states):
        return jax.tree.leaves(states, is_leaf=lambda x: isinstance(x, nnx.Variable))

    old, new = variables(before), variables(after)
    if not _split_shares_variables() or len(old) != len(new):
        nnx.update(model, *after)
        return
    for var, value in zip(old, new):
        var.set_value(value.get_value() if isinstance(value, nnx.Variable) else value)


@functools.cache
def _split_shares_variables() -> bool:
    """Whether ``nnx.split`` 's states hold the model's own Variables (flax 0.12 does)."""
    class Probe(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(()))

    probe = Probe()
    return nnx.split(probe)[1]["w"] is probe.w


def make_train_step(loss_fn, *, has_aux: bool = False, donate: bool = True):
    """``train_step(model, optimizer, *batch) -> loss`` (``(loss, aux)`` with ``has_aux``).

    ``loss_fn(model, *batch)`` returns the scalar loss (and ``aux``). The step updates
    ``model`` and ``optimizer`` (a ``PartitionedOptimizer``) in place. With ``donate`` (the
    default) the arrays of the model's state before the step are invalid afterwards; read
    them again from the model.
    """

    @functools.cache
    def compiled(graphdef, tx):
        def pure_loss(params, tables, rest, *batch):
            model = nnx.merge(graphdef, params, tables, rest)
            out = loss_fn(model, *batch)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, split_for_training(model)[3])

        return optim.make_train_step(pure_loss, tx, has_aux=True, donate=donate)

    def train_step(model: nnx.Module, optimizer: PartitionedOptimizer, *batch):
        if not isinstance(optimizer, PartitionedOptimizer):
            raise TypeError(f"optimizer must be a jaxrec.nn.PartitionedOptimizer, got "
                            f"{type(optimizer).__name__}")
        graphdef, *states = split_for_training(model)
        params, tables, rest = states
        step = compiled(graphdef, optimizer.tx)
        params, optimizer.opt_state, tables, (loss, (aux, rest)) = step(
            params, optimizer.opt_state, tables, rest, *batch)
        write_back(model, states, (params, tables, rest))
        optimizer.step += 1
        return (loss, aux) if has_aux else loss

    return train_step
