"""jaxrec.metrics against float64 references: an O(n^2) pairwise AUC, direct loss formulas,
np.repeat for integer weights, and the batch functions for the streaming and windowed forms."""

from __future__ import annotations

import math
import subprocess
import sys

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings

from jaxrec import metrics
from jaxrec.metrics import (
    StreamingAUC,
    StreamingLogLoss,
    StreamingMAE,
    StreamingRMSE,
    WindowedAUC,
    auc,
    log_loss,
    mae,
    rmse,
)

RTOL = 1e-12  # float64 sums in another order; the references are float64 too


def pairwise_auc(labels, scores, weights=None):
    """Sum over every (positive, negative) pair of w_p w_n ([s_p > s_n] + [s_p == s_n] / 2),
    over sum w_p w_n. O(P * N), float64."""
    labels = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, np.float64)
    weights = np.ones(labels.shape) if weights is None else np.asarray(weights, np.float64)
    sp, sn = scores[labels][:, None], scores[~labels][None, :]
    pair_w = weights[labels][:, None] * weights[~labels][None, :]
    wins = pair_w * ((sp > sn) + 0.5 * (sp == sn))
    return wins.sum() / pair_w.sum()


def random_batch(rng, n, *, ties=False, zero_weights=True):
    """Labels (float32 0/1, both classes), float32 scores and float32 weights (some 0)."""
    labels = (rng.random(n) < 0.35).astype(np.float32)
    labels[:2] = [0, 1]
    rng.shuffle(labels)
    scores = rng.normal(size=n) + labels
    if ties:
        scores = np.round(scores, 1)
    weights = rng.uniform(0.2, 3.0, n)
    if zero_weights:
        weights[rng.random(n) < 0.2] = 0
        weights[np.flatnonzero(labels == 1)[0]] = 1.0
        weights[np.flatnonzero(labels == 0)[0]] = 1.0
    return labels, scores.astype(np.float32), weights.astype(np.float32)


# ------------------------------------------------------------------------------------------
# AUC


def test_auc_hand_computed():
    assert auc([0, 1, 0, 1], [0.1, 0.4, 0.5, 0.8]) == 0.75
    assert auc([0, 1], [0.5, 0.5]) == 0.5
    assert auc([1, 0], [0.5, 0.2]) == 1.0
    assert auc([1, 0], [0.2, 0.5]) == 0.0
    # positives score 3, 5, 1 and negatives 3, 0: the 6 pairs win 0.5 + 1 + 1 + 1 + 0 + 1
    assert auc([1, 1, 0, 1, 0], [3, 5, 3, 1, 0]) == 4.5 / 6
    # weight 2 on the positive scoring 1: its two pairs (0 and 1 won) count twice
    assert auc([1, 1, 0, 1, 0], [3, 5, 3, 1, 0], [1, 1, 1, 2, 1]) == 5.5 / 8


@pytest.mark.parametrize("n", [2, 3, 17, 101, 513])
@pytest.mark.parametrize("ties", [False, True])
def test_auc_matches_pairwise(n, ties):
    rng = np.random.default_rng(1000 * n + ties)
    labels, scores, weights = random_batch(rng, n, ties=ties)
    want = pairwise_auc(labels, scores)
    assert auc(labels, scores) == pytest.approx(want, rel=RTOL)
    assert auc(labels, scores, weights) == pytest.approx(
        pairwise_auc(labels, scores, weights), rel=RTOL
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.integers(-3, 3),  # integer scores, heavy ties
            st.sampled_from([0.0, 0.25, 1.0, 1.0, 2.0, 7.5]),
        ),
        min_size=2,
        max_size=40,
    )
)
def test_auc_matches_pairwise_fuzzed(rows):
    labels, scores, weights = (np.array(c) for c in zip(*rows))
    assume(weights[labels].sum() > 0 and weights[~labels].sum() > 0)
    got = auc(labels, scores, weights)
    assert got == pytest.approx(pairwise_auc(labels, scores, weights), rel=RTOL)


