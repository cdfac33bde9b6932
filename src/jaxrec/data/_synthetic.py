"""A synthetic click log with Criteo's shape and a hidden teacher model, deterministic per seed.

Each sample has 13 dense features, one bag of ids per categorical feature ``C1..C26`` and a
label drawn from a *teacher* that a model can learn, so a training run that works shows an
AUC clearly above 0.5 (``teacher_auc()`` is the ceiling)::

    ids      rank r of feature j is drawn with P(r) ~ 1 / (r + 1) ** zipf_exponent over
             r in [0, table_sizes[j]) (continuous inverse-CDF approximation of Zipf);
             id = r, or a fixed random permutation of r (scatter_ids=True) so that hot ids
             are spread over the table as hashing spreads them in real logs
    lengths  per (feature, sample) from BagLengths: fixed 1 (one-hot, default), Poisson or
             uniform -> jagged bags
    dense    log(1 + floor(LogNormal(mu_i, sigma_i))), like Criteo counts after the DLRM
             transform
    teacher  e(j, id) in R^(dim+1): a pseudo-random vector hashed from (seed, j, id), so no
             table is stored; per sample pool e_j = sum over the bag / sqrt(mean length_j),
             logit = 1.0 * w . dense                      (w ~ N(0, 1/13))
                   + 1.0 * sum_j e_j[dim] / sqrt(26)       (first-order id biases)
                   + 1.5 * sum_{j<k} <e_j[:dim], e_k[:dim]> / sqrt(325 dim)   (DLRM-style
                     pairwise dot products)
                   + b,    b chosen so that the mean click rate is ``click_rate``
    label    Bernoulli(sigmoid(logit))

Batch ``i`` of size ``B`` depends only on ``(seed, i, B)``; any batch can be regenerated
(a process's part of it, ``batches(shard=)``, on its own).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from jaxrec.data._batch import (
    Batch,
    check_batch_size,
    check_shard,
    check_table_sizes,
    make_batch,
)
from jaxrec.data._criteo import CRITEO_KAGGLE_CARDINALITIES, dense_log1p
from jaxrec.metrics import auc

_DISTRIBUTIONS = ("fixed", "poisson", "uniform")
_STREAM_SAMPLES, _STREAM_AUC, _STREAM_CALIBRATION = 1, 2, 3
_DENSE_SCALE, _FIRST_ORDER_SCALE, _PAIR_SCALE = 1.0, 1.0, 1.5
_MAX_POISSON_MEAN = 1e18  # NumPy refuses larger (and infinite) means when sampling


@dataclasses.dataclass(frozen=True, kw_only=True)
class BagLengths:
    """How many ids one (sample, feature) bag holds.

    * ``"fixed"``: every bag has ``length`` ids (default 1: one-hot, like Criteo).
    * ``"poisson"``: ``Poisson(mean)`` clipped to ``[min_length, max_length]``.
    * ``"uniform"``: an integer uniform in ``[min_length, max_length]``.

    Bags of length 0 are empty bags. ``max_bag`` bounds the static KJT capacity.
    """

    distribution: str = "fixed"
    """One of "fixed", "poisson", "uniform"."""
    length: int = 1
    """The length of every bag ("fixed")."""
    mean: float = 1.0
    """The Poisson mean ("poisson")."""
    min_length: int = 0
    """Smallest length ("poisson", "uniform")."""
    max_length: int = 1
    """Largest length ("poisson", "uniform")."""

    def __post_init__(self):
        if self.distribution not in _DISTRIBUTIONS:
            raise ValueError(
                f"distribution must be one of {_DISTRIBUTIONS}, got {self.distribution!r}."
            )
        if self.distribution == "fixed" and self.length < 0:
            raise ValueError(f"length must be >= 0, got length={self.length}.")
        if self.distribution != "fixed" and not 0 <= self.min_length <= self.max_length:
            raise ValueError(
                "need 0 <= min_length <= max_length, got "
                f"min_length={self.min_length}, max_length={self.max_length}."
            )
        if self.distribution == "poisson" and not 0 < self.mean <= _MAX_POISSON_MEAN:
            raise ValueError(f"mean must be in (0, {_MAX_POISSON_MEAN:g}] (NumPy's Poisson "
                             f"limit; lengths are clipped to max_length anyway), got "
                             f"mean={self.mean}.")

    @property
    def max_bag(self) -> int:
        return self.length if self.distribution == "fixed" else self.max_length

    @property
    def typical(self) -> float:
        """A typical length (the teacher divides pooled sums by its square root)."""
        if self.distribution == "fixed":
            return float(self.length)
        if self.distribution == "uniform":
            return (self.min_length + self.max_length) / 2
        return float(np.clip(self.mean, self.min_length, self.max_length))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.distribution == "fixed":
            return np.full((n,), self.length, np.int32)
        if self.distribution == "uniform":
            return rng.integers(self.min_length, self.max_length + 1, n).astype(np.int32)
        return np.clip(rng.poisson(self.mean, n), self.min_length, self.max_length).astype(np.int32)


class SyntheticSample(NamedTuple):
    """Host arrays of ``n`` samples; ``lengths`` int32[F, n] and ``values`` int64 key-major."""

    dense: np.ndarray  # float32[n, num_dense]
    values: np.ndarray  # int64[sum(lengths)]
    lengths: np.ndarray  # int32[num_features, n]
    labels: np.ndarray  # float32[n], 0 or 1
    probabilities: np.ndarray  # float32[n], the teacher's P(label = 1)


class SyntheticClickLog:
    """A deterministic synthetic click log (see the module docstring for the model).

    Args:
      num_embeddings_per_feature: one table size per feature (features ``C1..Cn``);
        default the 26 Criteo Kaggle cardinalities.
      max_rows: caps every table size (e.g. 100_000 for a laptop-sized model).
      num_dense: dense features per sample.
      zipf_exponent: skew of the ids (0 = uniform; ~1.1 is typical of click logs).
      bag_lengths: one ``BagLengths`` for all features, or one per feature.
      click_rate: the mean label the teacher's intercept is calibrated to.
      teacher_dim: dimension of the teacher's embeddings.
      scatter_ids: map Zipf ranks to ids through a fixed random permutation.
      seed: a non-negative int; everything is a function of it.
    """

    def __init__(
        self,
        *,
        num_embeddings_per_feature: int | Sequence[int] = CRITEO_KAGGLE_CARDINALITIES,
        max_rows: int | None = None,
        num_dense: int = 13,
        zipf_exponent: float = 1.1,
        bag_lengths: BagLengths | Sequence[BagLengths] = BagLengths(),
        click_rate: float = 0.25,
        teacher_dim: int = 8,
        scatter_ids: bool = False,
        seed: int = 0,
    ):
        if isinstance(num_embeddings_per_feature, (int, np.integer)):
            raise TypeError(
                "num_embeddings_per_feature must list one size per feature, e.g. [1000] * 26."
            )
        sizes = check_table_sizes(
            num_embeddings_per_feature, len(num_embeddings_per_feature),
            "num_embeddings_per_feature",
        )
        if not sizes:
            raise ValueError("num_embeddings_per_feature is empty; pass one size per feature.")
        if max_rows is not None:
            sizes = tuple(min(s, check_batch_size(max_rows, "max_rows")) for s in sizes)
        self.table_sizes = sizes
        num_features = len(sizes)
        self.keys = tuple(f"C{j + 1}" for j in range(num_features))
        if isinstance(bag_lengths, BagLengths):
            bag_lengths = (bag_lengths,) * num_features
        self.bag_lengths = tuple(bag_lengths)
        if len(self.bag_lengths) != num_features or not all(
            isinstance(b, BagLengths) for b in self.bag_lengths
        ):
            raise ValueError(
                f"bag_lengths must be one BagLengths or {num_features} of them (one per "
                f"feature), got {bag_lengths!r}."
            )
        if not zipf_exponent >= 0:
            raise ValueError(f"zipf_exponent must be >= 0, got {zipf_exponent}.")
        if not 0 < click_rate < 1:
            raise ValueError(f"click_rate must be in (0, 1), got {click_rate}.")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}.")
        if isinstance(num_dense, bool) or not isinstance(num_dense, int) or num_dense < 0:
            raise ValueError(f"num_dense must be an int >= 0, got {num_dense!r}.")
        self.num_dense = num_dense
        self.zipf_exponent = float(zipf_exponent)
        self.click_rate = float(click_rate)
        self.teacher_dim = check_batch_size(teacher_dim, "teacher_dim")
        self.seed = int(seed)

        rng = np.random.default_rng([self.seed, 0])
        self._w = rng.normal(size=self.num_dense) / math.sqrt(max(self.num_dense, 1))
        self._mu = rng.uniform(0.0, 3.0, self.num_dense)
        self._sigma = rng.uniform(0.5, 1.5, self.num_dense)
        self._scatter = [_coprime_affine(rng, n) if scatter_ids else (1, 0) for n in sizes]
        self._intercept = 0.0
        *_, logits = self._draw(self._rng(_STREAM_CALIBRATION, 0, 8192), 8192)
        self._intercept = _calibrate(logits, self.click_rate)

    @property
    def capacity_per_sample(self) -> int:
        """Ids one sample can hold at most (the KJT capacity is ``B`` times this)."""
        return sum(b.max_bag for b in self.bag_lengths)

    def _rng(self, stream: int, index: int, n: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, stream, index, n])

    def sample(self, num_samples: int, *, index: int = 0) -> SyntheticSample:
        """``num_samples`` samples, a function of ``(seed, index, num_samples)``."""
        num_samples = check_batch_size(num_samples, "num_samples")
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
            raise ValueError(f"index must be a non-negative int, got {index!r}.")
        return self._sample(self._rng(_STREAM_SAMPLES, index, num_samples), num_samples)

    def _sample(self, rng: np.random.Generator, n: int) -> SyntheticSample:
        dense, values, lengths, logits = self._draw(rng, n)
        probs = 1.0 / (1.0 + np.exp(-logits))
        labels = (rng.random(n) < probs).astype(np.float32)
        return SyntheticSample(dense, values, lengths, labels, probs.astype(np.float32))

    def batches(
        self, batch_size: int, num_batches: int | None = None, *, start: int = 0,
        shard: tuple[int, int] = (0, 1),
    ) -> Iterator[Batch]:
        """Batches ``start, start + 1, ...`` (``num_batches`` of them, or endless).

        ``shard=(k, n)``: only part ``k`` of ``n`` of each batch, for one of ``n`` processes
        (docs/multiprocess.md): ``batch_size // n`` samples, a function of ``(seed, i * n +
        k, batch_size // n)``, so no process draws another's samples. ``(0, 1)`` is the
        whole batch."""
        batch_size = check_batch_size(batch_size)
        k, n = check_shard(shard)
        if batch_size % n:
            raise ValueError(f"batch_size={batch_size} does not split into the {n} parts of "
                             f"shard={shard}; pass a multiple of {n}.")
        size = batch_size // n
        capacity = size * self.capacity_per_sample
        i = start
        while num_batches is None or i < start + num_batches:
            s = self.sample(size, index=i * n + k)
            yield make_batch(self.keys, s.values, s.lengths, s.dense, s.labels, size, capacity)
            i += 1

    def teacher_auc(self, num_samples: int = 20000) -> float:
        """AUC of the teacher's probabilities against its own labels on a held-out sample
        (a stream of its own): the ceiling for a model trained on this log."""
        num_samples = check_batch_size(num_samples, "num_samples")
        s = self._sample(self._rng(_STREAM_AUC, 0, num_samples), num_samples)
        return auc(s.labels, s.probabilities)

    def _draw(self, rng: np.random.Generator, n: int):
        raw = np.floor(rng.lognormal(self._mu, self._sigma, (n, self.num_dense)))
        dense = dense_log1p(raw)
        lengths = np.stack([b.sample(rng, n) for b in self.bag_lengths])
        # Every feature's ids in one pass (feature-major): the same draws, in the same order,
        # as one feature at a time. `feature`: the feature of each id.
        feature = np.repeat(np.arange(len(self.table_sizes)), lengths.sum(1))
        sizes = np.asarray(self.table_sizes, np.int64)
        ranks = _zipf_ranks(rng, sizes, feature, self.zipf_exponent)
        a, c = (np.asarray(v, np.int64)[feature] for v in zip(*self._scatter))
        values = (ranks * a + c) % sizes[feature]
        return dense, values, lengths, self._logits(dense, values, lengths, feature) + self._intercept

    def _logits(self, dense: np.ndarray, values: np.ndarray, lengths: np.ndarray,
                feature: np.ndarray) -> np.ndarray:
        num_features, n = lengths.shape
        dim = self.teacher_dim
        logit = _DENSE_SCALE * (dense.astype(np.float64) @ self._w)
        if num_features == 0:
            return logit
        # Every feature's ids at once (feature-major, as `values`): their embeddings, the
        # sum of each bag (an empty bag sums to 0), scaled by its feature's typical length.
        emb = _hash_uniform(_feature_keys(self.seed, num_features)[feature], values, dim + 1)
        bag_lengths = lengths.reshape(-1)
        if (bag_lengths == 1).all():  # one id a bag (the default log): the bags are the ids
            pooled = emb
        else:
            starts = np.concatenate([[0], np.cumsum(bag_lengths)[:-1]])
            pooled = np.zeros((num_features * n, dim + 1))
            full = bag_lengths > 0
            if full.any():
                pooled[full] = np.add.reduceat(emb, starts[full], axis=0)
        scale = [1.0 / math.sqrt(max(b.typical, 1.0)) for b in self.bag_lengths]
        pooled = pooled.reshape(num_features, n, dim + 1) * np.asarray(scale)[:, None, None]
        logit += _FIRST_ORDER_SCALE * pooled[..., dim].sum(0) / math.sqrt(num_features)
        if num_features > 1:
            vecs = pooled[..., :dim]
            total = vecs.sum(0)
            pairs = ((total * total).sum(-1) - (vecs * vecs).sum((0, 2))) / 2
            logit += _PAIR_SCALE * pairs / math.sqrt(num_features * (num_features - 1) / 2 * dim)
        return logit


def _zipf_ranks(rng: np.random.Generator, sizes: np.ndarray, table: np.ndarray, s: float) -> np.ndarray:
    """A rank in ``[0, sizes[table[i]])`` for each entry i, with ``P(r) ~ (r + 1) ** -s``
    (continuous inverse CDF on [1, n+1)); ``table`` sorted, so each table's draws are
    consecutive."""
    u = rng.random(len(table))
    if s == 0:
        x = 1.0 + u * sizes.astype(np.float64)[table]
    elif abs(s - 1.0) < 1e-12:
        x = np.exp(u * np.array([math.log(n + 1.0) for n in sizes.tolist()])[table])
    else:
        t = 1.0 - s
        x = (1.0 + u * np.array([(n + 1.0) ** t - 1.0 for n in sizes.tolist()])[table]) ** (1.0 / t)
    return np.clip(np.floor(x).astype(np.int64) - 1, 0, sizes[table] - 1)


def _coprime_affine(rng: np.random.Generator, n: int) -> tuple[int, int]:
    """``(a, c)`` with ``gcd(a, n) == 1``: ``r -> (a r + c) % n`` permutes ``[0, n)``."""
    if n == 1:
        return 1, 0
    while True:
        a = int(rng.integers(1, n))
        if math.gcd(a, n) == 1:
            return a, int(rng.integers(0, n))


_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer (a bijection on uint64 with good avalanche), in place: pass
    an array of your own."""
    x ^= x >> _U64(30)
    x *= _U64(0xBF58476D1CE4E5B9)
    x ^= x >> _U64(27)
    x *= _U64(0x94D049BB133111EB)
    x ^= x >> _U64(31)
    return x


