"""The functional train step: optax on the dense parameters, the fused update on the tables.

One jitted step trains a whole model held as pytrees (Flax NNX models: ``jaxrec.nn.make_train_step``)::

    tables = FusedEmbeddingTables.create(layout, RowWiseAdagrad(learning_rate=0.05), key=key)
    dense = optax.adam(1e-3)

    def loss_fn(params, tables, batch):
        acts = fused_lookup(tables, batch.indices, batch.offsets)
        return bce(mlp(params, acts), batch.labels)

    step = make_functional_train_step(loss_fn, dense)
    opt_state = dense.init(params)
    params, opt_state, tables, loss = step(params, opt_state, tables, batch)

``make_functional_train_step`` donates ``params``, ``opt_state`` and ``tables``: the fused kernel
then updates the tables and their optimizer state in the buffers they already occupy.
Without donation (``donate=False``) XLA keeps the old buffers alive and copies every
table and state buffer each step — O(table) instead of O(batch); see docs/fused.md for
the measured cost. After the step, the arrays passed in are invalid (donated); use
the returned ones.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import jax
import optax

from jaxrec import _step_guard
from jaxrec.fused._tables import FusedEmbeddingTables, record_updates
from jaxrec.fused._tt_tables import TTEmbeddingTables
from jaxrec.optim._configs import set_tables_learning_rate

FUSED_TYPES = (FusedEmbeddingTables, TTEmbeddingTables)
"""Pytrees whose lookup's backward returns their updated selves (``after_fused_update``)."""


def _is_tables(x) -> bool:
    return isinstance(x, FUSED_TYPES)


def set_learning_rate(tables, learning_rate):
    """``tables`` (fused tables, or any pytree holding them) with every fused optimizer's
    learning rate set to ``learning_rate``: a float or a traced scalar, so no recompile.
    Refused for tables whose config's rate is a schedule (it would be overridden)."""
    def one(x):
        if not _is_tables(x):
            return x
        return dataclasses.replace(x, hparams=set_tables_learning_rate(x.config, x.hparams,
                                                                       learning_rate, x.name))
    return jax.tree.map(one, tables, is_leaf=_is_tables)


def fused_value_and_grad(loss_fn, *, has_aux: bool = False):
    """``jax.value_and_grad`` for losses that use ``fused_lookup``.

    ``loss_fn(params, tables, *args)`` where ``tables`` is a pytree holding
    ``FusedEmbeddingTables`` and ``TTEmbeddingTables``. Returns a function giving ``(value, dense_grads, tables)``:
    ``value`` as ``jax.value_and_grad`` gives it (``(loss, aux)`` with ``has_aux``), the
    gradient of ``params``, and the tables after their fused update. Tables whose
    lookup did not reach the loss come back unchanged (step not advanced); a tables
    object looked up more than once raises ``ValueError``. Inside a train step's guard
    (``jaxrec._step_guard``) a table whose update was gated off also comes back unchanged.
    """

    def value_and_grad(params, tables, *args, **kwargs):
        fused = jax.tree.leaves(tables, is_leaf=_is_tables)
        fused = [t for t in fused if _is_tables(t)]
        names = Counter(t.name for t in fused)
        clashes = sorted(n for n, c in names.items() if c > 1)
        if clashes:
            raise ValueError(f"fused tables names must be unique within a loss; {clashes} "
                             "name several. Give each a distinct name= in its create()")
        guard = _step_guard.active()
        with record_updates() as updates:
            # jax.vjp rather than jax.value_and_grad: the backward's seed is ours to choose.
            loss, vjp_fn, *aux = jax.vjp(lambda p, t: loss_fn(p, t, *args, **kwargs), params,
                                         tables, has_aux=has_aux)
            dense_grads, table_grads = vjp_fn(_step_guard.seed(guard, loss))
        value = (loss, *aux) if has_aux else loss
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
        gates = guard.gates if guard is not None else {}

        def take(old, new):
            if not _is_tables(old) or updates.get(old.name, 0) == 0:
                return old  # not looked up, or its output did not reach the loss
            return old.after_fused_update(new, applied=gates.get(old.name))

        new_tables = jax.tree.map(take, tables, table_grads, is_leaf=_is_tables)
        return value, dense_grads, new_tables

    return value_and_grad


