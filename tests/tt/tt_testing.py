"""Shared helpers of the TT tests: layouts, random bags, float64 NumPy oracles.

Test modules import them by name (``from tt_testing import ...``). The oracles are
written from the definition in ``tt_layout.py``'s docstring, not from jaxrec's code::

    # id i -> digits (i0, ..., i_{T-1}) of i in the mixed radix p (i0 most significant)
    # col j -> digits (j0, ..., j_{T-1}) of j in the mixed radix q (j0 most significant)
    # row(i)[j] = G0[:, i0, j0, :] @ G1[:, i1, j1, :] @ ... @ G_{T-1}[:, i_{T-1}, j_{T-1}, :]
    #             (a 1 x 1 matrix: the first and last ranks are 1)

Bags are laid out as FBGEMM's (feature-major offsets, positions past the last offset
are padding)::

    #             b=0      b=1   b=2       <- batch (B = 3, one feature)
    # ids         [7, 7]   []    [0, 96]   padding: [GARBAGE, GARBAGE]
    # offsets = [0, 2, 2, 4]; indices = [7, 7, 0, 96, GARBAGE, GARBAGE]
"""

from __future__ import annotations

import math

import numpy as np

from jaxrec.ops import PoolingMode, TTLayout

GARBAGE_ID = 10**9  # in the padding: reading it would crash, or show in the output
U32 = 2.0**-24  # float32 unit roundoff

_LETTERS = "ijkl"


def layout(n, p, q, ranks) -> TTLayout:
    return TTLayout.create(n, math.prod(q), list(ranks), list(p), list(q))


# Odd p, q and ranks, num_embeddings < prod(p), a q factor of 1 (T = 3).
LAYOUT2 = layout(29, (5, 7), (3, 5), (3,))
LAYOUT3 = layout(97, (3, 5, 7), (3, 1, 5), (3, 5))
LAYOUT4 = layout(197, (3, 5, 2, 7), (1, 3, 2, 3), (3, 5, 3))
LAYOUTS = {2: LAYOUT2, 3: LAYOUT3, 4: LAYOUT4}


def random_cores(rng, lay: TTLayout, row_std: float = 1.0) -> tuple[np.ndarray, ...]:
    """float32 normal cores whose rows have entries of std ~``row_std`` (never zeros)."""
    s = (row_std**2 / math.prod(lay.ranks)) ** (1 / (2 * lay.num_cores))
    return tuple((s * rng.normal(size=shape)).astype(np.float32) for shape in lay.core_shapes)


def rows_numpy(cores, ids, lay: TTLayout) -> np.ndarray:
    """float64 ``[len(ids), D]``: the rows of ``ids``, one einsum of the core slices."""
    ids = np.asarray(ids, np.int64)
    digits = np.unravel_index(ids, lay.p_shapes)  # C order: digit 0 most significant
    g = [np.asarray(c, np.float64) for c in cores]
    t_last = lay.num_cores - 1
    ops, subs = [], []
    for t in range(lay.num_cores):
        j, a, b = _LETTERS[t], chr(ord("a") + t), chr(ord("a") + t + 1)
        slice_t = np.moveaxis(g[t], 1, 0)[digits[t]]  # [n, r_t, q_t, r_t+1]
        if t == 0:
            slice_t, sub = slice_t[:, 0], f"n{j}{b}"
        elif t == t_last:
            slice_t, sub = slice_t[..., 0], f"n{a}{j}"
        else:
            sub = f"n{a}{j}{b}"
        ops.append(slice_t)
        subs.append(sub)
    out = np.einsum(",".join(subs) + "->n" + _LETTERS[:lay.num_cores], *ops)
    return out.reshape(len(ids), lay.embedding_dim)  # C order: column digit 0 most significant


def full_numpy(cores, lay: TTLayout) -> np.ndarray:
    return rows_numpy(cores, np.arange(lay.num_embeddings), lay)


def entry_by_loops(cores, lay: TTLayout, i: int, j: int) -> float:
    """One entry by the matrix chain of the definition, digits by repeated divmod."""
    di, dj = [], []
    for p, q in zip(reversed(lay.p_shapes), reversed(lay.q_shapes)):
        i, r = divmod(i, p)
        di.append(r)
        j, r = divmod(j, q)
        dj.append(r)
    di, dj = di[::-1], dj[::-1]
    m = np.eye(1)
    for t, core in enumerate(cores):
        m = m @ np.asarray(core, np.float64)[:, di[t], dj[t], :]
    return float(m[0, 0])


