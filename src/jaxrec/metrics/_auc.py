"""Exact ROC AUC on the host: for one batch, over a stream, and over a sliding window.

AUC is the probability that a random positive scores above a random negative, ties counting
1/2. With weights, each example counts as ``weight`` copies of itself (integer weights give the
same AUC as ``np.repeat``)::

    sort the distinct scores s_1 < s_2 < ... ; per score g:
        P_g = sum of the weights of the positives scoring s_g
        N_g = sum of the weights of the negatives scoring s_g
    AUC = sum_g P_g * (N_1 + ... + N_{g-1} + N_g / 2) / (sum P * sum N)

which is O(n log n) (one sort) and exact: no thresholds or bins as in TorchRec's
approximations.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from jaxrec.metrics._validate import BINARY, REAL, require_examples, weighted_rows


def _split(labels, scores, weights) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(scores, positive weight, negative weight)`` of the examples with weight > 0."""
    (y, s), w = weighted_rows((("labels", labels, BINARY), ("scores", scores, REAL)), weights)
    return s, w * y, w * (1.0 - y)


def _merge(scores, pos, neg) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct scores, ascending, with the positive and negative weight of each."""
    distinct, inverse = np.unique(scores, return_inverse=True)
    n = distinct.size
    return distinct, np.bincount(inverse, pos, n), np.bincount(inverse, neg, n)


def _auc_of_merged(pos: np.ndarray, neg: np.ndarray) -> float:
    """AUC from the per-distinct-score weights of :func:`_merge` (ascending scores)."""
    total_pos, total_neg = pos.sum(), neg.sum()
    if total_pos == 0 or total_neg == 0:
        raise ValueError(
            "AUC needs both positive and negative labels among the examples with weight > 0, "
            f"got total weight {total_pos:g} of positives and {total_neg:g} of negatives; "
            "evaluate on more examples (or use log_loss, which needs one class only)."
        )
    neg_below = np.concatenate([[0.0], np.cumsum(neg)[:-1]])
    return float(pos @ (neg_below + 0.5 * neg) / (total_pos * total_neg))


def auc(labels: ArrayLike, scores: ArrayLike, weights: ArrayLike | None = None) -> float:
    """Exact ROC AUC of ``scores`` against binary ``labels`` (ties count 1/2), O(n log n).

    ``scores`` are any monotone function of the predicted probability (logits work).
    ``weights`` (optional, >= 0, one per example) weigh the examples; weight 0 drops one,
    so a batch's padding mask can be passed as is.
    """
    s, pos, neg = _split(labels, scores, weights)
    require_examples(pos)
    return _auc_of_merged(*_merge(s, pos, neg)[1:])


class StreamingAUC:
    """Exact AUC over every example seen since :meth:`reset` (e.g. a whole evaluation pass).

    Memory grows with the stream: one entry per example until :meth:`compute` merges equal
    scores into one entry; :class:`WindowedAUC` keeps memory bounded.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Forgets every example."""
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def update(
        self, labels: ArrayLike, scores: ArrayLike, weights: ArrayLike | None = None
    ) -> None:
        """Adds one batch (arguments as in :func:`auc`; weight 0 rows are not stored)."""
        s, pos, neg = _split(labels, scores, weights)
        if s.size:
            self._parts.append((s, pos, neg))

    def compute(self) -> float:
        """AUC over the examples seen since :meth:`reset`."""
        if not self._parts:
            raise ValueError(
                "StreamingAUC has seen no example with weight > 0 since reset(); call "
                "update(labels, scores, weights) first."
            )
        self._parts = [_merge(*(np.concatenate(a) for a in zip(*self._parts)))]
        _, pos, neg = self._parts[0]
        return _auc_of_merged(pos, neg)


class WindowedAUC:
    """Exact AUC over the last ``window_size`` examples seen (TorchRec's windowed AUC), e.g.
    to follow a training run's recent quality rather than its average since the start.

    Examples of weight 0 (padding) are not stored and do not take a place in the window. The
    examples live in a ring buffer of ``window_size`` entries, so memory stays bounded.
    """

    def __init__(self, window_size: int):
        is_int = isinstance(window_size, (int, np.integer)) and not isinstance(window_size, bool)
        if not is_int or window_size < 1:
            raise ValueError(
                f"window_size must be a positive int (the number of examples to keep), got "
                f"{window_size!r}."
            )
        self.window_size = int(window_size)
        self._scores = np.empty(self.window_size)
        self._pos = np.empty(self.window_size)
        self._neg = np.empty(self.window_size)
        self.reset()

    def reset(self) -> None:
        """Empties the window."""
        self._next = 0  # where the next example goes
        self._count = 0  # filled entries: [0, count) until the buffer first wraps

    def update(
        self, labels: ArrayLike, scores: ArrayLike, weights: ArrayLike | None = None
    ) -> None:
        """Adds one batch (arguments as in :func:`auc`), evicting the oldest examples."""
        s, pos, neg = _split(labels, scores, weights)
        k = min(s.size, self.window_size)
        first = s.size - k  # a batch longer than the window keeps its last examples only
        at = (self._next + np.arange(k)) % self.window_size
        self._scores[at] = s[first:]
        self._pos[at] = pos[first:]
        self._neg[at] = neg[first:]
        self._next = (self._next + k) % self.window_size
        self._count = min(self._count + k, self.window_size)

    def compute(self) -> float:
        """AUC over the last ``window_size`` examples of weight > 0."""
        if self._count == 0:
            raise ValueError(
                "WindowedAUC has seen no example with weight > 0 since reset(); call "
                "update(labels, scores, weights) first."
            )
        n = self._count
        return _auc_of_merged(*_merge(self._scores[:n], self._pos[:n], self._neg[:n])[1:])