def _feature_keys(seed: int, num_features: int) -> np.ndarray:
    """The hash key of each feature's teacher embeddings."""
    features = np.arange(1, num_features + 1, dtype=_U64)
    return _mix(_mix(np.array([seed], _U64) + _GOLDEN) ^ features * _GOLDEN)


def _hash_uniform(keys: np.ndarray, ids: np.ndarray, dim: int) -> np.ndarray:
    """Pseudo-random float64[len(ids), dim], uniform with mean 0 and variance 1, a pure
    function of ``(key, id, component)`` (``keys``: one per id, from ``_feature_keys``)."""
    x = ids.astype(_U64)[:, None] * _U64(dim) + np.arange(dim, dtype=_U64)[None, :]
    x += keys[:, None]
    h = _mix(x)
    h += _GOLDEN
    h = _mix(h)
    u = (h >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return (u - 0.5) * math.sqrt(12.0)


def _calibrate(logits: np.ndarray, rate: float) -> float:
    """The intercept ``b`` with ``mean(sigmoid(logits + b)) == rate`` (bisection)."""
    lo, hi = -30.0 - logits.max(), 30.0 - logits.min()
    for _ in range(100):
        mid = (lo + hi) / 2
        if np.mean(1.0 / (1.0 + np.exp(-(logits + mid)))) < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