def random_bags(rng, lay: TTLayout, num_bags: int, *, max_len: int = 5, long_bag: int = 9,
                pad: int = 3, capacity: int | None = None, weighted: bool = False,
                id_pool: int | None = None, dtype=np.int32):
    """``(indices, offsets, psw)`` with empty bags, one long bag, duplicate ids, the ids 0
    and n - 1, and ``pad`` garbage ids past the last offset (or as many as fill
    ``capacity``: one shape, one compile). Weights are in ``±[0.25, 1.5]`` (never zero)."""
    n = lay.num_embeddings
    lengths = rng.integers(1, max_len + 1, num_bags)
    lengths[rng.random(num_bags) < 0.25] = 0
    slots = rng.permutation(num_bags)
    lengths[slots[0]] = 0  # at least one empty bag
    lengths[slots[1]] = long_bag
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(dtype)
    total = int(offsets[-1])
    if capacity is not None:
        pad = capacity - total
        assert pad >= 1, (capacity, total)
    pool_size = id_pool or max(2, total // 3)  # few distinct ids: many duplicates
    pool = np.unique(np.concatenate([[0, n - 1], rng.integers(0, n, pool_size)]))
    ids = rng.choice(pool, total)
    ids[: min(total, 2)] = [0, n - 1][: min(total, 2)]
    indices = np.concatenate([ids, np.full(pad, GARBAGE_ID)]).astype(dtype)
    psw = None
    if weighted:
        psw = (rng.uniform(0.25, 1.5, total + pad) * rng.choice([-1.0, 1.0], total + pad)).astype(np.float32)
    return indices, offsets, psw


def zipf_ids(rng, n: int, size: int, a: float = 1.2, perm=None) -> np.ndarray:
    """Ids whose frequency falls as ``1 / rank**a`` (rank through a fixed permutation)."""
    perm = np.arange(n) if perm is None else perm
    prob = 1.0 / np.arange(1, n + 1) ** a
    return perm[rng.choice(n, size, p=prob / prob.sum())]


def pool_numpy(table, indices, offsets, pooling, psw=None, num_features: int = 1) -> np.ndarray:
    """float64 ``[B, F * D]``: each bag's (weighted) sum or mean of rows of ``table``."""
    table = np.asarray(table, np.float64)
    num_bags = len(offsets) - 1
    batch, dim = num_bags // num_features, table.shape[1]
    out = np.zeros((batch, num_features * dim))
    for k in range(num_bags):
        f, b = divmod(k, batch)
        lo, hi = int(offsets[k]), int(offsets[k + 1])
        if hi == lo:
            continue
        w = np.ones(hi - lo) if psw is None else np.asarray(psw[lo:hi], np.float64)
        bag = (w[:, None] * table[np.asarray(indices[lo:hi], np.int64)]).sum(0)
        out[b, f * dim:(f + 1) * dim] = bag / (hi - lo) if pooling == PoolingMode.MEAN else bag
    return out


def pooled_rows_numpy(cores, lay, indices, offsets, pooling, psw=None, num_features=1):
    """``pool_numpy`` of the rows of ``cores`` (only the ids in bags are decompressed)."""
    used = np.asarray(indices[: int(offsets[-1])], np.int64)
    ids, inverse = np.unique(used, return_inverse=True)
    table = rows_numpy(cores, ids, lay)
    local = np.concatenate([inverse, np.zeros(len(indices) - len(used), np.int64)])
    return pool_numpy(table, local, offsets, pooling, psw, num_features)


def error_bound(cores, lay, indices, offsets, pooling, psw, num_features, max_len):
    """A float32 rounding-error bound of each output: ``gamma * pool(|rows|(|cores|), |w|)``.

    A row entry is a sum of products over the rank paths; a bag a sum of at most
    ``max_len`` scaled rows. With unit roundoff ``u`` the error of any summation order is
    at most ``(terms) * u`` times the sum of the absolute values of the terms (Higham).
    """
    abs_cores = [np.abs(np.asarray(c, np.float64)) for c in cores]
    abs_w = None if psw is None else np.abs(psw)
    magnitude = pooled_rows_numpy(abs_cores, lay, indices, offsets, pooling, abs_w, num_features)
    gamma = 2 * (sum(lay.ranks) + lay.num_cores + max_len + 3) * U32
    return gamma * magnitude


def bag_segments(offsets, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(segment, length)`` of each position: its bag (``num_bags`` for padding), its bag's length."""
    num_bags = len(offsets) - 1
    seg = np.full(n, num_bags, np.int32)
    length = np.ones(n, np.float32)
    for k in range(num_bags):
        seg[offsets[k]:offsets[k + 1]] = k
        length[offsets[k]:offsets[k + 1]] = offsets[k + 1] - offsets[k]
    return seg, length
