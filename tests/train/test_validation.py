"""``jaxrec train``'s validation set and early stopping: the three sets are disjoint and
follow the seed; the run stops after ``patience`` evaluations without a better validation
metric; the best checkpoint outlives the rotation and is the model tested; metrics.json
holds the curve, the best point and the test metrics; ``--resume`` refuses a new
``--val-fraction`` and applies a new ``--patience``; bad values are clear errors.

Early stopping is driven by a scripted validation curve (a metric per step) on tiny
matrix factorisations (``reference`` backend), so that no test needs a long training run.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import train_testing
from flax import nnx

from jaxrec.checkpoint import all_steps, restore_checkpoint
from jaxrec.train import TrainConfig, _loop, main, train
from jaxrec.train._tasks import build_task, ratings_splits

# A made-up validation RMSE per step: best at step 2; steps 4 and 6 tie with it (no gain).
CURVE = {1: 1.0, 2: 0.9, 3: 0.95, 4: 0.9, 5: 0.92, 6: 0.9, 7: 0.93, 8: 0.94, 9: 0.96}


def write_ratings(path: Path, n: int, seed: int = 3) -> Path:
    """``n`` ratings of 29 users and 19 items."""
    return train_testing.write_ratings(path, n, users=29, items=19, seed=seed)


@pytest.fixture(scope="module")
def ratings(tmp_path_factory):
    return write_ratings(tmp_path_factory.mktemp("movielens") / "u.data", 400)


def config(ratings, tmp_path, **changes) -> TrainConfig:
    settings = dict(data=f"movielens:{ratings}", batch_size=32, embedding_dim=4, eval_every=1,
                    backend="reference", steps=9, out_dir=str(tmp_path / "out"))
    return TrainConfig(**{**settings, **changes})


def scripted(monkeypatch, curve: dict[int, float], metric: str = "rmse") -> None:
    """Makes the validation metric at step ``s`` ``curve[s]`` (the test set is evaluated for
    real); ``metric="auc"`` makes the task a click task, where higher is better (and its
    test AUC a constant: the labels are ratings)."""
    real = _loop._Run._metrics

    def metrics(run, batches):
        if metric == "auc":
            run.task.info["task"] = "ctr"
            return {"auc": 0.5 if batches is run.task.test_batches else 1 - curve[run.step]}
        if batches is run.task.test_batches:
            return real(run, batches)
        return {"rmse": curve[run.step]}

    monkeypatch.setattr(_loop._Run, "_metrics", metrics)


def stored_model_rmse(conf: TrainConfig, step: int) -> float:
    """The test RMSE of checkpoint ``step``'s model."""
    task = build_task(conf)
    optimizer = nnx.Optimizer(task.model, _loop.DENSE_OPTIMIZERS[conf.dense_optimizer](1.0), wrt=nnx.Param)
    state, _ = restore_checkpoint(conf.checkpoint_dir, _loop.checkpoint_state(task.model, optimizer),
                                  step=step)
    _loop.load_checkpoint_state(task.model, state)
    return task.evaluate(nnx.jit(task.predict), task.test_batches)["rmse"]


# --- the split -----------------------------------------------------------------------------

def test_ratings_splits_are_disjoint_cover_the_ratings_and_follow_the_seed(ratings, tmp_path):
    def parts(**changes):
        train, val, test = ratings_splits(config(ratings, tmp_path, **changes))
        return [None if p is None else p.timestamps.tolist() for p in (train, val, test)]

    train, val, test = parts()
    assert sorted(train + val + test) == list(range(400))  # disjoint, every rating once
    assert (len(train), len(val), len(test)) == (324, 36, 40)  # 10% test, 10% of the rest
    assert all(p == sorted(p) for p in (train, val, test))  # file order
    assert parts() == [train, val, test]  # the same seed, the same parts
    other = parts(seed=1)
    assert other[1] != val and other[2] != test
    # The test split does not depend on the validation share: runs with any share compare.
    no_val = parts(val_fraction=0.0)
    assert no_val == [sorted(train + val), None, test]
    wider = parts(val_fraction=0.25)
    assert wider[2] == test and len(wider[1]) == 90 and sorted(wider[0] + wider[1]) == no_val[0]


