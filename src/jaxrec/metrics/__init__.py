"""Host-side metrics for recommendation models: numpy in, Python ``float`` out.

A training loop ``jax.device_get``s each batch's labels and scores and passes them here,
with the batch's mask as ``weights`` (weight 0 = a padding row, which does not count at all;
other weights count an example that many times). Everything is computed in float64.

- ``auc``: exact ROC AUC (ties count 1/2), O(n log n).
- ``log_loss``, ``rmse``, ``mae``: weighted means of a per-example loss.
- ``StreamingAUC``, ``StreamingLogLoss``, ``StreamingRMSE``, ``StreamingMAE``: the same over
  every batch seen since ``reset()`` (``update(...)``, then ``compute()``).
- ``WindowedAUC``: exact AUC over the last ``window_size`` examples (a ring buffer).
- ``ranking_metrics`` (``recall_at_k``, ``ndcg_at_k``, ``hit_rate_at_k``, ``mrr``): top-K
  retrieval metrics of a ``[queries, items]`` score matrix, with items to exclude.

Errors are ``ValueError``s naming the argument: shapes that differ, negative or non-finite
weights, no example of weight > 0, NaN scores, labels outside {0, 1} (AUC) or [0, 1] (log
loss), an AUC with one class only.
"""

from __future__ import annotations

from jaxrec.metrics._auc import StreamingAUC, WindowedAUC, auc
from jaxrec.metrics._pointwise import StreamingLogLoss, StreamingMAE, StreamingRMSE, log_loss, mae, rmse
from jaxrec.metrics._ranking import hit_rate_at_k, mrr, ndcg_at_k, ranking_metrics, recall_at_k

__all__ = [
    "StreamingAUC",
    "StreamingLogLoss",
    "StreamingMAE",
    "StreamingRMSE",
    "WindowedAUC",
    "auc",
    "hit_rate_at_k",
    "log_loss",
    "mae",
    "mrr",
    "ndcg_at_k",
    "ranking_metrics",
    "recall_at_k",
    "rmse",
]
