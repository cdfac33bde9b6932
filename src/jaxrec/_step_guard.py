"""What a train step finds wrong while it runs, without losing the model to it.

A train step donates the model's buffers, so an error raised while its computation runs
(a FATAL bounds check, as ``jax.debug.callback`` raises it outside a step) would leave the
caller with deleted arrays. Inside a step, the checks therefore *report* instead of
raising, and the step decides:

* ``report_fatal(report, message)``: a FATAL bounds check found bad ids (the ids were
  corrected as under WARNING, so no memory outside a table is touched);
* ``report_corrected(count)``: a WARNING bounds check corrected ``count`` bags and ids;
* ``table_gate(name, grad_output)``: a fused backward asks whether to apply its update;
* ``report_nonfinite_rows(count)``: a fused update kept ``count`` rows whose update would
  not have been finite (the kernels never write such a row: csrc/common/fused_optimizer.h).

The step (``jaxrec.fused.make_functional_train_step`` and ``jaxrec.nn.make_train_step``,
unsharded or sharded) applies an update only where it is sound: no FATAL report, and,
unless ``on_nonfinite="ignore"``, a finite loss, finite dense gradients, finite cotangents
into every fused table, finite new dense parameters and optax state, and no fused table
row whose update overflowed. Otherwise it updates nothing — tables, optimizer slots, dense
parameters and optax state keep their values — with the exceptions below.

The host never waits for the device. Each step takes a small latch from the step before
and returns it updated (``finish``): once a step must raise, the latch makes every later
step update nothing, so that the error finds the model exactly as it was before the bad
step however many steps the host issued in between; the latch also counts non-finite
steps, corrected ids and kept rows. The steps donate the latch, so that it keeps one
buffer (see ``StepMonitor``). ``StepMonitor`` copies every 16th step's latch, starts
copying that to the host and reads it once the device has finished that step
(``is_ready``), before issuing another, or at ``check()``, which waits for the newest
step; it raises for the step that halted, and re-arms the latch.

The exceptions, documented in docs/reliability.md, come from a fused table's update
running inside the backward, in place, before the rest of the step exists. Its gate
covers the loss, any FATAL report and an earlier halt (``seed``: on a mesh, agreed by
every device before the backward) and the table's own cotangent, but (1) not a dense
gradient that alone is non-finite with a finite loss (such a step skips the dense update
and is reported all the same, but its table rows were updated; on a mesh, likewise a
shard's cotangent: the shards whose cotangents are finite apply), and (2) not an overflow in the
rows it writes, which only the kernel sees, row by row: a row whose update would not be
finite keeps its values and is counted, the step is reported as non-finite, but the
table's other rows of that step were updated. So no update ever writes a non-finite
value into a table. A TT table's update is kept or dropped whole.

The collectors hold tracers of the step's own trace: a fused lookup or bounds check under
``jax.checkpoint``/``lax.scan`` inside the loss would leak them, and JAX says so.
"""

from __future__ import annotations

import collections
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
    latch: jax.Array  # the latch the step took (``StepMonitor.latch``)
    fatal: list = dataclasses.field(default_factory=list)       # (report, message)
    corrected: list = dataclasses.field(default_factory=list)   # int32 scalars
    kept_rows: list = dataclasses.field(default_factory=list)   # int32 scalars
    gates: dict = dataclasses.field(default_factory=dict)       # tables name -> bool
    skip: jax.Array | None = None  # the verdict before the backward (``seed``)

    @property
    def checks(self) -> bool:
        """Whether the step can skip an update (its fused tables are gated, its dense update
        selected): it checks finiteness, or a FATAL bounds check reported into it."""
        return self.policy != "ignore" or bool(self.fatal)

    @property
    def halted(self) -> jax.Array:
        """An earlier step must raise: this one updates nothing."""
        return self.latch[_HALTED] != 0

    def any_fatal(self) -> jax.Array:
        bad = jnp.zeros((), bool)
        for report, _ in self.fatal:
            bad = bad | (report[0] != 0)
        return bad


