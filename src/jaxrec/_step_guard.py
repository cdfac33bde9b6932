"""What a train step finds wrong while it runs, without losing the model to it.

A train step donates the model's buffers, so an error raised while its computation runs
(a FATAL bounds check, as ``jax.debug.callback`` raises it outside a step) would leave the
caller with deleted arrays. Inside a step, the checks therefore *report* instead of
raising, and the step decides:

* ``report_fatal(report, message)``: a FATAL bounds check found bad ids (the ids were
  corrected as under WARNING, so no memory outside a table is touched);
* ``report_corrected(count)``: a WARNING bounds check corrected ``count`` bags and ids;
* ``table_gate(name, grad_output)``: a fused backward asks whether to apply its update.

The step (``jaxrec.fused.make_functional_train_step`` and ``jaxrec.nn.make_train_step``,
unsharded or sharded) applies an update only where it is sound: no FATAL
report, and, unless ``on_nonfinite="ignore"``, a finite loss, finite dense gradients and
finite cotangents into every fused table. Otherwise it updates nothing — tables, optimizer
slots, dense parameters and optax state keep their values — and returns, with its
outputs, a ``StepStats``. ``StepMonitor`` reads it on the host one step late (the host
never waits for the step it just issued) and raises there, with the model intact.

One gap, documented in docs/reliability.md: a fused table's update runs inside the
backward, before the dense gradients below it exist. Its gate covers the loss (the
backward is seeded with NaN when the loss is not finite, which reaches every fused
table) and the table's own cotangent, but not a dense gradient that alone is non-finite
with a finite loss; such a step skips the dense update and is reported all the same.

The collectors hold tracers of the step's own trace: a fused lookup or bounds check under
``jax.checkpoint``/``lax.scan`` inside the loss would leak them, and JAX says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

POLICIES = ("raise", "skip", "ignore")


class NonFiniteError(FloatingPointError):
    """A train step met a non-finite loss or gradient; its update was skipped.

    ``step`` is the 0-based index of that step among the calls of its train step.
    """

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def check_policy(on_nonfinite: str) -> str:
    if on_nonfinite not in POLICIES:
        raise ValueError(f"on_nonfinite must be one of {POLICIES}, got {on_nonfinite!r}")
    return on_nonfinite


@dataclasses.dataclass
class _Trace:
    """What one step's trace has gathered so far."""

    policy: str
    axis_name: str | None
    fatal: list = dataclasses.field(default_factory=list)       # (report, message)
    corrected: list = dataclasses.field(default_factory=list)   # int32 scalars
    gates: dict = dataclasses.field(default_factory=dict)       # tables name -> bool

    def any_fatal(self) -> jax.Array:
        bad = jnp.zeros((), bool)
        for report, _ in self.fatal:
            bad = bad | (report[0] != 0)
        return bad


_local = threading.local()


@contextlib.contextmanager
def tracing(policy: str, axis_name: str | None = None):
    """Collect the reports of the step traced inside the block (see the module doc).

    ``axis_name``: inside ``shard_map``, the mesh axis over which every device must agree
    to skip (a table sharded over devices is updated on all of them or none).
    """
    stack = _local.__dict__.setdefault("stack", [])
    trace = _Trace(check_policy(policy), axis_name)
    stack.append(trace)
    try:
        yield trace
    finally:
        stack.pop()


def active() -> _Trace | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def report_fatal(report: jax.Array, message: Callable[..., str]) -> None:
    """The error is ``message(*report)`` when ``report[0] != 0`` (an integer vector).

    Inside a step it is recorded (the step skips its update, the host raises after);
    elsewhere it is raised when the computation runs, as a ``JaxRuntimeError``.
    """
    trace = active()
    if trace is None:
        jax.debug.callback(functools.partial(_raise_if_bad, message), report)
    else:
        trace.fatal.append((jnp.asarray(report), message))


def _raise_if_bad(message, report) -> None:
    text = _fatal_text(message, report)
    if text is not None:
        raise ValueError(text)


def _fatal_text(message, report) -> str | None:
    """``message(*report)`` for a report that found something, else None."""
    report = np.asarray(report)
    return message(*(int(x) for x in report)) if report[0] else None


def report_corrected(count: jax.Array) -> None:
    """Counts ids and bags a WARNING bounds check corrected (into the step's stats)."""
    trace = active()
    if trace is not None:
        trace.corrected.append(jnp.asarray(count, jnp.int32))


def table_gate(name: str, grad_output: jax.Array) -> jax.Array | None:
    """Whether the fused backward of tables ``name`` applies its update: ``None`` outside a
    step that checks anything (always apply), else a bool scalar."""
    trace = active()
    if trace is None or (trace.policy == "ignore" and not trace.fatal):
        return None
    ok = ~trace.any_fatal()
    if trace.policy != "ignore":
        ok = ok & jnp.all(jnp.isfinite(grad_output))
    ok = _everywhere(ok, trace.axis_name)
    trace.gates[name] = ok
    return ok


