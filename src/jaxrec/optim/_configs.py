"""Configs of FBGEMM's fused (``EXACT_*``) optimizers and their traced hyperparameters.

A config is a frozen, keyword-only dataclass: hashable, so it can be static under
``jit``. Its *static* fields (the optimizer kind, ``gradient_clipping``,
``weight_decay_mode``, ``state_dtype``) shape the compiled program; its numbers
(learning rate, betas, ...) are only defaults. The update functions read the
numbers from an :class:`OptimizerHyperparams` pytree of float32 scalars.

``learning_rate`` is a number or a schedule, as in optax: a function of the step count
(an ``optax.Schedule``) that every fused update evaluates at the tables' ``step`` (the
updates applied so far, FBGEMM's ``iter``) inside the jitted step, so the rate moves
with no recompilation::

    config = RowWiseAdagrad(learning_rate=optax.cosine_decay_schedule(0.05, 10_000))

FBGEMM's defaults (``SplitTableBatchedEmbeddingBagsCodegen``) are kept.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec.optim import _state

WEIGHT_DECAY_MODES = ("none", "l2", "decoupled")
# FBGEMM's WeightDecayMode names and values, accepted as spellings of the modes above.
_FBGEMM_WEIGHT_DECAY_MODES = {"none": "none", "l2": "l2", "decouple": "decoupled", 0: "none", 1: "l2",
                              2: "decoupled"}
STATE_DTYPES = ("float32", "bfloat16", "float16")


class OptimizerHyperparams(NamedTuple):
    """The numbers of every optimizer, as float32 scalars (a pytree: pass it as a jit argument).

    One struct for all optimizers, like the scalar arguments of FBGEMM's kernels;
    a field the optimizer does not use is 0 and ignored.
    """

    learning_rate: jax.Array
    eps: jax.Array
    beta1: jax.Array
    beta2: jax.Array
    weight_decay: jax.Array
    momentum: jax.Array
    eta: jax.Array
    max_gradient: jax.Array
    max_norm: jax.Array


def has_schedule(config) -> bool:
    """Whether ``config.learning_rate`` is a schedule (a function of the step count)."""
    return callable(getattr(config, "learning_rate", None))


def scheduled(config, hparams: OptimizerHyperparams, step) -> OptimizerHyperparams:
    """``hparams`` with the learning rate of ``config``'s schedule at ``step`` (the fused
    updates applied so far); ``hparams`` unchanged when the rate is a number."""
    if not has_schedule(config):
        return hparams
    return hparams._replace(learning_rate=jnp.asarray(config.learning_rate(step), jnp.float32))


def set_tables_learning_rate(config, hparams: OptimizerHyperparams, learning_rate,
                             name: str) -> OptimizerHyperparams:
    """``hparams`` of the tables ``name`` trained by ``config`` with a new learning rate (a
    float or a traced scalar: no recompile; ``jaxrec.fused.set_learning_rate``). Refused when
    the config's rate is a schedule, which would override it at the next update."""
    if has_schedule(config):
        raise ValueError(f"the learning rate of tables {name!r} follows the schedule of its "
                         "config (learning_rate=<schedule>); set_learning_rate would be overridden "
                         "at the next update. Give the config a number to set the rate by hand")
    return hparams._replace(learning_rate=jnp.asarray(learning_rate, jnp.float32))


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Base of the fused optimizer configs; not used directly."""

    fbgemm_name: ClassVar[str] = ""
    """FBGEMM's ``EmbOptimType`` name of the optimizer."""
    state_type: ClassVar[type] = _state.NoOptimizerState
    """The optimizer's state NamedTuple (``jaxrec.optim._state``)."""

    @property
    def state_names(self) -> tuple[str, ...]:
        """Names of the optimizer's state buffers (the keys of ``split_optimizer_states``)."""
        return _state.buffer_fields(self.state_type)

    def hyperparams(self) -> OptimizerHyperparams:
        """The config's numbers as traced float32 scalars (0 for fields it does not have;
        a schedule's rate at step 0)."""
        return scheduled(self, OptimizerHyperparams(
            *(jnp.asarray(0.0 if has_schedule(self) and name == "learning_rate" else getattr(self, name, 0.0),
                          jnp.float32) for name in OptimizerHyperparams._fields)), 0)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "learning_rate" and callable(value):
                continue  # a schedule: evaluated at each update (module doc)
            if f.name in OptimizerHyperparams._fields:
                object.__setattr__(self, f.name, _as_float(type(self).__name__, f.name, value))
        if hasattr(self, "state_dtype"):
            dtype = jnp.dtype(self.state_dtype)
            if dtype.name not in STATE_DTYPES:
                raise TypeError(f"{type(self).__name__}.state_dtype must be one of {STATE_DTYPES}, "
                                f"got {dtype.name}")
            object.__setattr__(self, "state_dtype", dtype)
        for name, low, high in (("learning_rate", 0, math.inf), ("eps", 0, math.inf),
                                ("weight_decay", 0, math.inf), ("max_norm", 0, math.inf),
                                ("beta1", 0, 1), ("beta2", 0, 1), ("momentum", 0, math.inf),
                                ("eta", 0, math.inf)):
            value = getattr(self, name, None)
            if value is not None and not callable(value) and not low <= value < high:
                raise ValueError(f"{type(self).__name__}.{name} must be in [{low}, {high}), "
                                 f"got {value}")
        if not isinstance(getattr(self, "seed", 0), int) or not 0 <= getattr(self, "seed", 0) < 2**32:
            raise ValueError(f"{type(self).__name__}.seed must be an int in [0, 2**32), got "
                             f"{self.seed!r}")
        if getattr(self, "max_gradient", 1.0) <= 0:
            raise ValueError(f"{type(self).__name__}.max_gradient must be > 0, got {self.max_gradient}")