def test_auc_large_with_ties_matches_rank_formula():
    """n = 200_001 (too many for pairwise): the Mann-Whitney statistic by average ranks."""
    rng = np.random.default_rng(7)
    n = 200_001
    labels = rng.random(n) < 0.1
    scores = rng.integers(0, 1000, n) + 30 * labels  # ~200 examples per distinct score
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    rank = (np.cumsum(counts) - (counts - 1) / 2.0)[inverse]
    p, q = labels.sum(), (~labels).sum()
    want = (rank[labels].sum() - p * (p + 1) / 2) / (p * q)
    assert auc(labels, scores) == pytest.approx(want, rel=RTOL)


@pytest.mark.parametrize("ties", [False, True])
def test_auc_invariant_under_monotone_transforms(ties):
    rng = np.random.default_rng(3)
    labels, logits, weights = random_batch(rng, 999, ties=ties)
    logits = 4 * logits  # float32 values: every transform below keeps them distinct
    base = auc(labels, logits, weights)
    assert 0.6 < base < 0.9
    x = logits.astype(np.float64)
    for transformed in (1 / (1 + np.exp(-x)), np.exp(x), 3 * x - 5, x**3):
        assert auc(labels, transformed, weights) == base
    assert auc(labels, -x, weights) == pytest.approx(1 - base, rel=RTOL)


def test_auc_accepts_jax_arrays_bfloat16_bool_and_2d():
    rng = np.random.default_rng(4)
    labels, scores, weights = random_batch(rng, 64)
    s16 = jnp.asarray(scores, jnp.bfloat16)
    want = auc(labels, np.asarray(s16).astype(np.float64), weights)
    assert auc(jnp.asarray(labels), s16, jnp.asarray(weights)) == want
    mask = weights > 0
    assert auc(labels.astype(bool), scores, mask) == auc(labels, scores, mask.astype(np.float32))
    assert auc(labels.reshape(8, 8), scores.reshape(8, 8)) == auc(labels, scores)


# ------------------------------------------------------------------------------------------
# log loss, RMSE, MAE


def reference_log_loss(labels, probabilities, weights, eps=1e-7):
    y = np.asarray(labels, np.float64)
    p = np.clip(np.asarray(probabilities, np.float64), eps, 1 - eps)
    w = np.asarray(weights, np.float64)
    return np.sum(w * -(y * np.log(p) + (1 - y) * np.log(1 - p))) / np.sum(w)