_local = threading.local()


@contextlib.contextmanager
def tracing(policy: str, latch: jax.Array, axis_name: str | None = None):
    """Collect the reports of the step traced inside the block (see the module doc).

    ``latch``: what the step takes from the one before (``StepMonitor.latch()``); once
    halted, the step updates nothing. ``axis_name``: inside ``shard_map``, the mesh axis over
    which the devices agree on the step's verdict (``seed``, ``finish``).
    """
    stack = _local.__dict__.setdefault("stack", [])
    trace = _Trace(check_policy(policy), axis_name, jnp.asarray(latch, jnp.int32))
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


def report_nonfinite_rows(count: jax.Array) -> None:
    """Counts rows a fused update kept because their update would not stay finite; inside
    a step that checks (not "ignore"), the step is then non-finite."""
    trace = active()
    if trace is not None:
        trace.kept_rows.append(jnp.asarray(count, jnp.int32))


def table_gate(name: str, grad_output: jax.Array) -> jax.Array | None:
    """Whether the fused backward of tables ``name`` applies its update: ``None`` outside a
    step that checks anything (always apply), else a bool scalar: the step's verdict from
    before the backward (``seed``) and, unless ``on_nonfinite="ignore"``, the finiteness of
    this table's own cotangent (on a mesh, of this device's shard: no collective)."""
    trace = active()
    if trace is None or not trace.checks:
        return None
    if trace.skip is None:
        raise RuntimeError(f"the fused backward of tables {name!r} ran inside a train step before "
                           "the step's own backward: differentiate a loss with fused lookups only "
                           "through the train step (or jaxrec.fused.fused_value_and_grad)")
    ok = ~trace.skip
    if trace.policy != "ignore":
        ok = ok & jnp.all(jnp.isfinite(grad_output))
    trace.gates[name] = ok
    return ok


def seed(trace: _Trace | None, loss: jax.Array) -> jax.Array:
    """The cotangent that starts the backward: NaN when the loss is not finite, so that
    every gradient shows it. Sets ``trace.skip``, the verdict the fused tables' gates start
    from: an earlier step halted, a FATAL report, or (unless "ignore") a non-finite loss.

    On a mesh the verdict and the seed are agreed by one all-reduce of two ints before the
    backward, so that every device's shards see the same verdict whatever layout carries
    the cotangents (the row return's only reach the owners that a device asked). It
    replaced a ``pmin`` of each table's gate inside the backward, which cost the 2-GPU
    DLRM step about 6% of its host time and 2% of its device time (docs/parallel.md,
    "Host time of a step")."""
    one = jnp.ones_like(loss)
    if trace is None or not trace.checks:
        return one  # no gate is asked (table_gate)
    bad_loss = ~jnp.isfinite(loss) if trace.policy != "ignore" else jnp.zeros((), bool)
    fatal = trace.any_fatal()
    if trace.axis_name is not None:
        agreed = jax.lax.psum(jnp.stack([bad_loss, fatal]).astype(jnp.int32), trace.axis_name)
        bad_loss, fatal = agreed[0] > 0, agreed[1] > 0
    trace.skip = bad_loss | fatal | trace.halted
    return jnp.where(bad_loss, jnp.full_like(loss, jnp.nan), one)


