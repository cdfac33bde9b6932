"""Optimizer state of the fused optimizers: flat buffers laid out like the weights.

Each state kind of all tables lives in one flat buffer, indexed the way the kernels
will index it (as FBGEMM's ``momentum1_dev`` + ``momentum1_offsets``)::

    # tables: t0 (rows=4, dim=2)   t1 (rows=3, dim=3)
    # per-element state [num_weights] (Adagrad momentum1, Adam exp_avg / exp_avg_sq, LARS
    # momentum_buffer): exactly the weights' layout, offsets = layout.table_offsets
    #   [t0 r0 | t0 r1 | t0 r2 | t0 r3 | t1 r0 | t1 r1 | t1 r2]    table offsets 0, 8
    # per-row state [sum(rows)] (rowwise Adagrad momentum1, partial-rowwise exp_avg_sq):
    # one value per row, offsets = layout.row_offsets
    #   [t0r0 t0r1 t0r2 t0r3 | t1r0 t1r1 t1r2]                     table offsets 0, 4

Every state also holds ``step``: the int32 count of fused updates applied so far
(FBGEMM's ``iter``; global, not per row). ``split_optimizer_states`` gives per-table views.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrec.ops.tbe_layout import TableLayout, flat_slice


class NoOptimizerState(NamedTuple):
    """NONE: the step counter only."""

    step: jax.Array
    row_fields = ()


class SGDState(NamedTuple):
    """EXACT_SGD: the step counter only."""

    step: jax.Array
    row_fields = ()


class AdagradState(NamedTuple):
    """EXACT_ADAGRAD: ``momentum1`` = running sum of g², per element."""

    step: jax.Array
    momentum1: jax.Array
    row_fields = ()


class RowWiseAdagradState(NamedTuple):
    """EXACT_ROWWISE_ADAGRAD: ``momentum1`` = running sum of ``mean_D(g²)``, one per row."""

    step: jax.Array
    momentum1: jax.Array
    row_fields = ("momentum1",)


class AdamState(NamedTuple):
    """ADAM: first and second moments, per element (FBGEMM's momentum1 / momentum2)."""

    step: jax.Array
    exp_avg: jax.Array
    exp_avg_sq: jax.Array
    row_fields = ()


class PartialRowWiseAdamState(NamedTuple):
    """PARTIAL_ROWWISE_ADAM: ``exp_avg`` per element, ``exp_avg_sq`` one per row."""

    step: jax.Array
    exp_avg: jax.Array
    exp_avg_sq: jax.Array
    row_fields = ("exp_avg_sq",)


class LAMBState(NamedTuple):
    """LAMB: first and second moments, per element."""

    step: jax.Array
    exp_avg: jax.Array
    exp_avg_sq: jax.Array
    row_fields = ()


class PartialRowWiseLAMBState(NamedTuple):
    """PARTIAL_ROWWISE_LAMB: ``exp_avg`` per element, ``exp_avg_sq`` one per row."""

    step: jax.Array
    exp_avg: jax.Array
    exp_avg_sq: jax.Array
    row_fields = ("exp_avg_sq",)


class LarsSGDState(NamedTuple):
    """LARS_SGD: the momentum buffer, per element (FBGEMM's momentum1)."""

    step: jax.Array
    momentum_buffer: jax.Array
    row_fields = ()


def buffer_fields(state_type) -> tuple[str, ...]:
    """Names of the state buffers (every field but ``step``)."""
    return state_type._fields[1:]


def state_offsets(config, layout: TableLayout, name: str) -> tuple[int, ...]:
    """Offset of each table in state buffer ``name``: per-row or per-element (= weights)."""
    return layout.row_offsets if name in config.state_type.row_fields else layout.table_offsets


def state_size(config, layout: TableLayout, name: str) -> int:
    return sum(layout.rows) if name in config.state_type.row_fields else layout.num_weights


def init_state(config, layout: TableLayout, dtype=None):
    """Zero state of ``config``'s optimizer for all tables of ``layout`` (FBGEMM starts at 0).

    ``dtype`` overrides ``config.state_dtype`` (float32 by default).
    """
    _check_config(config)
    if not isinstance(layout, TableLayout):
        raise TypeError(f"layout must be a jaxrec.ops.TableLayout, got {type(layout).__name__}")
    dtype = jnp.dtype(getattr(config, "state_dtype", jnp.float32) if dtype is None else dtype)
    if dtype.name not in ("float32", "bfloat16", "float16"):
        raise TypeError(f"state dtype must be float32, bfloat16 or float16, got {dtype.name}")
    buffers = {name: jnp.zeros((state_size(config, layout, name),), dtype)
               for name in buffer_fields(config.state_type)}
    return config.state_type(step=jnp.zeros((), jnp.int32), **buffers)


def split_optimizer_states(config, layout: TableLayout, state) -> list[dict[str, jax.Array]]:
    """Per-table views of the state (FBGEMM's name): for each table ``{name: [rows, dim] or [rows]}``."""
    check_state(config, layout, state)
    tables = [{} for _ in range(layout.num_tables)]
    for name in buffer_fields(config.state_type):
        buf = getattr(state, name)
        per_row = name in config.state_type.row_fields
        for t, off in enumerate(state_offsets(config, layout, name)):
            rows, dim = layout.rows[t], layout.dims[t]
            size = rows if per_row else rows * dim
            piece = flat_slice(buf, off, size)  # a NumPy state gives NumPy views
            tables[t][name] = piece if per_row else piece.reshape(rows, dim)
    return tables


def merge_optimizer_states(config, layout: TableLayout, tables: Sequence[Mapping[str, jax.Array]], *,
                           step=0, dtype=None):
    """The state from per-table ``{name: [rows, dim] or [rows]}`` arrays: the inverse of
    ``split_optimizer_states`` (load a trained FBGEMM/TorchRec table's optimizer state).

    ``step``: the fused updates already applied (FBGEMM's ``iter``); ``dtype`` overrides
    ``config.state_dtype``.
    """
    _check_config(config)
    names = buffer_fields(config.state_type)
    if len(tables) != layout.num_tables:
        raise ValueError(f"expected the optimizer states of {layout.num_tables} tables, got {len(tables)}")
    for t, table in enumerate(tables):
        if set(table) != set(names):
            raise ValueError(f"table {t}: {config.state_type.__name__} has the states {list(names)}, "
                             f"got {sorted(table)}")
    dtype = jnp.dtype(getattr(config, "state_dtype", jnp.float32) if dtype is None else dtype)
    buffers = {}
    for name in names:
        per_row = name in config.state_type.row_fields
        pieces = []
        for t, table in enumerate(tables):
            want = (layout.rows[t],) if per_row else (layout.rows[t], layout.dims[t])
            value = jnp.asarray(table[name])
            if tuple(value.shape) != want:
                raise ValueError(f"table {t}: state {name!r} must have shape {want} "
                                 f"({'one per row' if per_row else 'one per weight'}), got {tuple(value.shape)}")
            pieces.append(value.reshape(-1).astype(dtype))
        buffers[name] = jnp.concatenate(pieces) if pieces else jnp.zeros((0,), dtype)
    return config.state_type(step=jnp.asarray(step, jnp.int32), **buffers)


def check_state(config, layout: TableLayout, state) -> None:
    """Raise if ``state`` is not ``config``'s state for ``layout`` (type, buffer shapes, step)."""
    _check_config(config)
    if type(state) is not config.state_type:
        raise TypeError(f"{type(config).__name__} needs a {config.state_type.__name__}, got "
                        f"{type(state).__name__}; build it with init_state(config, layout)")
    if jnp.shape(state.step) != () or not jnp.issubdtype(jnp.result_type(state.step), jnp.integer):
        raise TypeError(f"state.step must be an integer scalar, got {jnp.result_type(state.step)}"
                        f"{list(jnp.shape(state.step))}")
    for name in buffer_fields(config.state_type):
        buf = getattr(state, name)
        want = (state_size(config, layout, name),)
        if tuple(buf.shape) != want:
            kind = "one per row" if name in config.state_type.row_fields else "one per weight"
            raise ValueError(f"state.{name} must have shape {want} ({kind}) for this layout, got "
                             f"{tuple(buf.shape)}; build it with init_state(config, layout)")
        if jnp.dtype(buf.dtype).name not in ("float32", "bfloat16", "float16"):
            raise TypeError(f"state.{name} must be float32, bfloat16 or float16, got {buf.dtype}")


def _check_config(config) -> None:
    state_type = getattr(config, "state_type", None)
    if state_type is None or not hasattr(config, "hyperparams"):
        raise TypeError(f"config must be a jaxrec.optim optimizer config (SGD, Adagrad, "
                        f"RowWiseAdagrad, ...), got {type(config).__name__}")
