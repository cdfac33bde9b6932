"""SyntheticClickLog: determinism, Zipf skew, label rate, the teacher's AUC, jagged bags."""

import math

import numpy as np
import pytest
from data_testing import bags, pairwise_auc

from jaxrec import metrics
from jaxrec.data import (
    CRITEO_KAGGLE_CARDINALITIES,
    BagLengths,
    SyntheticClickLog,
)


def batch_arrays(batch):
    return [np.asarray(x) for x in (batch.dense, batch.sparse.values(),
                                    batch.sparse.lengths(), batch.labels)]


def test_criteo_cardinalities_and_cap():
    assert len(CRITEO_KAGGLE_CARDINALITIES) == 26
    assert max(CRITEO_KAGGLE_CARDINALITIES) == 10131227 and min(CRITEO_KAGGLE_CARDINALITIES) == 3
    log = SyntheticClickLog(max_rows=1000)
    assert log.table_sizes == tuple(min(c, 1000) for c in CRITEO_KAGGLE_CARDINALITIES)
    assert log.keys == tuple(f"C{j}" for j in range(1, 27))
    s = log.sample(3000)
    start = 0
    for j, size in enumerate(log.table_sizes):
        ids = s.values[start : start + int(s.lengths[j].sum())]
        assert ids.min() >= 0 and ids.max() < size
        assert ids.max() >= size // 2  # the whole table is reachable, not only the head
        start += ids.size


def test_deterministic_given_seed():
    a = SyntheticClickLog(max_rows=500, seed=7)
    b = SyntheticClickLog(max_rows=500, seed=7)
    c = SyntheticClickLog(max_rows=500, seed=8)
    batches_a = [batch_arrays(x) for x in a.batches(64, 3)]
    batches_b = [batch_arrays(x) for x in b.batches(64, 3)]
    for xa, xb in zip(batches_a, batches_b):
        for u, v in zip(xa, xb):
            np.testing.assert_array_equal(u, v)
    xc = batch_arrays(next(c.batches(64)))
    assert not np.array_equal(batches_a[0][1], xc[1])
    assert not np.array_equal(batches_a[0][0], xc[0])
    # batch i depends on (seed, i, B) only: start=2 regenerates the third batch
    again = batch_arrays(next(a.batches(64, start=2)))
    for u, v in zip(again, batches_a[2]):
        np.testing.assert_array_equal(u, v)
    assert not np.array_equal(batches_a[0][1], batches_a[1][1])


@pytest.mark.parametrize("scatter", [False, True])
def test_zipf_skew(scatter):
    n = 1000
    log = SyntheticClickLog(num_embeddings_per_feature=[n], num_dense=2, zipf_exponent=1.1,
                            scatter_ids=scatter, seed=1)
    ids = log.sample(100_000).values
    counts = np.sort(np.bincount(ids, minlength=n))[::-1]
    assert counts[:10].sum() / ids.size > 0.3  # uniform would give 0.01
    assert counts[0] > 50 * np.median(counts)
    # log-log slope of frequency vs rank is about -exponent
    ranks = np.arange(1, 41)
    slope = np.polyfit(np.log(ranks + 0.5), np.log(counts[:40]), 1)[0]
    assert -1.3 < slope < -0.9, slope
    top = np.bincount(ids, minlength=n).argmax()
    assert (top == 0) != scatter  # scatter_ids moves the hot id away from row 0

    flat = SyntheticClickLog(num_embeddings_per_feature=[n], num_dense=2, zipf_exponent=0.0)
    counts = np.bincount(flat.sample(100_000).values, minlength=n)
    assert np.sort(counts)[::-1][:10].sum() / 100_000 < 0.02


@pytest.mark.parametrize("rate", [0.25, 0.1])
def test_label_rate(rate):
    log = SyntheticClickLog(max_rows=10_000, click_rate=rate, seed=3)
    labels = np.concatenate([np.asarray(b.labels) for b in log.batches(1000, 10)])
    assert set(np.unique(labels).tolist()) == {0.0, 1.0}
    assert abs(labels.mean() - rate) < 0.02, labels.mean()


def test_teacher_auc_is_well_above_chance():
    log = SyntheticClickLog(max_rows=10_000, seed=0)
    s = log.sample(3000, index=99)
    auc = pairwise_auc(s.labels, s.probabilities)
    assert auc > 0.7, auc
    assert metrics.auc(s.labels, s.probabilities) == pytest.approx(auc, abs=1e-12)
    ceiling = log.teacher_auc()
    assert 0.7 < ceiling < 0.99 and abs(ceiling - auc) < 0.05
    # the labels depend on the ids: the hottest id of a feature has its own click rate
    first = s.values[: s.lengths[0].sum()]
    assert len(np.unique(s.probabilities[first == 0])) > 1  # and on the rest