class FunctionalTrainStep:
    """``step(params, opt_state, tables, *batch) -> (params, opt_state, tables, value)``.

    Built by ``make_functional_train_step``. Beside the call: ``check()`` waits for the
    issued steps and raises what they found (a call raises it too once the device has
    finished the bad step, read every 16 calls: the host never waits for the device),
    and ``stats()`` returns ``{"steps", "nonfinite_steps", "ids_corrected", "nonfinite_rows"}``
    as host ints.
    """

    def __init__(self, jitted, messages: list, monitor: _step_guard.StepMonitor):
        self._jitted, self._messages, self._monitor = jitted, messages, monitor

    def __call__(self, params, opt_state, tables, *batch):
        self._monitor.poll()
        like = next(iter(jax.tree.leaves(params)), None)
        params, opt_state, tables, value, fatal, latch = self._jitted(
            params, opt_state, tables, self._monitor.latch(like), *batch)
        self._monitor.issued(fatal, latch, self._messages)
        return params, opt_state, tables, value

    def lower(self, params, opt_state, tables, *batch):
        """The jitted step's ``lower`` (to inspect its HLO)."""
        return self._jitted.lower(params, opt_state, tables, self._monitor.latch(), *batch)

    def _cache_size(self) -> int:
        """Compilations so far (the jitted step's)."""
        return self._jitted._cache_size()

    def check(self) -> None:
        self._monitor.check()

    def stats(self) -> dict:
        return self._monitor.stats()


def guarded_update(loss_fn, dense_optimizer: optax.GradientTransformation, *, has_aux: bool,
                   on_nonfinite: str, messages: list, axis_name: str | None = None,
                   reduce_grads=None):
    """The pure step ``(params, opt_state, tables, latch, *batch) -> (params, opt_state,
    tables, value, fatal, latch)`` that ``make_functional_train_step`` jits
    (``jaxrec.nn.make_train_step`` builds its step on it too); ``latch`` is the one of
    ``_step_guard.StepMonitor``. ``messages`` receives the FATAL messages of
    the last trace, in the order of the ``fatal`` reports. ``reduce_grads(grads)``: e.g. a
    ``psum`` over devices, applied before optax."""
    value_and_grad = fused_value_and_grad(loss_fn, has_aux=has_aux)

    def step(params, opt_state, tables, latch, *batch):
        with _step_guard.tracing(on_nonfinite, latch, axis_name) as guard:
            value, grads, tables = value_and_grad(params, tables, *batch)
            if reduce_grads is not None:
                grads = reduce_grads(grads)
            with jax.numpy_dtype_promotion("standard"):  # optax mixes int steps and floats
                updates, new_opt_state = dense_optimizer.update(grads, opt_state, params)
            new = (optax.apply_updates(params, updates), new_opt_state)
            loss = value[0] if has_aux else value
            (params, opt_state), fatal, latch = _step_guard.finish(guard, loss, grads, new,
                                                                   (params, opt_state))
            messages[:] = [message for _, message in guard.fatal]
        return params, opt_state, tables, value, fatal, latch

    return step


def make_functional_train_step(loss_fn, dense_optimizer: optax.GradientTransformation, *,
                               has_aux: bool = False, donate: bool = True,
                               on_nonfinite: str = "raise") -> FunctionalTrainStep:
    """A jitted ``step(params, opt_state, tables, *batch) -> (params, opt_state, tables, value)``.

    ``params`` are trained by ``dense_optimizer`` (optax), ``tables`` by their fused
    optimizers; ``value`` is the loss (``(loss, aux)`` with ``has_aux``). With ``donate``
    (the default, and what you want) the step updates everything in place.

    ``on_nonfinite``: a step whose loss or gradients are not finite updates nothing under
    ``"raise"`` (the default; a later call, or ``step.check()``, raises
    ``NonFiniteError``, and the steps issued in between update nothing either) and
    ``"skip"`` (counted in ``step.stats()``); ``"ignore"`` applies it (no checks, as
    before). A FATAL bounds check inside the loss never updates anything either and
    raises its ``ValueError`` the same way: the donated model stays usable.
    """
    _step_guard.check_policy(on_nonfinite)
    messages: list = []
    step = guarded_update(loss_fn, dense_optimizer, has_aux=has_aux, on_nonfinite=on_nonfinite,
                          messages=messages)
    # the latch (3) always: see _step_guard.StepMonitor
    jitted = jax.jit(step, donate_argnums=(0, 1, 2, 3) if donate else (3,))
    return FunctionalTrainStep(jitted, messages, _step_guard.StepMonitor())
