"""Tables whose optimizer runs inside the backward: ``FusedEmbeddingTables`` + ``fused_lookup``.

The ``custom_vjp`` form of the fused update (the jax-tpu-embedding pattern): the
backward of ``fused_lookup`` applies the optimizer to the touched rows, in place, and
hands the *updated* tables back where a gradient would go. Only
``fused_value_and_grad`` and the train steps built on it (_train_step.py) may differentiate it:
they know that this "gradient" replaces the tables, and they guard the two traps of the
pattern:

- a lookup whose output does not reach the loss is never differentiated (JAX skips its
  backward), so its tables come back exactly unchanged — not as zeros;
- one tables object looked up twice in one loss would produce two "updated tables"
  that JAX would add; that raises an error. Put all features of a table in one lookup
  (one ``TableLayout`` may map many features to one table).

``jax.grad`` outside them raises, since a plain optimizer would read an updated table as
a gradient. For tables trained by optax, use ``embedding_bag_lookup`` (FBGEMM's NONE).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec import _step_guard
from jaxrec.fused._update import _fused_update
from jaxrec.ops.bounds_check import BoundsCheckMode
from jaxrec.ops.tbe import corrected_for_gradients, forward_and_count, prepare_lookup, report_corrected
from jaxrec.ops.tbe_layout import PoolingMode, TableLayout, init_weights
from jaxrec.optim import _configs as C
from jaxrec.optim._state import buffer_fields, init_state, merge_optimizer_states, split_optimizer_states


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["weights", "state", "hparams"],
                   meta_fields=["layout", "config", "name"])
@dataclasses.dataclass(frozen=True)
class FusedEmbeddingTables:
    """All tables of a ``TableLayout`` with their fused optimizer: a pytree.

    ``weights`` (the flat buffer), ``state`` (``init_state``) and ``hparams`` (traced
    numbers) are its leaves; ``layout``, ``config`` and ``name`` are static. ``name``
    tells tables apart inside one loss (each must be unique there).
    """

    weights: jax.Array
    state: object
    hparams: C.OptimizerHyperparams
    layout: TableLayout
    config: C.OptimizerConfig
    name: str = "tables"

    @classmethod
    def create(cls, layout: TableLayout, config: C.OptimizerConfig, *, key=None, weights=None,
               dtype=jnp.float32, copy: bool = True, name: str = "tables") -> FusedEmbeddingTables:
        """New tables: ``weights`` as given, else ``init_weights(key, layout, dtype)``; zero state.

        Given ``weights`` are copied, since a train step donates the tables and must not
        delete the caller's array; ``copy=False`` hands them over instead (an array that
        nothing else holds, and a table that fits only once)."""
        if isinstance(config, C.NoOptimizer) or not isinstance(config, C.OptimizerConfig):
            raise TypeError(f"config must be a fused optimizer config (SGD, RowWiseAdagrad, ...), got "
                            f"{type(config).__name__}; NoOptimizer tables are plain embedding_bag_lookup "
                            "weights trained by optax")
        if weights is None:
            if key is None:
                raise ValueError("FusedEmbeddingTables.create needs key= (to initialise the "
                                 "weights) or weights=")
            weights, copy = init_weights(key, layout, dtype), False  # fresh: nothing else holds it
        return cls(jnp.array(weights, copy=copy), init_state(config, layout), config.hyperparams(), layout,
                   config, name)

    @property
    def step(self) -> jax.Array:
        """Fused updates applied so far (FBGEMM's ``iter``)."""
        return self.state.step

    def split_embedding_weights(self) -> list[jax.Array]:
        """Per-table ``[rows, dim]`` views of the weights."""
        return self.layout.split_embedding_weights(self.weights)

    def split_optimizer_states(self) -> list[dict[str, jax.Array]]:
        """Per-table views of the optimizer state (``{name: [rows, dim] or [rows]}``)."""
        return split_optimizer_states(self.config, self.layout, self.state)

    def set_embedding_weights(self, tables) -> FusedEmbeddingTables:
        """The same tables with weights from per-table ``[rows, dim]`` arrays: the inverse of
        ``split_embedding_weights`` (a trained FBGEMM/TorchRec table, for instance)."""
        tables = [jnp.asarray(t, self.weights.dtype) for t in tables]
        return dataclasses.replace(self, weights=self.layout.merge_embedding_weights(tables))

    def set_optimizer_states(self, states, *, step=None) -> FusedEmbeddingTables:
        """The same tables with optimizer states from per-table ``{name: array}`` dicts: the
        inverse of ``split_optimizer_states``. ``step``: the updates already applied
        (unchanged when None); the buffers keep their dtype."""
        buffers = buffer_fields(self.config.state_type)
        state = merge_optimizer_states(self.config, self.layout, states,
                                       step=self.step if step is None else step,
                                       dtype=getattr(self.state, buffers[0]).dtype if buffers else None)
        return dataclasses.replace(self, state=state)

    def after_fused_update(self, updated: FusedEmbeddingTables,
                           applied: jax.Array | None = None) -> FusedEmbeddingTables:
        """The tables after one fused update whose results ``updated`` carries (_train_step.py).

        ``applied``: a bool scalar when a train step's guard gated the update (the kernel
        then touched no row; the step does not advance either)."""
        step = self.state.step + (1 if applied is None else applied.astype(self.state.step.dtype))
        return FusedEmbeddingTables(updated.weights, updated.state._replace(step=step),
                                    self.hparams, self.layout, self.config, self.name)

    def set_hyperparams(self, **values) -> FusedEmbeddingTables:
        """The same tables with new numbers, e.g. ``eps=1e-6`` (fields of OptimizerHyperparams)."""
        unknown = set(values) - set(C.OptimizerHyperparams._fields)
        if unknown:
            raise ValueError(f"unknown hyperparameters {sorted(unknown)}; the fields are "
                             f"{C.OptimizerHyperparams._fields}")
        values = {k: jnp.asarray(v, jnp.float32) for k, v in values.items()}
        return dataclasses.replace(self, hparams=self.hparams._replace(**values))


def fused_lookup(tables: FusedEmbeddingTables, indices: jax.Array, offsets: jax.Array, *,
                 pooling: PoolingMode | int = PoolingMode.SUM, per_sample_weights=None,
                 output_dtype=jnp.float32,
                 bounds_check_mode: BoundsCheckMode | int | str = BoundsCheckMode.WARNING,
                 backend: str = "auto", feature_names=None, table_names=None) -> jax.Array:
    """``embedding_bag_lookup`` of ``tables`` whose backward is the fused update (module doc).

    Differentiate it with ``fused_value_and_grad`` or a train step only.
    ``feature_names``, ``table_names``: ``[T]`` names for FATAL's message.
    """
    if not isinstance(tables, FusedEmbeddingTables):
        raise TypeError(f"tables must be FusedEmbeddingTables, got {type(tables).__name__}")
    lookup, indices, offsets, psw = prepare_lookup(
        tables.weights, indices, offsets, layout=tables.layout, pooling=pooling,
        per_sample_weights=per_sample_weights, output_dtype=output_dtype,
        bounds_check_mode=bounds_check_mode, backend=backend, feature_names=feature_names,
        table_names=table_names)
    out, num_corrected = forward_and_count(lookup, tables.weights, psw, indices, offsets)
    out = _with_fused_update(_Spec(lookup, tables.config, tables.name))(tables, psw, indices, offsets, out)
    report_corrected(lookup, num_corrected)
    return out


@dataclasses.dataclass(frozen=True)
class _Spec:
    lookup: object  # jaxrec.ops.tbe's lookup config (prepare_lookup)
    config: C.OptimizerConfig
    name: str


@functools.cache
def _with_fused_update(spec: _Spec):
    """``out`` itself, whose backward is the fused update of ``tables`` (module doc)."""

    @jax.custom_vjp
    def attach(tables, psw, indices, offsets, out):
        return out

    def forward(tables, psw, indices, offsets, out):
        return out, (tables, psw, indices, offsets)

    def backward(residuals, grad_output):
        tables, psw, indices, offsets = residuals
        _record_update(spec.name)
        # The ids and offsets as the forward read them (it checked them as it read).
        indices, offsets = corrected_for_gradients(spec.lookup, indices, offsets)
        gate = _step_guard.table_gate(spec.name, grad_output)
        if gate is not None:  # gated off: every bag empty, so the kernel touches no row
            offsets = jnp.where(gate, offsets, jnp.zeros_like(offsets))
        weighted = spec.lookup.weighted
        weights, state, grad_psw, nonfinite_rows = _fused_update(
            tables.weights, tables.state, grad_output, indices, offsets, layout=tables.layout,
            config=spec.config, hparams=tables.hparams, pooling=spec.lookup.pooling,
            per_sample_weights=psw if weighted else None,
            bounds_check_mode=BoundsCheckMode.NONE, backend=spec.lookup.backend,
            offsets_checked=True)
        _step_guard.report_nonfinite_rows(nonfinite_rows)
        # The updated tables take the place of the gradient; the int step has none (its
        # increment is applied by fused_value_and_grad), nor do the hyperparameters.
        updated = dataclasses.replace(
            tables, weights=weights,
            state=state._replace(step=np.zeros((), jax.dtypes.float0)),
            hparams=jax.tree.map(jnp.zeros_like, tables.hparams))
        return updated, (grad_psw if weighted else jnp.zeros_like(psw)), None, None, None

    attach.defvjp(forward, backward)
    return attach


# --- which tables the backward updated, while fused_value_and_grad traces ------------

_recording = threading.local()


@contextlib.contextmanager
def record_updates():
    """Counts, per tables name, the fused backwards traced inside the block (_train_step.py)."""
    stack = _recording.__dict__.setdefault("stack", [])
    counts: dict[str, int] = {}
    stack.append(counts)
    try:
        yield counts
    finally:
        stack.pop()


def _record_update(name: str) -> None:
    stack = getattr(_recording, "stack", [])
    if not stack:
        raise RuntimeError(
            "fused_lookup was differentiated outside jaxrec.fused.fused_value_and_grad and the "
            "train steps (jaxrec.nn.make_train_step, jaxrec.fused.make_functional_train_step). "
            "Its backward returns the *updated* tables in place of a gradient, which a plain "
            "optimizer would misread. Use those, or embedding_bag_lookup for tables trained by optax.")
    stack[-1][name] = stack[-1].get(name, 0) + 1