def _as_float(cls: str, name: str, value) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
        what = ("a Python number or a schedule (a function of the step)" if name == "learning_rate"
                else "a Python number (the default)")
        raise TypeError(f"{cls}.{name} must be {what}; pass traced values through "
                        "config.hyperparams() / jaxrec.fused.set_learning_rate(), got "
                        f"{type(value).__name__}") from None
    if not np.isfinite(value):
        raise ValueError(f"{cls}.{name} must be finite, got {value}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Common(OptimizerConfig):
    learning_rate: float | Callable[[jax.Array], jax.Array] = 0.01
    """Step size (FBGEMM's default 0.01), or a schedule: a function of the step count such
    as an ``optax.Schedule``, evaluated at every update (module doc)."""
    gradient_clipping: bool = False
    """FBGEMM's gradient clipping (static): clamp each element of the lookup's output
    gradient to ``[-max_gradient, max_gradient]`` before the backward, so the rows'
    gradients and the per-sample weights' gradient come from the clamped values."""
    max_gradient: float = 1.0
    """The clipping bound when ``gradient_clipping`` is on."""
    max_norm: float = 0.0
    """After the update, rescale a row whose L2 norm exceeds ``max_norm`` to that norm; 0 = off.
    (FBGEMM implements it for rowwise Adagrad only; jaxrec applies it to every optimizer.)"""
    state_dtype: jnp.dtype = jnp.float32
    """dtype of the optimizer state buffers: float32 (default), bfloat16 or float16. The
    math runs in float32 and the state is rounded when stored, as in FBGEMM."""
    stochastic_rounding: bool = False
    """Round float16/bfloat16 *weights* stochastically when storing them (FBGEMM's
    ``stochastic_rounding``, which defaults to True there): unbiased, so small updates are
    not lost to rounding. Deterministic: the random bits are a hash of ``seed``, the step,
    the row and the column (``jaxrec.optim._rounding``). float32 weights and every state
    buffer are rounded to nearest. Static."""
    seed: int = 0
    """Seed of the stochastic rounding (static)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGD(_Common):
    """EXACT_SGD: ``w -= lr * g``. No state beyond the step counter."""

    fbgemm_name: ClassVar[str] = "EXACT_SGD"
    state_type: ClassVar[type] = _state.SGDState


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adagrad(_Common):
    """EXACT_ADAGRAD: ``m += g²; w -= lr * g / (sqrt(m) + eps)`` element-wise, ``m`` starting at 0.

    Not optax's ``adagrad``: optax starts ``m`` at ``initial_accumulator_value=0.1`` and puts
    ``eps`` inside the square root (``g / sqrt(m + eps)``, and 0 where ``m == 0``).
    """

    fbgemm_name: ClassVar[str] = "EXACT_ADAGRAD"
    state_type: ClassVar[type] = _state.AdagradState
    eps: float = 1e-8
    """Added to ``sqrt(m)`` (outside the square root)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowWiseAdagrad(_Common):
    """EXACT_ROWWISE_ADAGRAD: one accumulator per row (see ``update_rows`` for the formula)."""

    fbgemm_name: ClassVar[str] = "EXACT_ROWWISE_ADAGRAD"
    state_type: ClassVar[type] = _state.RowWiseAdagradState
    eps: float = 1e-8
    """Added to ``sqrt(m)`` (outside the square root)."""
    weight_decay: float = 0.0
    """Weight decay strength; how it applies is ``weight_decay_mode``."""
    weight_decay_mode: str = "none"
    """"none"; "l2" (``g += weight_decay * w`` before the update, FBGEMM's L2 = 1);
    "decoupled" (``w -= lr * weight_decay * w``, FBGEMM's DECOUPLE = 2). Static. FBGEMM's
    spellings are accepted too ("L2", "DECOUPLE", "NONE", 0, 1, 2, or its enum member)
    and stored as the names here."""

    def __post_init__(self):
        super().__post_init__()
        mode = self.weight_decay_mode
        mode = getattr(mode, "name", mode)  # an enum member such as FBGEMM's WeightDecayMode.L2
        key = mode.lower() if isinstance(mode, str) else mode
        canonical = key if key in WEIGHT_DECAY_MODES else _FBGEMM_WEIGHT_DECAY_MODES.get(key)
        if canonical is None:
            raise ValueError(f"RowWiseAdagrad.weight_decay_mode must be one of {WEIGHT_DECAY_MODES} "
                             f"(or FBGEMM's NONE, L2, DECOUPLE), got {self.weight_decay_mode!r}; "
                             "FBGEMM's COUNTER, COWCLIP and DECOUPLE_GLOBAL modes are not supported")
        object.__setattr__(self, "weight_decay_mode", canonical)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _AdamLike(_Common):
    beta1: float = 0.9
    """Decay of the first moment ``exp_avg``."""
    beta2: float = 0.999
    """Decay of the second moment ``exp_avg_sq``."""
    eps: float = 1e-8
    """Added to ``sqrt(v̂)`` (outside the square root)."""
    weight_decay: float = 0.0
    """Decoupled weight decay, scaled by the learning rate (``+ weight_decay * w`` in the step)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adam(_AdamLike):
    """ADAM: bias-corrected Adam with decoupled weight decay (= ``optax.adamw``)."""

    fbgemm_name: ClassVar[str] = "ADAM"
    state_type: ClassVar[type] = _state.AdamState


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartialRowWiseAdam(_AdamLike):
    """PARTIAL_ROWWISE_ADAM: Adam with one second moment per row (``mean_D(g²)``)."""

    fbgemm_name: ClassVar[str] = "PARTIAL_ROWWISE_ADAM"
    state_type: ClassVar[type] = _state.PartialRowWiseAdamState


@dataclasses.dataclass(frozen=True, kw_only=True)
class LAMB(_AdamLike):
    """LAMB: Adam's step scaled by the row's trust ratio ``‖w‖ / ‖r‖``."""

    fbgemm_name: ClassVar[str] = "LAMB"
    state_type: ClassVar[type] = _state.LAMBState


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartialRowWiseLAMB(_AdamLike):
    """PARTIAL_ROWWISE_LAMB: LAMB with one second moment per row (``mean_D(g²)``)."""

    fbgemm_name: ClassVar[str] = "PARTIAL_ROWWISE_LAMB"
    state_type: ClassVar[type] = _state.PartialRowWiseLAMBState


@dataclasses.dataclass(frozen=True, kw_only=True)
class LarsSGD(_Common):
    """LARS_SGD: SGD with momentum and a per-row learning rate from the layer-wise trust ratio."""

    fbgemm_name: ClassVar[str] = "LARS_SGD"
    state_type: ClassVar[type] = _state.LarsSGDState
    eta: float = 0.001
    """Trust coefficient (optax's ``trust_coefficient``)."""
    momentum: float = 0.9
    """Momentum of ``momentum_buffer``."""
    weight_decay: float = 0.0
    """Weight decay, added to the gradient and to the trust-ratio denominator."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoOptimizer(OptimizerConfig):
    """NONE: no fused update; the backward hands out the table gradient (for optax)."""

    fbgemm_name: ClassVar[str] = "NONE"
    state_type: ClassVar[type] = _state.NoOptimizerState


ALL_OPTIMIZERS = (SGD, Adagrad, RowWiseAdagrad, Adam, PartialRowWiseAdam, LAMB,
                  PartialRowWiseLAMB, LarsSGD, NoOptimizer)
"""Every config class, in FBGEMM's order; tests and docs iterate over it."""
