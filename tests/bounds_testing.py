"""Random corrupted TBE input and an independent NumPy model of FBGEMM's bounds check
(the standalone op's tests and the lookup's own check share them)."""

import numpy as np

from jaxrec.ops import BoundsCheckMode

PADDING = -12345  # garbage in the padding: out of range, so touching it would show


def fbgemm_model(rows, indices, offsets, mode):
    """FBGEMM's bag-by-bag loop (in place, sequential), with jaxrec's two documented
    differences: padding after the last offset is legal, and -1 is not special."""
    indices, offsets = indices.copy(), offsets.copy()
    n, num_bags = len(indices), len(offsets) - 1
    batch_size = num_bags // len(rows) if len(rows) else 1
    warnings = 0
    for k in range(num_bags):
        start, end = offsets[k], offsets[k + 1]
        if start < 0 or start > end or end > n:
            warnings += 1
            start = max(0, min(start, n))
            end = max(start, min(end, n))
            offsets[k], offsets[k + 1] = start, end
        for p in range(start, end):
            if not 0 <= indices[p] < rows[k // batch_size]:
                warnings += 1
                indices[p] = 0
    if num_bags == 0:
        offsets[0] = max(0, min(offsets[0], n))
    return indices, offsets, warnings if mode == BoundsCheckMode.WARNING else 0


def random_case(rng, dtype=np.int32, corrupt=True):
    """T features x B bags with empty bags, duplicate ids, padding, and (if corrupt)
    bad ids and offsets: negative, past the end, decreasing."""
    num_features, batch_size = int(rng.integers(1, 5)), int(rng.integers(0, 6))
    rows = rng.integers(1, 50, size=num_features)
    lengths = rng.integers(0, 4, size=num_features * batch_size) * (rng.random(num_features * batch_size) < 0.8)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(dtype)
    total = int(offsets[-1])
    capacity = total + int(rng.integers(0, 5))
    indices = np.full(capacity, PADDING, dtype)
    for k in range(num_features * batch_size):
        ids = rng.integers(0, rows[k // batch_size], size=lengths[k])
        indices[offsets[k]:offsets[k + 1]] = ids
    if corrupt and total:
        bad = rng.random(total) < 0.15
        indices[:total][bad] = rng.choice([-1, -7, 50, 10**6], size=bad.sum())
        for _ in range(int(rng.integers(0, 3))):
            offsets[rng.integers(0, len(offsets))] = rng.choice([-3, capacity + 2, total // 2])
    return rows, indices, offsets
