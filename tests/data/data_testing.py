"""Helpers for the data tests: host views of a ``Batch``, an exact AUC, an unreadable file.

Test modules import them by name (``from data_testing import bags``); this is not a
``conftest.py`` (that name is taken by ``tests/conftest.py``).
"""

import builtins
from pathlib import Path

import numpy as np


def bags(kjt):
    """``{key: [[ids of row 0], [ids of row 1], ...]}`` from a KeyedJaggedTensor."""
    lengths = np.asarray(kjt.lengths())
    values = np.asarray(kjt.values())
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    stride = kjt.stride()
    out = {}
    for i, key in enumerate(kjt.keys()):
        out[key] = [
            values[offsets[i * stride + b] : offsets[i * stride + b + 1]].tolist()
            for b in range(stride)
        ]
    return out


def pairwise_auc(labels, scores):
    """AUC by counting all (positive, negative) pairs: ties count 1/2. O(P * N)."""
    labels = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, np.float64)
    pos, neg = scores[labels], scores[~labels]
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return (greater + 0.5 * ties) / (pos.size * neg.size)


def valid_rows(batch):
    """Number of real rows (mask 1), checking that they come first."""
    mask = np.asarray(batch.mask)
    n = int(mask.sum())
    np.testing.assert_array_equal(mask, (np.arange(mask.size) < n).astype(np.float32))
    return n


def deny_read(monkeypatch, path) -> None:
    """Opening ``path`` raises PermissionError for the rest of the test (chmod does not
    stop root, which CI may be)."""
    real_open = builtins.open

    def no_permission(file, *args, **kwargs):
        if Path(file) == Path(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_permission)
