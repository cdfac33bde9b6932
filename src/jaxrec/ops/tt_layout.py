"""The shape of a tensor-train (TT) embedding table: ``TTLayout`` and FBTT's factorisation.

A ``num_embeddings × embedding_dim`` table is stored as T small cores (TT-Rec, FBTT)::

    # p = [p0, p1, p2] (prod >= num_embeddings), q = [q0, q1, q2] (prod == embedding_dim)
    # r = [1, r1, r2, 1]                      core t: float32[r[t], p[t], q[t], r[t+1]]
    # id i -> digits (i0, i1, i2), i = (i0 * p1 + i1) * p2 + i2   (i0 most significant)
    # row(i)[(j0 * q1 + j1) * q2 + j2] = sum_{a,b} G0[0,i0,j0,a] G1[a,i1,j1,b] G2[b,i2,j2,0]

Row ``i`` is the chain of matrix products of the core slices its digits select; column
``j`` is read with ``j0`` most significant too. This is FBTT's convention
(``tt_matrix_to_full``), so cores move between the two libraries by a transpose:
FBTT stores core t as ``[p, r * q * r']``; jaxrec keeps the logical ``[r, p, q, r']``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class TTLayout:
    """The factorisation of one TT table (static: hashable, a ``jit`` constant)."""

    num_embeddings: int
    """Rows of the table (ids are ``0 <= id < num_embeddings``)."""
    embedding_dim: int
    """Columns of the table."""
    p_shapes: tuple[int, ...]
    """Row factors, ``prod(p_shapes) >= num_embeddings``."""
    q_shapes: tuple[int, ...]
    """Column factors, ``prod(q_shapes) == embedding_dim``."""
    ranks: tuple[int, ...]
    """All T + 1 ranks, ``[1] + tt_ranks + [1]``."""

    @classmethod
    def create(cls, num_embeddings: int, embedding_dim: int, tt_ranks, tt_p_shapes=None,
               tt_q_shapes=None) -> TTLayout:
        """FBTT's constructor arguments; ``None`` shapes are factorised by ``suggested_tt_shapes``."""
        _check_positive("num_embeddings", num_embeddings)
        _check_positive("embedding_dim", embedding_dim)
        tt_ranks = _int_tuple("tt_ranks", tt_ranks)
        num_cores = len(tt_ranks) + 1
        if not 2 <= num_cores <= 4:
            raise ValueError(f"tt_ranks must have 1 to 3 entries (2 to 4 cores, as FBTT), got "
                             f"{list(tt_ranks)}")
        p = (suggested_tt_shapes(num_embeddings, num_cores) if tt_p_shapes is None
             else _int_tuple("tt_p_shapes", tt_p_shapes))
        q = (suggested_tt_shapes(embedding_dim, num_cores, allow_round_up=False)
             if tt_q_shapes is None else _int_tuple("tt_q_shapes", tt_q_shapes))
        return cls(num_embeddings=int(num_embeddings), embedding_dim=int(embedding_dim),
                   p_shapes=p, q_shapes=q, ranks=(1, *tt_ranks, 1))

    def __post_init__(self):
        t = self.num_cores
        if len(self.p_shapes) != t or len(self.q_shapes) != t:
            raise ValueError(f"tt_p_shapes {list(self.p_shapes)} and tt_q_shapes "
                             f"{list(self.q_shapes)} must both have len(tt_ranks) + 1 = {t} entries")
        if self.ranks[0] != 1 or self.ranks[-1] != 1:
            raise ValueError(f"ranks must start and end with 1, got {list(self.ranks)}")
        if math.prod(self.p_shapes) < self.num_embeddings:
            raise ValueError(f"prod(tt_p_shapes) = {math.prod(self.p_shapes)} must be >= "
                             f"num_embeddings = {self.num_embeddings}; enlarge a factor of "
                             f"{list(self.p_shapes)} or pass tt_p_shapes=None to factorise")
        if math.prod(self.q_shapes) != self.embedding_dim:
            raise ValueError(f"prod(tt_q_shapes) = {math.prod(self.q_shapes)} must equal "
                             f"embedding_dim = {self.embedding_dim}; pass tt_q_shapes=None to factorise")
        if math.prod(self.p_shapes) >= 2**31:
            raise ValueError(f"prod(tt_p_shapes) = {math.prod(self.p_shapes)} must be < 2**31 "
                             "(ids are int32 inside the TT kernels)")

    @property
    def num_cores(self) -> int:
        return len(self.ranks) - 1

    @property
    def core_shapes(self) -> tuple[tuple[int, int, int, int], ...]:
        """``(r[t], p[t], q[t], r[t+1])`` of each core."""
        r = self.ranks
        return tuple((r[t], self.p_shapes[t], self.q_shapes[t], r[t + 1])
                     for t in range(self.num_cores))

    @property
    def num_parameters(self) -> int:
        """Floats in all cores."""
        return sum(math.prod(s) for s in self.core_shapes)

    @property
    def compression_ratio(self) -> float:
        """Floats of the dense table over floats of the cores."""
        return self.num_embeddings * self.embedding_dim / self.num_parameters

    @property
    def digit_strides(self) -> tuple[int, ...]:
        """``P_t = p[t+1] * ... * p[T-1]``: digit t of id i is ``(i // P_t) % p[t]``."""
        return tuple(math.prod(self.p_shapes[t + 1:]) for t in range(self.num_cores))

    def digits(self, ids: jax.Array) -> list[jax.Array]:
        """The T digits of each id (int32 arrays shaped like ``ids``)."""
        ids = jnp.asarray(ids).astype(jnp.int32)
        return [(ids // s) % p for s, p in zip(self.digit_strides, self.p_shapes)]

    def validate_cores(self, cores, argument: str = "cores") -> tuple[jax.Array, ...]:
        """``cores`` as a tuple, after checking their number, shapes and dtype."""
        cores = tuple(cores)
        if len(cores) != self.num_cores:
            raise ValueError(f"{argument} must hold {self.num_cores} cores, got {len(cores)}")
        for t, (core, shape) in enumerate(zip(cores, self.core_shapes)):
            if tuple(core.shape) != shape or core.dtype != jnp.float32:
                raise ValueError(f"{argument}[{t}] must be float32{list(shape)} "
                                 f"(r[t], p[t], q[t], r[t+1]), got {core.dtype}{list(core.shape)}")
        return cores


def suggested_tt_shapes(n: int, d: int = 3, allow_round_up: bool = True) -> tuple[int, ...]:
    """``d`` factors of ``n`` (or of ``n`` rounded up) that are as even as possible (FBTT's rule).

    FBTT picks, over the factorisations of ``n`` into ``d`` factors, the one of highest
    entropy (the most even), and with ``allow_round_up`` also tries ``n`` rounded up to
    each power of ten (``1234 -> 1240, 1300, 2000``), keeping the best. The factors come
    back in ascending order, so the largest core is the last.
    """
    _check_positive("n", n)
    _check_positive("d", d)
    candidates = [n]
    if allow_round_up:
        candidates += [-(-n // 10**k) * 10**k for k in range(1, len(str(n)))]
    best = max((_most_even_factors(c, d) for c in dict.fromkeys(candidates)), key=_entropy)
    return best


def _entropy(factors: tuple[int, ...]) -> float:
    x = np.asarray(factors, np.float64)
    w = x / x.sum()
    return float(-(w * np.log(w)).sum())


@functools.cache
def _most_even_factors(n: int, d: int) -> tuple[int, ...]:
    """The factorisation ``n = f1 * ... * fd`` (ascending) of highest entropy."""
    best: tuple[int, ...] = ()

    def search(rest: int, k: int, low: int, prefix: tuple[int, ...]):
        nonlocal best
        if k == 1:
            if rest >= low:
                cand = prefix + (rest,)
                if not best or _entropy(cand) > _entropy(best):
                    best = cand
            return
        # f ranges over divisors of rest with low <= f <= rest ** (1/k) (ascending factors).
        f = low
        while f ** k <= rest:
            if rest % f == 0:
                search(rest // f, k - 1, f, prefix + (f,))
            f += 1

    search(n, d, 1, ())
    return best


def _int_tuple(name: str, values) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in values)
    except TypeError:
        raise TypeError(f"{name} must be a list of ints, got {values!r}") from None
    if not out or any(v < 1 or isinstance(v, bool) for v in out) or any(
            isinstance(v, bool) for v in values):
        raise ValueError(f"{name} must be a non-empty list of ints >= 1, got {list(values)}")
    return out


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")

