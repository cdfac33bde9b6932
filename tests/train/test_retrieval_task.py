"""``jaxrec train --task retrieval``: the positive pairs and their splits, the evaluation
(exclusions, metrics against ``ranking_metrics`` and a NumPy MRR@K), the run end to end,
bad flags and the resume rules of the new flags."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import train_testing

from jaxrec import data
from jaxrec.metrics import ranking_metrics
from jaxrec.train import TrainConfig, main, train
from jaxrec.train._retrieval import HeldOut, evaluate, positive_pairs
from jaxrec.train._tasks import best_evaluation, build_task, ratings_splits


def write_ratings(path: Path, n: int = 600, seed: int = 3) -> Path:
    """``n`` ratings of 25 users and 30 items."""
    return train_testing.write_ratings(path, n, users=25, items=30, seed=seed)


@pytest.fixture(scope="module")
def ratings(tmp_path_factory):
    return write_ratings(tmp_path_factory.mktemp("movielens") / "u.data")


def config(ratings, tmp_path, **changes) -> TrainConfig:
    settings = dict(data=f"movielens:{ratings}", task="retrieval", batch_size=32, embedding_dim=4,
                    backend="reference", steps=12, eval_every=4, out_dir=str(tmp_path / "out"))
    return TrainConfig(**{**settings, **changes})


def codes(part, task) -> set[int]:
    """(user row, item row) codes of a ratings part, as the task numbers rows."""
    users, items = np.asarray(part.users) - 1, np.asarray(part.items) - 1  # ids 1.. are dense
    return set((users * task.test_batches.num_items + items).tolist())


# --- the data ------------------------------------------------------------------------------

@pytest.mark.parametrize("threshold", [4.0, 3.0])
def test_positives_are_the_ratings_splits_above_the_threshold_and_disjoint(
        ratings, tmp_path, threshold):
    conf = config(ratings, tmp_path, positive_threshold=threshold)
    train_r, val_r, test_r = ratings_splits(conf)
    task = build_task(conf)
    parts = [positive_pairs(p, threshold) for p in (train_r, val_r, test_r)]
    for part, whole in zip(parts, (train_r, val_r, test_r)):
        assert (part.ratings >= threshold).all()
        assert len(part) == int((whole.ratings >= threshold).sum()) > 0
    stamps = [set(p.timestamps.tolist()) for p in parts]
    assert not (stamps[0] & stamps[1] or stamps[0] & stamps[2] or stamps[1] & stamps[2])
    assert (task.info["train_positives"], task.info["val_positives"],
            task.info["test_positives"]) == tuple(map(len, parts))
    # The training stream is the training positives: one pass holds each once.
    one_pass = itertools.islice(task.train_batches(0), task.steps_per_epoch)
    seen = [int(b.mask.sum()) for b in one_pass]
    assert sum(seen) == len(parts[0]) // 32 * 32
    # Held out: the relevant pairs are the split's positives not seen in training; the
    # test set also excludes the validation positives.
    train_c, val_c, test_c = (codes(p, task) for p in parts)
    assert set(task.val_batches.relevant.tolist()) == val_c - train_c
    assert set(task.val_batches.exclude.tolist()) == train_c
    assert set(task.test_batches.relevant.tolist()) == test_c - train_c - val_c
    assert set(task.test_batches.exclude.tolist()) == train_c | val_c


# --- the evaluation ------------------------------------------------------------------------

def reference_mrr_at_k(scores, relevant, exclude, k):
    """Per query with a relevant item left: 1 / rank of the first one if within k, else 0."""
    values = []
    for s, r, e in zip(scores, relevant, exclude):
        r = r & ~e
        if not r.any():
            continue
        order = sorted((i for i in range(len(s)) if not e[i]), key=lambda i: (-s[i], i))
        first = next(n for n, i in enumerate(order, 1) if r[i])
        values.append(1.0 / first if first <= k else 0.0)
    return float(np.mean(values))


@pytest.mark.parametrize("k", [1, 5, 12])
def test_evaluation_matches_ranking_metrics_and_excludes_training_positives(k):
    rng = np.random.default_rng(k)
    num_users, num_items = 9, 12
    users = rng.integers(-2, 3, (num_users, 3)).astype(np.float32)  # small ints: many ties
    items = rng.integers(-2, 3, (num_items, 3)).astype(np.float32)
    scores = users @ items.T
    relevant, exclude = rng.random((2, num_users, num_items)) < [[[0.25]], [[0.3]]]
    relevant[0] = False  # a user without held-out positives: not a query
    relevant[1, :] = exclude[1, :] = False
    relevant[1, 3] = exclude[1, 3] = True  # its only positive was seen in training
    # The training positives would top every ranking if they were not excluded.
    boosted = np.where(exclude, 100.0, scores)
    got = evaluate(np.eye(num_users, dtype=np.float32), boosted.T.astype(np.float32),
                   HeldOut.build(np.argwhere(relevant), [np.argwhere(exclude)], num_items), k)
    want = ranking_metrics(scores, relevant, k, exclude=exclude)
    for name in ("recall", "ndcg", "hit_rate"):
        np.testing.assert_allclose(got[f"{name}@{k}"], want[f"{name}@{k}"], rtol=1e-12)
    np.testing.assert_allclose(got[f"mrr@{k}"], reference_mrr_at_k(scores, relevant, exclude, k),
                               rtol=1e-12)
    if k == num_items:  # the top k is every item: MRR@K is ranking_metrics' MRR
        np.testing.assert_allclose(got[f"mrr@{k}"], want["mrr"], rtol=1e-12)


def test_best_retrieval_evaluation_is_the_highest_recall():
    curve = [{"step": 4, "recall@10": 0.2, "ndcg@10": 0.5}, {"step": 8, "recall@10": 0.3,
             "ndcg@10": 0.1}, {"step": 12, "recall@10": 0.3, "ndcg@10": 0.9}]
    assert best_evaluation("retrieval", curve) == curve[1]  # highest, earliest of equals
    assert best_evaluation("retrieval", []) == {}


# --- the run -------------------------------------------------------------------------------

def test_the_cli_trains_retrieval_and_writes_ranking_metrics(ratings, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["--data", f"movielens:{ratings}", "--task", "retrieval", "--batch-size", "32",
                 "--steps", "30", "--eval-every", "10", "--top-k", "5", "--backend",
                 "reference", "--out-dir", str(out)]) == 0
    printed = capsys.readouterr()
    assert "test recall@5" in printed.out and "popularity baseline" in printed.out
    record = json.loads((out / "metrics.json").read_text())
    assert record["config"]["task"] == "retrieval" and record["config"]["model"] == "mf"
    assert record["config"]["temperature"] == 1.0 and record["config"]["table_learning_rate"] == 0.02
    names = {"recall@5", "ndcg@5", "hit_rate@5", "mrr@5"}
    assert set(record["final"]) == names and set(record["data"]["popularity_test"]) == names
    assert [e["step"] for e in record["history"]["eval"]] == [10, 20, 30]
    assert record["best"] == best_evaluation("retrieval", record["history"]["eval"])
    assert record["test"]["model"] == "best" and record["test"]["step"] == record["best"]["step"]
    assert all(0 <= v <= 1 for v in record["final"].values())


def test_bpr_trains_too(ratings, tmp_path):
    record = train(config(ratings, tmp_path, retrieval_loss="bpr", steps=4, eval_every=4))
    assert record["status"] == "completed" and record["config"]["temperature"] is None
    assert set(record["final"]) == {"recall@10", "ndcg@10", "hit_rate@10", "mrr@10"}


@pytest.mark.parametrize("args, message", [
    (["--task", "retrieval"], "task 'retrieval' does not fit data 'synthetic' (its labels are "
                              "clicks, without user and item ids); pass --task ctr"),
    (["--data", "movielens:x", "--task", "ctr"], "task 'ctr' does not fit data 'movielens'"),
    (["--data", "movielens:x", "--top-k", "5"], "--top-k applies to --task retrieval (movielens "
                                                "data), and this run's task is ratings: drop "
                                                "them, or pass --task retrieval"),
    (["--data", "movielens:x", "--task", "retrieval", "--top-k", "0"],
     "top_k must be an int >= 1, got 0: pass e.g. --top-k 10"),
    (["--data", "movielens:x", "--task", "retrieval", "--positive-threshold", "6"],
     "positive_threshold must be a number of stars in (0.5, 5.0], got 6.0: pass e.g. "
     "--positive-threshold 4"),
    (["--data", "movielens:x", "--task", "retrieval", "--temperature", "0"],
     "temperature must be a finite number > 0, got 0.0: pass e.g. --temperature 1"),
    (["--data", "movielens:x", "--task", "retrieval", "--retrieval-loss", "bpr", "--temperature",
      "0.5"], "temperature applies to --retrieval-loss softmax, and the loss is bpr"),
    (["--data", "FILE", "--task", "retrieval", "--top-k", "31", "--batch-size", "32"],
     "--top-k 31 is more than the 30 items of"),
    (["--data", "FILE", "--task", "retrieval", "--positive-threshold", "5", "--batch-size", "512"],
     "training ratings of at least --positive-threshold 5 stars, fewer than one batch "
     "(--batch-size 512): pass a smaller --batch-size or a lower --positive-threshold"),
])
def test_bad_values_name_the_flag_the_value_and_the_fix(args, message, ratings, tmp_path, capsys):
    args = [f"movielens:{ratings}" if a == "FILE" else a for a in args]
    assert main([*args, "--out-dir", str(tmp_path / "o")]) != 0
    assert message in capsys.readouterr().err


def test_resume_applies_a_new_temperature_and_refuses_new_pairs_or_metrics(ratings, tmp_path,
                                                                           capsys):
    ck = str(tmp_path / "ck")
    train(config(ratings, tmp_path, steps=4, checkpoint_dir=ck))
    more = train(config(ratings, tmp_path, steps=8, checkpoint_dir=ck, resume=True,
                        temperature=0.5))
    assert more["resumed"]["applied"] == ["--temperature 1.0 -> 0.5"]
    assert more["steps"] == 8
    for change, said in ((dict(top_k=5), "--top-k 10 -> 5"),
                         (dict(positive_threshold=3.0), "--positive-threshold 4.0 -> 3.0"),
                         (dict(retrieval_loss="bpr", temperature=None), "--retrieval-loss softmax -> bpr"),
                         (dict(task="ratings", temperature=None), "--task retrieval -> ratings")):
        with pytest.raises(ValueError, match=said):
            train(config(ratings, tmp_path, steps=8, checkpoint_dir=ck, resume=True,
                         **{"temperature": 0.5, **change}))


def test_side_features_join_the_towers(tmp_path):
    """--side-features: each user_* / item_* field is a table of its own, the towers embed
    them (MF sums a side's), and the run trains and evaluates as with ids alone."""
    folder = tmp_path / "ml"
    folder.mkdir()
    path = write_ratings(folder / "u.data")
    train_testing.write_side_features(folder, users=25, items=30)
    record = train(config(path, tmp_path, side_features=True, steps=8, eval_every=4))
    assert record["status"] == "completed" and record["config"]["side_features"] is True
    assert record["data"]["features"] == ["user_id", "item_id", "user_age", "user_gender",
                                          "user_occupation", "item_genres", "item_decade"]
    assert record["data"]["table_sizes"][2:] == [7, 2, 5, 19, 7]  # age groups, ..., decades seen
    assert all(0 <= v <= 1 for v in record["final"].values())
    with pytest.raises(FileNotFoundError, match="u.user and u.item"):  # the files are needed
        train(config(write_ratings(tmp_path / "u.data"), tmp_path, side_features=True))
    with pytest.raises(ValueError, match="--side-features applies to --task retrieval"):
        TrainConfig(data=f"movielens:{path}", side_features=True)


def test_a_click_log_trains_retrieval_from_its_clicks(tmp_path):
    """clicks:PATH: retrieval is the default task, the clicks are the positives (the
    impressions without a click are no pairs, their items still candidates), and the
    ratings task and --positive-threshold are refused."""
    log = train_testing.write_click_log(tmp_path / "clicks.tsv", 900, users=25, items=30)
    cfg = TrainConfig(data=f"clicks:{log}", batch_size=32, embedding_dim=4, backend="reference",
                      steps=8, eval_every=4, out_dir=str(tmp_path / "out"))
    assert cfg.task == "retrieval" and cfg.model == "mf" and cfg.positive_threshold == 1.0
    splits = ratings_splits(cfg)
    clicks = data.load_click_log(log)
    assert sum(len(p) for p in splits) == len(clicks)  # every impression in one part
    task = build_task(cfg)
    clicked = int((clicks.ratings == 1).sum())
    info = task.info
    assert info["train_positives"] + info["val_positives"] + info["test_positives"] == clicked
    assert info["num_items"] == len(np.unique(clicks.items))  # shown items are candidates too
    record = train(cfg)
    assert record["status"] == "completed" and set(record["final"]) == {
        "recall@10", "ndcg@10", "hit_rate@10", "mrr@10"}
    with pytest.raises(ValueError, match="task 'ratings' does not fit data 'clicks'"):
        TrainConfig(data=f"clicks:{log}", task="ratings")
    with pytest.raises(ValueError, match="a click log's positives are its clicks"):
        TrainConfig(data=f"clicks:{log}", positive_threshold=4)


def test_a_bad_click_is_named(tmp_path):
    path = tmp_path / "clicks.tsv"
    path.write_text("1\t2\t1\t0\n3\t4\t2\t0\n")
    with pytest.raises(data.DataFormatError, match=r"clicks.tsv, line 2, field clicked: 2.0 is not 0 or 1"):
        data.load_click_log(path)
    path.write_text("1\t2\t1\n")
    with pytest.raises(data.DataFormatError, match=r"line 1: expected 4 fields \(user, item, clicked, "):
        data.load_click_log(path)


def test_too_few_clicks_say_so_without_a_threshold_to_lower(tmp_path):
    log = train_testing.write_click_log(tmp_path / "clicks.tsv", 60, users=25, items=30)
    with pytest.raises(ValueError, match=r"training clicks, fewer than one batch \(--batch-size 512\): "
                                         r"pass a smaller --batch-size or more clicks"):
        train(TrainConfig(data=f"clicks:{log}", batch_size=512, backend="reference", steps=2,
                          out_dir=str(tmp_path / "out")))