def test_the_ml_100k_folder_carves_validation_from_its_base_file(tmp_path):
    folder = tmp_path / "ml-100k"
    folder.mkdir()
    base = write_ratings(folder / "u1.base", 200, seed=1)
    (folder / "u1.test").write_text("1\t1\t3\t9999\n2\t3\t4\t10000\n")
    train, val, test = ratings_splits(config(base.parent, tmp_path))
    assert test.timestamps.tolist() == [9999, 10000]
    assert len(val) == 20 and sorted([*train.timestamps, *val.timestamps]) == list(range(200))


def test_click_data_validation_batches_are_neither_test_nor_training_batches(tmp_path):
    # Criteo rows whose first dense feature is the row number: each batch says its rows.
    rows = 7 * 16
    (tmp_path / "day_0").write_text("".join(
        "\t".join(["1", str(k), *[""] * 12, *["a1b2c3d4"] * 26]) + "\n" for k in range(rows)))
    task = build_task(TrainConfig(data=f"criteo:{tmp_path / 'day_0'}", batch_size=16,
                                  eval_batches=2, steps=3, embedding_dim=4, max_rows=64))

    def row_features(batches):
        return {float(x) for b in batches for x in np.asarray(b.dense)[:, 0]}

    test, val = row_features(task.test_batches), row_features(task.val_batches)
    train = row_features(itertools.islice(task.train_batches(0), 3))  # one pass
    assert len(test) == len(val) == 32 and len(train) == rows - 64
    assert not (test & val or test & train or val & train)


# --- early stopping ------------------------------------------------------------------------

# Every patience with RMSE (lower is better); AUC (higher is better) only with patience 3,
# whose stop depends on the ties at steps 4 and 6: the metric's direction is one
# comparison, the same for every patience, and patience 0 never compares (3 runs fewer).
@pytest.mark.parametrize("metric, patience, stop", [
    ("rmse", 1, 3), ("rmse", 3, 5), ("rmse", 5, 7), ("rmse", 0, None), ("auc", 3, 5)])
def test_the_run_stops_after_patience_evaluations_without_a_better_one(
        ratings, tmp_path, monkeypatch, metric, patience, stop):
    scripted(monkeypatch, CURVE, metric)
    record = train(config(ratings, tmp_path, patience=patience))
    assert record["steps"] == (stop or 9)
    assert [e["step"] for e in record["history"]["eval"]] == list(range(1, (stop or 9) + 1))
    assert record["best"]["step"] == 2  # ties (steps 4, 6) are no improvement
    assert record["early_stop"] == (stop and {"step": stop, "patience": patience, "best_step": 2})


@pytest.mark.parametrize("checkpoints", [True, False])
def test_the_best_checkpoint_outlives_the_rotation_and_is_the_model_tested(
        ratings, tmp_path, monkeypatch, checkpoints):
    scripted(monkeypatch, CURVE)
    ck = tmp_path / "ck"
    conf = config(ratings, tmp_path, patience=0, checkpoint_dir=str(ck) if checkpoints else None)
    record = train(conf)
    assert record["test"]["step"] == 2 and record["test"]["model"] == "best"
    if not checkpoints:  # a copy on the host: the same model as the pinned checkpoint's
        conf = config(ratings, tmp_path / "b", patience=0, checkpoint_dir=str(ck))
        pinned = train(conf)
        assert pinned["final"] == record["final"]
        return
    assert all_steps(ck) == [2, 7, 8, 9]  # keep=3 newest, and the best
    assert record["test"]["checkpoint"] == str(ck.absolute() / "2")
    best, last = stored_model_rmse(conf, 2), stored_model_rmse(conf, 9)
    assert record["final"]["rmse"] == best != last