def all_finite(leaves) -> jax.Array:
    """Whether every float leaf is finite: on GPUs in a fixed number of kernels whatever the
    leaves, on CPUs in one read of each leaf.

    GPU: the leaves' finiteness masks (a byte per element) are joined into one array and
    reduced once. Behind the optimization barrier XLA cannot rewrite that reduction of a
    concatenation into one reduction per leaf (its algebraic simplifier does): one per leaf
    and state buffer, each a kernel (in the row-wise DLRM step, 35 of its 204 kernels) that
    the host launches, and re-records in XLA's command buffers, every step. Reducing each
    leaf to per-column flags first did not help: XLA left the column reductions one per
    leaf too. The joined masks cost a byte per element written and read again (7 MB in
    that step's dense state).

    CPU: a kernel costs no launch, but the masks cost their writes, and the reductions of
    each leaf fuse with its mask. The row-wise DLRM step of benchmarks/profile_sharded_step.py
    at batch 256 on two cores (9.5M elements of dense parameters, gradients and Adam
    state): 29–36 ms with the joined masks, 18–21 with a reduction per leaf, 17.3 checking
    nothing (the selects that keep a bad step's state remain), 15–17 unguarded. (A sum of
    ``x * 0`` per leaf read 29 ms: XLA's CPU backend wrote the zeros out as arrays.) Each
    reduction is a function XLA compiles, so the small leaves (biases, their gradients and
    slots, the loss: 45 of that step's 65) share one joined mask: the step's first call (trace,
    lowering, compile) under the test suite's XLA flags takes 0.86 s against 1.02–1.07 with
    a reduction per leaf (0.67 checking nothing), at the same step time.
    """
    leaves = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    if not leaves:
        return jnp.ones((), bool)
    return jax.lax.platform_dependent(*leaves, cpu=_finite_per_leaf, default=_finite_joined)


def _finite_joined(*leaves) -> jax.Array:
    masks = [jnp.isfinite(x).ravel() for x in leaves]
    (masks,) = jax.lax.optimization_barrier((jnp.concatenate(masks),))
    return jnp.all(masks)


# On CPUs, leaves of at most this many elements are checked together (see all_finite).
_SMALL_LEAF = 1 << 16


def _finite_per_leaf(*leaves) -> jax.Array:
    checks = [jnp.all(jnp.isfinite(x)) for x in leaves if x.size > _SMALL_LEAF]
    small = [x for x in leaves if x.size <= _SMALL_LEAF]
    if small:
        checks.append(_finite_joined(*small))
    return jnp.all(jnp.stack(checks))


# The latch, an int32 vector that each step takes from the one before and returns
# updated: the step's index, whether a step since the last raise must raise (then every
# later one updates nothing), which step that was, and running counts of non-finite steps,
# of bags and ids corrected by WARNING bounds checks and of fused table rows kept because
# their update would not stay finite (modulo 2**32: the host adds the differences between
# two reads). The host reads the newest finished latch only, in one small transfer, and
# knows all steps up to it.
_STEP, _HALTED, _HALTED_AT, _NONFINITE, _CORRECTED, _KEPT_ROWS = range(6)


def finish(trace: _Trace, loss: jax.Array, dense_grads, new, old):
    """``(state, fatal, latch)``: ``new`` (the updated dense parameters and optax state)
    where the step is sound, else ``old``; ``fatal``, the step's FATAL bounds reports
    (int32 vectors, in the order of its messages); ``latch``, the one the next step takes."""
    finite = jnp.ones((), bool)
    kept_rows = sum(trace.kept_rows, jnp.zeros((), jnp.int32))
    if trace.policy != "ignore":
        # new: a rate can overflow a parameter or an optimizer slot
        finite = all_finite(jax.tree.leaves((loss, dense_grads, new)))
        finite = finite & (kept_rows == 0)
        for gate in trace.gates.values():
            finite = finite & gate
    # One collective for what every device must agree on (each launch costs host time).
    counts = jnp.stack([trace.any_fatal().astype(jnp.int32), (~finite).astype(jnp.int32),
                        sum(trace.corrected, jnp.zeros((), jnp.int32)), kept_rows])
    if trace.axis_name is not None:
        counts = jax.lax.psum(counts, trace.axis_name)
    bad_input, nonfinite, corrected, kept_rows = counts[0] > 0, counts[1] > 0, counts[2], counts[3]
    was_halted = trace.halted
    # A reduction, not ~(a | b | c): XLA would copy that cheap scalar's computation, and with
    # it the latch, into the kernel of every leaf's select below. While the latch was a new
    # buffer every step (before the steps donated it, see StepMonitor), XLA re-recorded
    # every such kernel of its command buffers (CUDA graphs) each step: the row-wise DLRM
    # step's dispatch took 1.16-1.38 ms instead of 0.84-0.88 on an H100 (docs/parallel.md).
    # The plain expression has not been measured since the donation.
    applied = jnp.max(jnp.stack([bad_input, nonfinite, was_halted]).astype(jnp.int32)) == 0
    if trace.checks:
        new = jax.tree.map(lambda n, o: jnp.where(applied, n, o), new, old)
    halts = ~was_halted & (bad_input | (nonfinite & (trace.policy == "raise")))
    latch = trace.latch
    counted = jnp.where(was_halted, 0, 1)  # steps after the cause are not counted
    latch = jnp.stack([
        latch[_STEP] + 1,
        (was_halted | halts).astype(jnp.int32),
        jnp.where(halts, latch[_STEP], latch[_HALTED_AT]),
        latch[_NONFINITE] + counted * nonfinite.astype(jnp.int32),
        latch[_CORRECTED] + counted * corrected,
        latch[_KEPT_ROWS] + counted * kept_rows,
    ])
    return new, tuple(r for r, _ in trace.fatal), latch