def test_labels_depend_on_ids_and_dense():
    """A label model from the ids alone (a per-id click rate of C1..C26 summed in logit
    space) and from the dense features alone both beat chance on held-out data."""
    log = SyntheticClickLog(max_rows=20, num_dense=13, seed=5)
    train, test = log.sample(20_000, index=0), log.sample(5000, index=1)

    def id_score(sample, table):
        return sum(table[j][sample.values[j * len(sample.labels):(j + 1) * len(sample.labels)]]
                   for j in range(26))

    table = []
    n = len(train.labels)
    for j in range(26):
        ids = train.values[j * n:(j + 1) * n]
        clicks = np.bincount(ids, train.labels, minlength=20) + 1
        shows = np.bincount(ids, minlength=20) + 4
        table.append(np.log(clicks / (shows - clicks)))
    assert metrics.auc(test.labels, id_score(test, table)) > 0.6
    w = np.linalg.lstsq(np.c_[train.dense, np.ones(n)], train.labels, rcond=None)[0]
    assert metrics.auc(test.labels, np.c_[test.dense, np.ones(len(test.labels))] @ w) > 0.55


@pytest.mark.parametrize(
    "lengths,lo,hi,mean",
    [(BagLengths(distribution="poisson", mean=3.0, min_length=0, max_length=8), 0, 8, 3.0),
     (BagLengths(distribution="uniform", min_length=1, max_length=5), 1, 5, 3.0),
     (BagLengths(length=2), 2, 2, 2.0)],
)
def test_multi_hot_bags(lengths, lo, hi, mean):
    log = SyntheticClickLog(max_rows=100, bag_lengths=lengths, seed=2)
    batch = next(log.batches(256))
    assert batch.sparse.capacity == 256 * 26 * hi
    lens = np.asarray(batch.sparse.lengths())
    assert lens.min() >= lo and lens.max() <= hi and abs(lens.mean() - mean) < 0.15
    if lengths.distribution != "fixed":
        assert lens.min() == lo and lens.max() == hi  # the whole range is used
    # the KJT holds exactly the sample's bags, key-major
    s = log.sample(256, index=0)
    np.testing.assert_array_equal(lens, s.lengths.reshape(-1))
    got = bags(batch.sparse)
    flat = [i for key in log.keys for bag in got[key] for i in bag]
    assert flat == s.values.tolist()
    assert np.asarray(batch.mask).all()


def test_bag_lengths_per_feature_and_teacher_with_empty_bags():
    per_feature = [BagLengths(length=1)] * 2 + [BagLengths(distribution="poisson", mean=1.0,
                                                           max_length=4)]
    log = SyntheticClickLog(num_embeddings_per_feature=[50, 60, 70], bag_lengths=per_feature,
                            seed=4)
    s = log.sample(4000)
    assert (s.lengths[:2] == 1).all() and (s.lengths[2] == 0).any() and s.lengths[2].max() == 4
    assert log.capacity_per_sample == 6
    assert log.teacher_auc(5000) > 0.7


def test_argument_errors():
    with pytest.raises(ValueError, match=r"distribution must be one of"):
        BagLengths(distribution="zipf")
    with pytest.raises(ValueError, match=r"min_length <= max_length"):
        BagLengths(distribution="uniform", min_length=3, max_length=2)
    for mean in (0.0, float("nan"), float("inf"), 1e30):
        with pytest.raises(ValueError, match=r"mean must be in \(0, 1e\+18\]"):
            BagLengths(distribution="poisson", mean=mean, max_length=4)
    with pytest.raises(ValueError, match=r"zipf_exponent must be >= 0"):
        SyntheticClickLog(zipf_exponent=-1)
    with pytest.raises(ValueError, match=r"click_rate must be in \(0, 1\)"):
        SyntheticClickLog(click_rate=1.0)
    with pytest.raises(ValueError, match=r"bag_lengths must be one BagLengths or 26"):
        SyntheticClickLog(bag_lengths=[BagLengths()] * 3)
    with pytest.raises(TypeError, match=r"one size per feature"):
        SyntheticClickLog(num_embeddings_per_feature=1000)
    with pytest.raises(ValueError, match=r"seed must be a non-negative int"):
        SyntheticClickLog(seed=-1)
    assert math.isfinite(SyntheticClickLog(max_rows=10).teacher_auc(2000))


def test_the_parts_of_a_batch_are_drawn_apart_and_regenerate():
    log = SyntheticClickLog(max_rows=500, seed=7)
    parts = [[batch_arrays(b) for b in log.batches(64, 2, start=5, shard=(k, 4))] for k in range(4)]
    for k in range(4):
        assert parts[k][0][0].shape == (16, 13) and parts[k][0][3].shape == (16,)
        again = batch_arrays(next(log.batches(64, start=6, shard=(k, 4))))
        for u, v in zip(again, parts[k][1]):  # part k of batch 6, on its own
            np.testing.assert_array_equal(u, v)
    dense = np.concatenate([p[0][0] for p in parts])
    assert len(np.unique(dense, axis=0)) == 64  # four different draws, not one repeated
    with pytest.raises(ValueError, match=r"batch_size=66 does not split into the 4 parts"):
        next(log.batches(66, shard=(0, 4)))
    with pytest.raises(ValueError, match=r"shard must be \(k, n\)"):
        next(log.batches(64, shard=(4, 4)))
