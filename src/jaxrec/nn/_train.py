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
import optax
from flax import nnx

from jaxrec import _step_guard, optim
from jaxrec.nn._split_cache import (
    SplitCache,
    raw_values,
    split_for_training,
    write_back,
)


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

    # A step that works on flat leaves (jaxrec.parallel's) keeps the state flat; the pytree
    # is rebuilt only when read: rebuilding it each step cost host time.
    @property
    def opt_state(self):
        if self._opt_state is None:
            self._opt_state = jax.tree.unflatten(*self._flat)
        return self._opt_state

    @opt_state.setter
    def opt_state(self, value):
        self._opt_state, self._flat = value, None

    def flat_opt_state(self) -> tuple:
        """``(treedef, leaves)`` of ``opt_state``."""
        if self._flat is None:
            leaves, treedef = jax.tree.flatten(self._opt_state)
            self._flat = (treedef, leaves)
        return self._flat

    def set_flat_opt_state(self, treedef, leaves: list) -> None:
        self._opt_state, self._flat = None, (treedef, leaves)


class TrainStep:
    """``train_step(model, optimizer, *batch) -> loss``, built by ``make_train_step``.

    ``check()`` raises what the last step found (each step is checked one call later, so
    the host never waits for the device: a ``NonFiniteError`` or a FATAL bounds-check
    ``ValueError``, the step's update skipped). ``stats()``: host ints ``steps``,
    ``nonfinite_steps`` and ``ids_corrected`` (WARNING bounds checks) so far.
    """

    def __init__(self, loss_fn, *, has_aux: bool, donate: bool, on_nonfinite: str):
        self._loss_fn, self._has_aux, self._donate = loss_fn, has_aux, donate
        self._policy = on_nonfinite
        self._monitor = _step_guard.StepMonitor(on_nonfinite)
        self._splits = SplitCache()
        self._compiled = functools.cache(self._compile)

    def _compile(self, graphdef, tx):
        loss_fn, has_aux = self._loss_fn, self._has_aux

        def pure_loss(params, tables, rest, *batch):
            model = nnx.merge(graphdef, params, tables, rest)
            out = loss_fn(model, *batch)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, split_for_training(model)[3])

        messages: list = []
        step = optim.guarded_update(pure_loss, tx, has_aux=True, on_nonfinite=self._policy,
                                    messages=messages)
        return jax.jit(step, donate_argnums=(0, 1, 2) if self._donate else ()), messages

    def __call__(self, model: nnx.Module, optimizer: PartitionedOptimizer, *batch):
        if not isinstance(optimizer, PartitionedOptimizer):
            raise TypeError(f"optimizer must be a jaxrec.nn.PartitionedOptimizer, got "
                            f"{type(optimizer).__name__}")
        split = self._splits.split(model)
        compiled = split.derived.get(optimizer.tx)
        if compiled is None:  # _compiled hashes the graphdef: once per split, not per step
            compiled = split.derived[optimizer.tx] = self._compiled(split.graphdef, optimizer.tx)
        step, messages = compiled
        params, tables, rest = split.states
        params, optimizer.opt_state, tables, (loss, (aux, rest)), stats = step(
            params, optimizer.opt_state, tables, rest, *batch)
        write_back(split, [raw_values(s) for s in (params, tables, rest)])
        optimizer.step += 1
        self._monitor.record(stats, messages)
        return (loss, aux) if self._has_aux else loss

    def check(self) -> None:
        self._monitor.check()

    def stats(self) -> dict:
        return self._monitor.stats()


def make_train_step(loss_fn, *, has_aux: bool = False, donate: bool = True,
                    on_nonfinite: str = "raise") -> TrainStep:
    """``train_step(model, optimizer, *batch) -> loss`` (``(loss, aux)`` with ``has_aux``).

    ``loss_fn(model, *batch)`` returns the scalar loss (and ``aux``). The step updates
    ``model`` and ``optimizer`` (a ``PartitionedOptimizer``) in place. With ``donate`` (the
    default) the arrays of the model's state before the step are invalid afterwards; read
    them again from the model. The model's split is kept between steps while its structure
    stays the same (``jaxrec.nn._split_cache``).

    ``on_nonfinite``: ``"raise"`` (default) and ``"skip"`` leave everything as it was when
    a step's loss or gradients are not finite; ``"raise"`` then raises ``NonFiniteError``
    at the next call or ``train_step.check()``, ``"skip"`` counts it
    (``train_step.stats()``). ``"ignore"`` applies every step unchecked. A FATAL bounds
    check never updates anything and raises the same way (see ``TrainStep``).
    """
    _step_guard.check_policy(on_nonfinite)
    return TrainStep(loss_fn, has_aux=has_aux, donate=donate, on_nonfinite=on_nonfinite)