class _Issued(NamedTuple):
    step: int
    latch: jax.Array | None  # a copy of the latch this step returned, if one was taken
    fatal: tuple
    messages: list


# Every this many steps, the host copies a step's latch on the device (the step after
# donates the latch itself), starts copying that to the host (``copy_to_host_async``,
# ~25 us of host time) and reads it once that step has finished: the read then finds the
# bytes on the host and costs no round trip. The latch keeps a late read exact.
_READ_EVERY = 16


@functools.partial(jax.jit, donate_argnums=0)
def _copy_into(buffer: jax.Array, latch: jax.Array) -> jax.Array:
    """``latch``'s values in ``buffer``'s memory (donated): a copy that allocates nothing.
    A new small array every 16th step, freed a few steps later, moved the step's temporary
    buffer now and then, and XLA re-recorded a command buffer for it (StepMonitor)."""
    return jax.lax.dynamic_update_slice(buffer, latch, (0,))


class StepMonitor:
    """The host side of the guard: the latch each step takes, the latch of every
    ``_READ_EVERY``-th step read once the device has finished it (never waiting), running
    totals, and the raise.

    The steps donate their latch, whatever their ``donate``: it then stays in one buffer
    from step to step. Before launching a command buffer (a CUDA graph of the step's
    kernels) XLA re-records it on the host when a buffer of its kernels moved since the
    last call; a latch in a new buffer every step moved one of every kernel that reads or
    writes it: in the row-wise DLRM step on an H100, 859 us of host time a step against
    185 with the donation (docs/parallel.md). For the same reason the copies read on the
    host reuse their buffers (``_copy_into``): as many as are on their way at once."""

    def __init__(self):
        self.steps = 0
        self._latch = None  # the next step's latch (None: a fresh one)
        self._issued = collections.deque()  # steps not yet known to be sound
        self._copying = collections.deque()  # of those, the ones whose latch is on its way
        self._totals = [0, 0, 0]  # non-finite steps, corrected ids, kept rows
        self._counters = (0, 0, 0)  # the device's counters at the last read (modulo 2**32)
        self._spares = []  # the buffers of copies read, for the next copies

    def latch(self, like: jax.Array | None = None) -> jax.Array:
        """The latch for the step about to be issued (after ``poll()``), which the step
        donates. A fresh one is committed to the device that ``like`` (one of the step's
        state arrays) is committed to: jit compiles anew for a change in which inputs are
        committed, and an uncommitted first latch beside committed state (a restored model)
        made the second step compile the step again. A latch lost with a step that failed
        after donating it is replaced by a fresh one from the last counts read."""
        if self._latch is not None and self._latch.is_deleted():
            self._issued.clear()
            self._copying.clear()
            self._latch = None
        if self._latch is None:
            latch = jnp.asarray([self.steps, 0, 0, *self._counters], jnp.int32)
            if isinstance(like, jax.Array) and like.committed and len(like.devices()) == 1:
                latch = jax.device_put(latch, next(iter(like.devices())))
            self._latch = latch
        return self._latch

    def poll(self) -> None:
        """Before issuing a step: raises what a finished step found. Never waits."""
        newest = None
        while self._copying and self._copying[0].latch.is_ready():
            newest = self._copying.popleft()
        if newest is not None:
            self._read(newest)
            # its bytes are on the host now; an older copy's may still be on their way
            self._spares.append(newest.latch)

    def issued(self, fatal: tuple, latch: jax.Array, messages: list) -> None:
        """After issuing step ``self.steps`` (its FATAL reports and the latch it returned)."""
        copy = None
        if self.steps % _READ_EVERY == _READ_EVERY - 1:
            spare = self._spares.pop() if self._spares else None
            if spare is not None and spare.sharding == latch.sharding:
                copy = _copy_into(spare, latch)
            else:
                copy = jnp.copy(latch)
            copy.copy_to_host_async()
        entry = _Issued(self.steps, copy, fatal, messages)
        self._issued.append(entry)
        if copy is not None:
            self._copying.append(entry)
        self._latch = latch
        self.steps += 1

    def check(self) -> None:
        """Waits for every issued step and raises what they found, if anything."""
        if self._issued and not self._latch.is_deleted():  # deleted: its step failed, and said so
            self._copying.clear()
            self._read(self._issued[-1]._replace(latch=self._latch))

    def stats(self) -> dict:
        """Host ints: ``steps``, ``nonfinite_steps``, ``ids_corrected`` and
        ``nonfinite_rows`` (fused table rows kept because their update would not stay
        finite) so far (waits, and raises what the steps found, as ``check()``)."""
        self.check()
        nonfinite, corrected, kept = self._totals
        return {"steps": self.steps, "nonfinite_steps": nonfinite, "ids_corrected": corrected,
                "nonfinite_rows": kept}

    def _read(self, entry: _Issued) -> None:
        """Reads ``entry``'s latch, which knows every step up to it: adds up the counts and
        raises for the step that halted, if one did."""
        _, halted, halted_at, *counters = (int(x) for x in np.asarray(entry.latch))
        new = [(now - before) % 2**32 for now, before in zip(counters, self._counters)]
        self._totals = [total + n for total, n in zip(self._totals, new)]
        self._counters = tuple(counters)
        issued = self._issued
        if halted:
            cause = issued[halted_at - issued[0].step]
            issued.clear()  # the steps after the cause were skipped by the latch
            self._copying.clear()
            self._latch = None  # re-armed: the next step trains again
            self._raise(cause, kept_rows=new[2])
        while issued and issued[0].step <= entry.step:
            issued.popleft()

    def _raise(self, entry: _Issued, kept_rows: int) -> None:
        step, last = entry.step, self.steps - 1
        later = (f" Steps {step + 1}-{last}, issued before this was seen, were skipped too."
                 if last > step else "")
        for report, message in zip(entry.fatal, entry.messages):
            text = _fatal_text(message, report)
            if text is not None:
                raise ValueError(f"train step {step}: {text} The step's update was skipped: the "
                                 f"model and optimizer hold their state from before it.{later}")
        if kept_rows:
            what = (f"the update of {kept_rows} fused table row(s) would not have been finite "
                    "(NaN or Inf); those rows kept their values and the dense update was skipped, "
                    "but the tables' other rows of that step were updated (finite).")
        else:
            what = ("the loss, a gradient or an updated dense value is not finite (NaN or Inf); "
                    "its update was skipped, so the model and optimizer hold their finite state "
                    "from before it.")
        raise NonFiniteError(
            f"train step {step}: {what}{later} Lower the learning rates, check the inputs (NaN "
            "features or per-sample weights), or pass on_nonfinite='skip' to skip such steps "
            "and count them.", step)