def _everywhere(ok: jax.Array, axis_name: str | None) -> jax.Array:
    if axis_name is None:
        return ok
    return jax.lax.pmin(ok.astype(jnp.int32), axis_name) > 0


def seed(trace: _Trace | None, loss: jax.Array) -> jax.Array:
    """The cotangent that starts the backward: NaN when the loss is not finite, so that
    every fused table's gate sees it."""
    one = jnp.ones_like(loss)
    if trace is None or trace.policy == "ignore":
        return one
    return jnp.where(jnp.isfinite(loss), one, jnp.full_like(loss, jnp.nan))


class StepStats(NamedTuple):
    """One step's findings (device arrays)."""

    applied: jax.Array
    """bool: the update was applied."""
    nonfinite: jax.Array
    """bool: the loss or a gradient was not finite (never set under "ignore")."""
    corrected: jax.Array
    """int32: bags and ids corrected by WARNING bounds checks."""
    fatal: tuple
    """int32 vectors: the FATAL bounds reports, in the order of ``StepMonitor``'s messages."""


def finish(trace: _Trace, loss: jax.Array, dense_grads, new, old):
    """``(state, stats)``: ``new`` (the updated dense parameters and optax state) where
    the step is sound, else ``old``; ``stats`` says what was found."""
    bad_input = trace.any_fatal()
    nonfinite = jnp.zeros((), bool)
    if trace.policy != "ignore":
        finite = jnp.all(jnp.isfinite(loss))
        for g in jax.tree.leaves(dense_grads):
            if jnp.issubdtype(g.dtype, jnp.inexact):
                finite = finite & jnp.all(jnp.isfinite(g))
        for gate in trace.gates.values():
            finite = finite & gate
        nonfinite = ~_everywhere(finite, trace.axis_name)
    applied = ~(bad_input | nonfinite)
    if trace.policy != "ignore" or trace.fatal:
        new = jax.tree.map(lambda n, o: jnp.where(applied, n, o), new, old)
    corrected = sum(trace.corrected, jnp.zeros((), jnp.int32))
    if trace.axis_name is not None:
        corrected = jax.lax.psum(corrected, trace.axis_name)
    return new, StepStats(applied, nonfinite, corrected, tuple(r for r, _ in trace.fatal))


class StepMonitor:
    """The host side: keeps the last step's ``StepStats`` and running totals, and raises
    what a step found one call later (or at ``check()``), when the model is intact."""

    def __init__(self, policy: str):
        self.policy = check_policy(policy)
        self.steps = 0
        self._pending = None
        self._totals: list = []

    def record(self, stats: StepStats, messages: list) -> None:
        """After issuing step ``self.steps``: raises what the previous step found."""
        previous, self._pending = self._pending, (self.steps, stats, messages)
        self._totals.append((stats.nonfinite, stats.corrected))
        if len(self._totals) > 64:  # fold the older ones: they are done, nothing waits
            self._fold(keep=2)
        self.steps += 1
        if previous is not None:
            self._raise(previous)

    def check(self) -> None:
        """Raises what the last step found, if anything (waits for it)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._raise(pending)

    def stats(self) -> dict:
        """Host ints: ``steps``, ``nonfinite_steps`` and ``ids_corrected`` so far."""
        self._fold()
        nonfinite, corrected = self._totals[0] if self._totals else (0, 0)
        return {"steps": self.steps, "nonfinite_steps": int(nonfinite),
                "ids_corrected": int(corrected)}

    def _fold(self, keep: int = 0) -> None:
        cut = len(self._totals) - keep
        old = jax.device_get(self._totals[:cut])
        folded = (sum(int(n) for n, _ in old), sum(int(c) for _, c in old))
        self._totals = [folded] + self._totals[cut:]

    def _raise(self, pending) -> None:
        step, stats, messages = pending
        if not messages and self.policy != "raise":
            return  # nothing to raise: skip is counted, ignore is ignored
        if bool(stats.applied):
            return
        for report, message in zip(stats.fatal, messages):
            text = _fatal_text(message, report)
            if text is not None:
                raise ValueError(f"train step {step}: {text} The step's update was skipped: "
                                 "the model and optimizer hold their state from before it.")
        if bool(stats.nonfinite) and self.policy == "raise":
            raise NonFiniteError(
                f"train step {step}: the loss or a gradient is not finite (NaN or Inf); its "
                "update was skipped, so the model and optimizer hold finite state (a later "
                "step issued before this check ran only if it was finite). Lower the "
                "learning rates, check the inputs (NaN features or per-sample weights), or "
                "pass on_nonfinite='skip' to skip such steps and count them.", step)
