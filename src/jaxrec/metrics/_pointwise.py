"""Weighted means of a per-example loss: log loss, RMSE and MAE, for one batch or a stream.

Each is ``sum_i w_i loss_i / sum_i w_i`` over the examples (RMSE: the square root of the
mean squared error), in float64. The streaming forms keep the two running sums, so they
equal the batch function over the concatenation of every batch seen since ``reset()``.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

from jaxrec.metrics._validate import REAL, UNIT, require_examples, weighted_rows


def _check_eps(eps: float) -> float:
    if not 0 < eps < 0.5:
        raise ValueError(
            f"eps must lie in (0, 0.5), got {eps!r}; it keeps probabilities away from 0 and 1 "
            "so that one confident mistake costs -log(eps), not infinity (1e-7 is usual)."
        )
    return float(eps)


def _bce(labels, probabilities, weights, eps) -> tuple[np.ndarray, np.ndarray]:
    """Per-example binary cross-entropy and weights (examples with weight > 0 only)."""
    (y, p), w = weighted_rows(
        (("labels", labels, UNIT), ("probabilities", probabilities, UNIT)), weights
    )
    p = np.clip(p, eps, 1.0 - eps)
    return -(y * np.log(p) + (1.0 - y) * np.log1p(-p)), w


def _errors(targets, predictions, weights) -> tuple[np.ndarray, np.ndarray]:
    """Per-example ``predictions - targets`` and weights (examples with weight > 0 only)."""
    (t, p), w = weighted_rows(
        (("targets", targets, REAL), ("predictions", predictions, REAL)), weights
    )
    return p - t, w


def _mean(losses: np.ndarray, weights: np.ndarray) -> float:
    require_examples(weights)
    return float(losses @ weights / weights.sum())


def log_loss(
    labels: ArrayLike,
    probabilities: ArrayLike,
    weights: ArrayLike | None = None,
    eps: float = 1e-7,
) -> float:
    """Weighted mean binary cross-entropy ``-[y log p + (1 - y) log(1 - p)]``, with ``p``
    clipped to ``[eps, 1 - eps]``. ``labels`` lie in [0, 1] (soft labels allowed); pass
    probabilities, not logits. Weight 0 drops an example (pass the batch's padding mask)."""
    return _mean(*_bce(labels, probabilities, weights, _check_eps(eps)))


def rmse(targets: ArrayLike, predictions: ArrayLike, weights: ArrayLike | None = None) -> float:
    """Root of the weighted mean squared error (e.g. rating prediction). Weight 0 drops an
    example (pass the batch's padding mask)."""
    e, w = _errors(targets, predictions, weights)
    return math.sqrt(_mean(e * e, w))


def mae(targets: ArrayLike, predictions: ArrayLike, weights: ArrayLike | None = None) -> float:
    """Weighted mean absolute error. Weight 0 drops an example (pass the batch's padding mask)."""
    e, w = _errors(targets, predictions, weights)
    return _mean(np.abs(e), w)


class _StreamingMean:
    """Running ``sum w * loss`` and ``sum w`` (float64) since :meth:`reset`."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Forgets every example."""
        self._loss_sum = 0.0
        self._weight_sum = 0.0

    def _add(self, losses: np.ndarray, weights: np.ndarray) -> None:
        self._loss_sum += float(losses @ weights)
        self._weight_sum += float(weights.sum())

    def _mean(self) -> float:
        if self._weight_sum == 0:
            raise ValueError(
                f"{type(self).__name__} has seen no example with weight > 0 since reset(); "
                "call update() first."
            )
        return self._loss_sum / self._weight_sum


class StreamingLogLoss(_StreamingMean):
    """:func:`log_loss` over every example seen since :meth:`reset`."""

    def __init__(self, *, eps: float = 1e-7):
        self.eps = _check_eps(eps)
        super().__init__()

    def update(
        self, labels: ArrayLike, probabilities: ArrayLike, weights: ArrayLike | None = None
    ) -> None:
        """Adds one batch (arguments as in :func:`log_loss`)."""
        self._add(*_bce(labels, probabilities, weights, self.eps))

    def compute(self) -> float:
        """Mean log loss over the examples seen since :meth:`reset`."""
        return self._mean()


class StreamingRMSE(_StreamingMean):
    """:func:`rmse` over every example seen since :meth:`reset` (the root of the running
    weighted mean squared error, not a mean of per-batch RMSEs)."""

    def update(
        self, targets: ArrayLike, predictions: ArrayLike, weights: ArrayLike | None = None
    ) -> None:
        """Adds one batch (arguments as in :func:`rmse`)."""
        e, w = _errors(targets, predictions, weights)
        self._add(e * e, w)

    def compute(self) -> float:
        """RMSE over the examples seen since :meth:`reset`."""
        return math.sqrt(self._mean())


class StreamingMAE(_StreamingMean):
    """:func:`mae` over every example seen since :meth:`reset`."""

    def update(
        self, targets: ArrayLike, predictions: ArrayLike, weights: ArrayLike | None = None
    ) -> None:
        """Adds one batch (arguments as in :func:`mae`)."""
        e, w = _errors(targets, predictions, weights)
        self._add(np.abs(e), w)

    def compute(self) -> float:
        """MAE over the examples seen since :meth:`reset`."""
        return self._mean()