@pytest.mark.parametrize("n", [1, 7, 333])
def test_pointwise_match_formulas(n):
    rng = np.random.default_rng(n)
    labels = (rng.random(n) < 0.4).astype(np.float32)
    probs = rng.uniform(0.01, 0.99, n).astype(np.float32)
    probs[: n // 3] = np.where(labels[: n // 3] == 1, 0.0, 1.0)  # certain and wrong: clipped
    weights = rng.uniform(0.5, 2.0, n).astype(np.float32)
    ones = np.ones(n)
    for w in (None, weights):
        ww = ones if w is None else w
        assert log_loss(labels, probs, w) == pytest.approx(
            reference_log_loss(labels, probs, ww), rel=RTOL
        )
        assert log_loss(labels, probs, w, eps=1e-3) == pytest.approx(
            reference_log_loss(labels, probs, ww, eps=1e-3), rel=RTOL
        )
    # soft labels
    soft = rng.random(n).astype(np.float32)
    assert log_loss(soft, probs, weights) == pytest.approx(
        reference_log_loss(soft, probs, weights), rel=RTOL
    )
    # a confident mistake costs -log(eps), a confident hit -log(1 - eps)
    assert log_loss([1.0, 0.0], [0.0, 0.0]) == pytest.approx(
        (-math.log(1e-7) - math.log1p(-1e-7)) / 2, rel=RTOL
    )

    targets = rng.uniform(1, 5, n).astype(np.float32)
    preds = (targets + rng.normal(0, 0.7, n)).astype(np.float32)
    t, p, w = (np.asarray(a, np.float64) for a in (targets, preds, weights))
    assert rmse(targets, preds, weights) == pytest.approx(
        math.sqrt(np.sum(w * (t - p) ** 2) / np.sum(w)), rel=RTOL
    )
    assert mae(targets, preds, weights) == pytest.approx(
        np.sum(w * np.abs(t - p)) / np.sum(w), rel=RTOL
    )
    assert rmse(targets, preds) == pytest.approx(np.sqrt(np.mean((t - p) ** 2)), rel=RTOL)
    assert mae(targets, preds) == pytest.approx(np.mean(np.abs(t - p)), rel=RTOL)


# ------------------------------------------------------------------------------------------
# weights


@pytest.mark.parametrize("n", [5, 61])
def test_integer_weights_equal_repeating_examples(n):
    rng = np.random.default_rng(10 + n)
    labels, scores, _ = random_batch(rng, n, ties=True, zero_weights=False)
    counts = rng.integers(0, 4, n)
    counts[np.flatnonzero(labels == 1)[0]] = counts[np.flatnonzero(labels == 0)[0]] = 2
    probs = 1 / (1 + np.exp(-scores.astype(np.float64)))

    def rep(a):
        return np.repeat(a, counts)

    assert auc(labels, scores, counts) == pytest.approx(auc(rep(labels), rep(scores)), rel=RTOL)
    assert log_loss(labels, probs, counts) == pytest.approx(
        log_loss(rep(labels), rep(probs)), rel=RTOL
    )
    assert rmse(labels, probs, counts) == pytest.approx(rmse(rep(labels), rep(probs)), rel=RTOL)
    assert mae(labels, probs, counts) == pytest.approx(mae(rep(labels), rep(probs)), rel=RTOL)


def test_zero_weight_rows_do_not_count_at_all():
    """Padding rows may hold anything (NaN scores, labels of -1, logits): weight 0 drops them
    before any check."""
    rng = np.random.default_rng(5)
    labels, scores, weights = random_batch(rng, 45, zero_weights=False)
    probs = 1 / (1 + np.exp(-scores))
    pad = 13
    pl = np.concatenate([labels, np.full(pad, -1.0, np.float32)])
    ps = np.concatenate([scores, np.full(pad, np.nan, np.float32)])
    pp = np.concatenate([probs, np.full(pad, 3.0, np.float32)])
    pw = np.concatenate([weights, np.zeros(pad, np.float32)])
    order = rng.permutation(pl.size)
    pl, ps, pp, pw = pl[order], ps[order], pp[order], pw[order]
    assert auc(pl, ps, pw) == auc(labels, scores, weights)
    assert log_loss(pl, pp, pw) == pytest.approx(log_loss(labels, probs, weights), rel=RTOL)
    assert rmse(pl, pp, pw) == pytest.approx(rmse(labels, probs, weights), rel=RTOL)
    assert mae(pl, pp, pw) == pytest.approx(mae(labels, probs, weights), rel=RTOL)
    # the padding rows really would have failed or counted without their weight of 0
    with pytest.raises(ValueError, match="labels must be 0 or 1, got -1.0"):
        auc(pl, ps)
    with pytest.raises(ValueError, match="scores has 13 NaN"):
        auc(np.abs(pl), ps)
    with pytest.raises(ValueError, match="probabilities must lie in"):
        log_loss(np.abs(pl), pp)
    assert mae(pl, pp) > mae(labels, probs, weights) + 0.5


# ------------------------------------------------------------------------------------------
# streaming and windowed forms


def random_chunks(rng, n, max_chunk):
    cuts = np.sort(rng.integers(0, n + 1, rng.integers(1, n // max_chunk + 4)))
    return np.split(np.arange(n), cuts)  # some chunks are empty


@pytest.mark.parametrize("seed", range(4))
def test_streaming_equals_batch_over_concatenation(seed):
    rng = np.random.default_rng(seed)
    n = 1001
    labels, scores, weights = random_batch(rng, n, ties=seed % 2 == 1)
    weights[100:150] = 0  # a fully padded chunk, often
    probs = 1 / (1 + np.exp(-scores))
    targets = rng.uniform(1, 5, n)
    cases = [
        (StreamingAUC(), auc, labels, scores),
        (StreamingLogLoss(), log_loss, labels, probs),
        (StreamingRMSE(), rmse, targets, probs * 5),
        (StreamingMAE(), mae, targets, probs * 5),
    ]
    for metric, batch_fn, a, b in cases:
        for _ in range(2):  # the second pass checks reset()
            metric.reset()
            seen = np.zeros(0, np.int64)
            for idx in random_chunks(rng, n, 97):
                metric.update(a[idx], b[idx], weights[idx])
                seen = np.concatenate([seen, idx])
                if weights[seen].sum() > 0 and np.ptp(labels[seen][weights[seen] > 0]) > 0:
                    # compute() between updates must not disturb the stream
                    want = batch_fn(a[seen], b[seen], weights[seen])
                    assert metric.compute() == pytest.approx(want, rel=RTOL), type(metric)
            assert metric.compute() == pytest.approx(batch_fn(a, b, weights), rel=RTOL)
    log = StreamingLogLoss(eps=0.1)
    log.update(labels, probs)
    assert log.compute() == pytest.approx(log_loss(labels, probs, eps=0.1), rel=RTOL)


@pytest.mark.parametrize("window_size", [1, 7, 64, 250])
def test_windowed_auc_equals_auc_over_the_last_window(window_size):
    rng = np.random.default_rng(window_size)
    n = 1201
    labels, scores, weights = random_batch(rng, n, ties=True)
    metric = WindowedAUC(window_size)
    for _ in range(2):
        metric.reset()
        seen = np.zeros(0, np.int64)
        for idx in random_chunks(rng, n, 2 * window_size):  # some chunks exceed the window
            metric.update(labels[idx], scores[idx], weights[idx])
            seen = np.concatenate([seen, idx])
            last = seen[weights[seen] > 0][-window_size:]  # weight 0 rows are not stored
            if last.size and np.ptp(labels[last]) > 0:
                want = auc(labels[last], scores[last], weights[last])
                assert metric.compute() == pytest.approx(want, rel=RTOL)
            elif last.size:
                with pytest.raises(ValueError, match="both positive and negative"):
                    metric.compute()
    assert metric.window_size == window_size


def test_windowed_auc_large_window_is_streaming_auc():
    rng = np.random.default_rng(8)
    labels, scores, weights = random_batch(rng, 301)
    windowed, streaming = WindowedAUC(10_000), StreamingAUC()
    for idx in np.array_split(np.arange(301), 5):
        windowed.update(labels[idx], scores[idx], weights[idx])
        streaming.update(labels[idx], scores[idx], weights[idx])
    assert windowed.compute() == pytest.approx(streaming.compute(), rel=RTOL)
    assert windowed.compute() == pytest.approx(auc(labels, scores, weights), rel=RTOL)


# ------------------------------------------------------------------------------------------
# errors


ALL_FNS = [
    (auc, [0.0, 1.0, 0.0], [0.2, 0.7, 0.4]),
    (log_loss, [0.0, 1.0, 0.0], [0.2, 0.7, 0.4]),
    (rmse, [1.0, 2.0, 4.0], [1.5, 2.5, 3.0]),
    (mae, [1.0, 2.0, 4.0], [1.5, 2.5, 3.0]),
]


@pytest.mark.parametrize("fn,a,b", ALL_FNS, ids=lambda x: getattr(x, "__name__", ""))
def test_errors_common_to_every_metric(fn, a, b):
    a, b = np.array(a), np.array(b)
    first, second = fn.__code__.co_varnames[:2]
    with pytest.raises(ValueError, match=rf"{second} has shape \(2,\) but {first} has shape"
                                         r" \(3,\); .*reshape"):
        fn(a, b[:2])
    with pytest.raises(ValueError, match=rf"{second} has shape \(3, 1\) but {first} has shape"):
        fn(a, b[:, None])
    with pytest.raises(ValueError, match=r"weights has shape \(2,\) but .* batch's mask"):
        fn(a, b, [1.0, 1.0])
    for bad in (-0.5, np.nan, np.inf):
        with pytest.raises(ValueError, match=rf"weights must be finite and >= 0, got {bad} at "
                                             r"index 1; use 0 to drop"):
            fn(a, b, [1.0, bad, 1.0])
    for w in ([0.0, 0.0, 0.0], np.zeros(3, bool)):
        with pytest.raises(ValueError, match=r"no example has weight > 0 .* all-padding"):
            fn(a, b, w)
    with pytest.raises(ValueError, match=r"no example has weight > 0 \(the inputs are empty"):
        fn([], [])
    with pytest.raises(ValueError, match=rf"{second} has 2 NaN value\(s\) among the examples"
                                         r" with weight > 0 \(first at index 0\)"):
        fn(a, [np.nan, 0.5, np.nan])
    with pytest.raises(ValueError, match=r"first at index \(1, 0\)"):
        fn(a.reshape(3, 1), np.array([0.5, np.nan, 0.5]).reshape(3, 1))
    with pytest.raises(TypeError, match=rf"{second} must be an array of real numbers, got dtype"):
        fn(a, ["0.2", "0.7", "0.4"])
    with pytest.raises(TypeError, match=r"weights must be an array of real numbers"):
        fn(a, b, [1j, 1j, 1j])


def test_auc_errors():
    with pytest.raises(ValueError, match=r"both positive and negative labels .* got total "
                                         r"weight 2 of positives and 0 of negatives"):
        auc([1, 1], [0.1, 0.2])
    # one class among the examples that count, though both occur in the batch
    with pytest.raises(ValueError, match=r"weight 0 of positives and 1.5 of negatives"):
        auc([1, 0, 0], [0.1, 0.2, 0.3], [0, 1, 0.5])
    with pytest.raises(ValueError, match=r"labels must be 0 or 1, got 0.7 at index 1; binarize"):
        auc([0, 0.7, 1], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match=r"labels has 1 NaN"):
        auc([0, np.nan, 1], [0.1, 0.2, 0.3])
    # infinite scores are ordered like any others
    assert auc([0, 1, 0, 1], [-np.inf, np.inf, 0.0, 1.0]) == 1.0


def test_log_loss_errors():
    with pytest.raises(ValueError, match=r"probabilities must lie in \[0, 1\], got 2.5 at "
                                         r"index 2; pass probabilities \(sigmoid\(logits\)\)"):
        log_loss([0, 1, 1], [0.1, 0.2, 2.5])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 1\], got -1.0 at index 0"):
        log_loss([-1, 1, 1], [0.1, 0.2, 0.5])
    for eps in (0.0, 0.5, -1e-7, np.nan):
        with pytest.raises(ValueError, match=r"eps must lie in \(0, 0.5\), got"):
            log_loss([0, 1], [0.1, 0.2], eps=eps)
        with pytest.raises(ValueError, match=r"eps must lie in \(0, 0.5\), got"):
            StreamingLogLoss(eps=eps)


@pytest.mark.parametrize(
    "make", [StreamingAUC, lambda: WindowedAUC(5), StreamingLogLoss, StreamingRMSE, StreamingMAE],
    ids=["StreamingAUC", "WindowedAUC", "StreamingLogLoss", "StreamingRMSE", "StreamingMAE"],
)
def test_streaming_errors(make):
    metric = make()
    name = type(metric).__name__
    with pytest.raises(ValueError, match=rf"{name} has seen no example with weight > 0 since "
                                         r"reset\(\); call update"):
        metric.compute()
    metric.update([0.0, 1.0], [0.5, 0.5], [0, 0])  # an all-padding batch is fine to add...
    with pytest.raises(ValueError, match=rf"{name} has seen no example"):
        metric.compute()  # ...but counts for nothing
    with pytest.raises(ValueError, match=r"has shape \(1,\) but"):
        metric.update([0.0, 1.0], [0.5])
    with pytest.raises(ValueError, match=r"weights must be finite and >= 0"):
        metric.update([0.0, 1.0], [0.5, 0.5], [1, -1])
    metric.update([0.0, 1.0], [0.25, 0.5])
    value = metric.compute()
    metric.reset()
    with pytest.raises(ValueError, match=rf"{name} has seen no example"):
        metric.compute()
    metric.update([0.0, 1.0], [0.25, 0.5])
    assert metric.compute() == value


@pytest.mark.parametrize("window_size", [0, -3, 2.0, True, None])
def test_windowed_auc_bad_window_size(window_size):
    with pytest.raises(ValueError, match=r"window_size must be a positive int"):
        WindowedAUC(window_size)


def test_public_api_and_imports():
    assert sorted(metrics.__all__) == sorted(
        ["auc", "log_loss", "rmse", "mae", "StreamingAUC", "WindowedAUC", "StreamingLogLoss",
         "StreamingRMSE", "StreamingMAE", "ranking_metrics", "recall_at_k", "ndcg_at_k",
         "hit_rate_at_k", "mrr"]
    )
    import jaxrec.data

    assert not hasattr(jaxrec.data, "roc_auc")  # the AUC lives in jaxrec.metrics only
    code = (
        "import sys, jaxrec.metrics; "
        "print([m for m in ('jaxrec.data', 'jaxrec.ops', 'jaxrec.sparse', 'jaxrec.optim', "
        "'optax') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out