def test_metrics_json_holds_the_curve_the_best_point_and_the_test_metrics(
        ratings, tmp_path, monkeypatch, capsys):
    scripted(monkeypatch, CURVE)
    assert main(["--data", f"movielens:{ratings}", "--batch-size", "32", "--embedding-dim", "4",
                 "--eval-every", "1", "--backend", "reference", "--steps", "9", "--patience",
                 "3", "--out-dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "test rmse" in out and "(the best validation model, step 2)" in out
    assert "stopped early at step 5: 3 evaluations without a better validation metric" in out
    record = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert record["eval_set"] == "validation" and record["status"] == "completed"
    assert [(e["step"], e["rmse"]) for e in record["history"]["eval"]] == [
        (s, CURVE[s]) for s in range(1, 6)]
    per_epoch = 324 // 32
    assert record["best"] == {"step": 2, "rmse": 0.9, "epoch": round(2 / per_epoch, 4)}
    assert record["early_stop"] == {"step": 5, "patience": 3, "best_step": 2}
    test = record["test"]
    assert {k: test[k] for k in ("step", "epoch", "model")} == {
        "step": 2, "epoch": record["best"]["epoch"], "model": "best"}
    assert record["final"] == {"rmse": test["rmse"], "mae": test["mae"]}
    assert record["data"]["val_ratings"] == 36 and record["config"]["patience"] == 3


def test_without_a_validation_set_the_last_model_is_tested_and_nothing_stops_early(
        ratings, tmp_path):
    record = train(config(ratings, tmp_path, val_fraction=0.0, steps=3))
    assert record["eval_set"] == "test" and record["config"]["patience"] == 0
    assert record["test"] == {**record["history"]["eval"][-1], "model": "last"}
    assert record["steps"] == 3 and record["early_stop"] is None


# --- resume --------------------------------------------------------------------------------

def test_resume_applies_a_new_patience_and_refuses_a_new_val_fraction(
        ratings, tmp_path, monkeypatch, capsys):
    scripted(monkeypatch, CURVE)
    conf = config(ratings, tmp_path, patience=2, checkpoint_dir=str(tmp_path / "ck"))
    first = train(conf)
    assert first["early_stop"] == {"step": 4, "patience": 2, "best_step": 2}
    # The same patience: nothing left to train; the best model is tested again.
    again = train(config(ratings, tmp_path, patience=2, checkpoint_dir=conf.checkpoint_dir,
                         resume=True))
    assert again["steps"] == 4 and again["final"] == first["final"]
    # A new patience continues the curve where it stopped.
    capsys.readouterr()
    more = train(config(ratings, tmp_path, patience=4, checkpoint_dir=conf.checkpoint_dir,
                        resume=True))
    assert "applied --patience 2 -> 4" in capsys.readouterr().err
    assert more["resumed"]["applied"] == ["--patience 2 -> 4"]
    assert more["early_stop"] == {"step": 6, "patience": 4, "best_step": 2}
    assert more["final"] == first["final"]  # the same best model, from its checkpoint
    with pytest.raises(ValueError, match=r"--val-fraction 0.1 -> 0.2"):
        train(config(ratings, tmp_path, patience=4, checkpoint_dir=conf.checkpoint_dir,
                     resume=True, val_fraction=0.2))


# --- bad values ----------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--patience", "-1"], "patience must be an int >= 0, got -1: pass the number of "
                           "evaluations without improvement before the run stops (e.g. "
                           "--patience 3), or 0 to never stop early"),
    (["--val-fraction", "1"], "val_fraction must be a number in [0, 1), got 1.0: pass e.g. "
                              "--val-fraction 0.1"),
    (["--val-fraction", "-0.1"], "val_fraction must be a number in [0, 1), got -0.1"),
    (["--val-fraction", "nan"], "val_fraction must be a number in [0, 1), got nan"),
    (["--val-fraction", "0", "--patience", "3"],
     "patience 3 needs a validation set, and val_fraction is 0: pass --val-fraction > 0"),
    (["--val-fraction", "0.95"], "--val-fraction 0.95 of its 9 training ratings leaves none "
                                 "to train on; pass a smaller --val-fraction, or 0"),
])
def test_bad_values_name_the_flag_the_value_and_the_fix(args, message, tmp_path, capsys):
    data = write_ratings(tmp_path / "u.data", 10)
    assert main(["--data", f"movielens:{data}", *args, "--out-dir", str(tmp_path / "o")]) != 0
    assert message in capsys.readouterr().err


def test_val_fraction_is_refused_for_click_data(tmp_path, capsys):
    assert main(["--val-fraction", "0.1", "--out-dir", str(tmp_path)]) == 2
    assert ("val_fraction applies to ratings (movielens data); click data holds out "
            "--eval-batches batches for validation instead" in capsys.readouterr().err)
