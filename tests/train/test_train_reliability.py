"""``jaxrec train`` loses nothing and hides nothing: a NaN/Inf step stops the run (or is
skipped and counted) without a bad checkpoint ever replacing good ones; a second run on a
checkpoint directory is refused; ``--resume`` applies new learning rates and refuses
settings that change the model or the data; a corrupt newest checkpoint is skipped; every
failure ends in one clear message, a non-zero exit code and a written metrics.json.

The runs are tiny matrix factorisations on a MovieLens-format file (the smallest model to
compile), on the ``reference`` backend: what is tested is the loop, not the kernels.
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrec.checkpoint import (
    CheckpointLock,
    NonFiniteStateError,
    all_steps,
    restore_checkpoint,
    save_checkpoint,
)
from jaxrec.train import TrainConfig, TrainingStopped, _loop, main, train
from jaxrec.train._tasks import build_task

FLAGS = ["--batch-size", "32", "--embedding-dim", "4", "--eval-every", "2", "--backend",
         "reference"]


@pytest.fixture(scope="module")
def ratings(tmp_path_factory):
    path = tmp_path_factory.mktemp("movielens") / "u.data"
    rng = np.random.default_rng(3)
    n = 400
    users, items, stars = rng.integers(1, 30, n), rng.integers(1, 20, n), rng.integers(1, 6, n)
    path.write_text("".join(f"{u}\t{i}\t{r}\t{874965758 + k}\n"
                            for k, (u, i, r) in enumerate(zip(users, items, stars))))
    return path


def run(ratings, tmp_path, *flags) -> int:
    return main(["--data", f"movielens:{ratings}", *FLAGS, "--checkpoint-dir",
                 str(tmp_path / "ck"), "--out-dir", str(tmp_path / "out"), *flags])


def config(ratings, tmp_path, **changes) -> TrainConfig:
    return TrainConfig(data=f"movielens:{ratings}", batch_size=32, embedding_dim=4, eval_every=2,
                       backend="reference", steps=4, checkpoint_dir=str(tmp_path / "ck"),
                       out_dir=str(tmp_path / "out"), **changes)


def checkpoint_state(conf: TrainConfig, step: int):
    task = build_task(conf)
    optimizer = nnx.Optimizer(task.model, _loop.DENSE_OPTIMIZERS[conf.dense_optimizer](1.0), wrt=nnx.Param)
    return restore_checkpoint(conf.checkpoint_dir, _loop.checkpoint_state(task.model, optimizer),
                              step=step)


def metrics(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / "metrics.json").read_text())


def one_clear_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("jaxrec train: ")]
    assert lines and "Traceback" not in err, err
    return lines[-1]


def test_a_nonfinite_step_stops_the_run_and_no_bad_checkpoint_replaces_good_ones(
        ratings, tmp_path, capsys):
    assert run(ratings, tmp_path, "--steps", "4", "--checkpoint-every", "1") == 0
    assert all_steps(tmp_path / "ck") == [2, 3, 4]
    # The new rate is applied on resume (it used to keep the old one), and diverges at once.
    assert run(ratings, tmp_path, "--steps", "12", "--checkpoint-every", "1", "--resume",
               "--table-lr", "1e25") == 1
    err = capsys.readouterr().err
    assert "applied --table-lr 0.1 -> 1e+25" in err
    line = one_clear_line(err)
    bad = int(re.search(r"step (\d+): non-finite loss, gradient or model value \(NaN or Inf\); stopped",
                        line)[1])
    kept = int(re.search(r"The last finite checkpoint is step (\d+)", line)[1])
    assert 5 <= bad <= 12 and kept == bad - 1 and "--on-nonfinite skip" in line
    steps = all_steps(tmp_path / "ck")
    best = metrics(tmp_path)["best"]["step"]  # kept besides the newest three
    assert steps == sorted({kept - 2, kept - 1, kept, best})  # the good ones are all still there
    conf = config(ratings, tmp_path)
    for step in steps:
        state, _ = checkpoint_state(conf, step)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state)
                   if jax.dtypes.issubdtype(x.dtype, np.inexact))
    record = metrics(tmp_path)
    assert record["status"] == "nonfinite" and f"step {bad}: non-finite" in record["stopped"]
    assert record["step_stats"]["nonfinite_steps"] == 1
    assert record["resumed"]["applied"] == ["--table-lr 0.1 -> 1e+25"]
    assert (tmp_path / "out" / "curves.png").is_file()


def test_a_state_the_checkpoint_refuses_stops_the_run_as_a_nonfinite_step(
        ratings, tmp_path, capsys, monkeypatch):
    """A fused table's overflow passes the step's guard (jaxrec/_step_guard.py); the save
    that refuses it stops the run as a non-finite step would."""
    saves = []

    def save(directory, step, *args, **kwargs):
        saves.append(step)
        if step == 3:
            raise NonFiniteStateError("state leaves hold NaN or Inf: ['model']['t'] (1 of 8 values)")
        return save_checkpoint(directory, step, *args, **kwargs)

    monkeypatch.setattr(_loop, "save_checkpoint", save)
    assert run(ratings, tmp_path, "--steps", "4", "--checkpoint-every", "1") == 1
    line = one_clear_line(capsys.readouterr().err)
    assert "step 3: non-finite loss, gradient or model value (NaN or Inf); stopped" in line
    assert "The last finite checkpoint is step 2" in line
    assert saves == [1, 2, 3] and metrics(tmp_path)["status"] == "nonfinite"


def test_skip_skips_and_counts_the_nonfinite_steps(ratings, tmp_path, capsys, monkeypatch):
    # The loss is NaN on the batches whose first rating is 5: those steps are skipped (the
    # model is left as it was), the others train. (A rate so large that a fused table's
    # rows overflow is no test of skip: that update is written, _step_guard.py says why.)
    def with_nan_losses(config):
        task = build_task(config)
        loss_fn = task.loss_fn

        def loss(model, batch):
            return jnp.where(batch.labels[0] == 5, jnp.nan, loss_fn(model, batch))

        task.loss_fn = loss
        return task

    monkeypatch.setattr(_loop, "build_task", with_nan_losses)
    assert run(ratings, tmp_path, "--steps", "12", "--on-nonfinite", "skip") == 0
    record = metrics(tmp_path)
    skipped = record["step_stats"]["nonfinite_steps"]
    assert record["status"] == "completed" and record["steps"] == 12 and 1 <= skipped < 12
    assert f"skipped {skipped} non-finite steps" in capsys.readouterr().out
    state, _ = checkpoint_state(config(ratings, tmp_path), 12)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state)
               if jax.dtypes.issubdtype(x.dtype, np.inexact))


def test_nonfinite_predictions_of_a_finite_model_stop_the_run(ratings, tmp_path, capsys,
                                                              monkeypatch):
    # Huge but finite values can overflow in the forward pass: evaluation stops the run as a
    # non-finite step (it used to end in a metric's ValueError).
    def with_nan_predictions(config):
        task = build_task(config)
        predict = task.predict
        task.predict = lambda model, batch: predict(model, batch) * jnp.nan
        return task

    monkeypatch.setattr(_loop, "build_task", with_nan_predictions)
    assert run(ratings, tmp_path, "--steps", "4") == 1
    line = one_clear_line(capsys.readouterr().err)
    assert "step 2: non-finite loss, gradient or model value (NaN or Inf); stopped" in line
    assert metrics(tmp_path)["status"] == "nonfinite"


def test_a_second_run_on_the_same_checkpoint_dir_is_refused_at_start(ratings, tmp_path, capsys):
    with CheckpointLock(tmp_path / "ck"):
        assert run(ratings, tmp_path, "--steps", "2") == 1
    line = one_clear_line(capsys.readouterr().err)
    assert f"{tmp_path / 'ck'} is in use by another run (holder: pid {os.getpid()}" in line
    assert not (tmp_path / "out").exists()


def test_resume_refuses_settings_that_change_the_model_or_the_data(ratings, tmp_path, capsys):
    assert run(ratings, tmp_path, "--steps", "2") == 0
    capsys.readouterr()
    assert run(ratings, tmp_path, "--steps", "4", "--resume", "--seed", "1", "--batch-size", "16",
               "--embedding-dim", "8", "--dense-lr", "0.01") == 1
    line = one_clear_line(capsys.readouterr().err)
    for change in ["--seed 0 -> 1", "--batch-size 32 -> 16", "--embedding-dim 4 -> 8",
                   "pass the same flags", "another --checkpoint-dir"]:
        assert change in line, line
    assert "--dense-lr" not in line  # a rate can change
    assert all_steps(tmp_path / "ck") == [2]
    assert run(ratings, tmp_path, "--steps", "4", "--resume", "--dense-lr", "0.01",
               "--weight-decay", "0.2") == 0
    err = capsys.readouterr().err
    assert "applied --dense-lr 0.003 -> 0.01" in err and "--weight-decay 0.1 -> 0.2" in err
    assert metrics(tmp_path)["config"]["dense_learning_rate"] == 0.01


def test_resume_of_a_checkpoint_without_the_run_metadata_is_refused_clearly(
        ratings, tmp_path, capsys):
    assert run(ratings, tmp_path, "--steps", "2") == 0
    state, _ = checkpoint_state(config(ratings, tmp_path), 2)
    save_checkpoint(tmp_path / "ck", 3, state, metadata={"step": 3, "history": {"train": "x"}})
    capsys.readouterr()
    assert run(ratings, tmp_path, "--steps", "4", "--resume") == 1
    line = one_clear_line(capsys.readouterr().err)
    assert "checkpoint step=3" in line and "cannot be resumed" in line
    assert "'data_position' is None" in line and "'config'" in line and "'history'" in line


def test_resume_skips_a_corrupt_newest_checkpoint_and_sets_it_aside(ratings, tmp_path, capsys):
    assert run(ratings, tmp_path, "--steps", "3", "--checkpoint-every", "1") == 0
    # A changed byte in the metadata (the arrays' files: tests/test_checkpoint.py; here,
    # orbax's in-process cache would still hold the arrays this process just wrote).
    metadata = tmp_path / "ck" / "3" / "metadata" / "metadata"
    metadata.write_text(metadata.read_text().replace('"data_position": 3', '"data_position": 7'))
    capsys.readouterr()
    assert run(ratings, tmp_path, "--steps", "4", "--checkpoint-every", "1", "--resume") == 0
    err = capsys.readouterr().err
    assert "resuming checkpoint step 2" in err
    assert f"skipped corrupt checkpoint step 3 (moved to {tmp_path / 'ck' / '3.corrupt'})" in err
    assert all_steps(tmp_path / "ck") == [2, 3, 4] and (tmp_path / "ck" / "3.corrupt").is_dir()
    assert metrics(tmp_path)["resumed"]["from_step"] == 2


def fail_after(batches: int, error: BaseException):
    """A ``build_task`` whose training stream raises ``error`` after ``batches`` batches."""
    def failing_task(conf):
        task = build_task(conf)
        stream = task.train_batches

        def train_batches(position):
            for i, batch in enumerate(stream(position)):
                if i == batches:
                    raise error
                yield batch

        task.train_batches = train_batches
        return task

    return failing_task


def test_an_error_while_training_stops_clearly_and_still_writes_metrics(
        ratings, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_loop, "build_task", fail_after(
        3, ValueError("u.data line 77: rating 'x' is not a number")))
    with pytest.raises(TrainingStopped, match=r"after step 3: u.data line 77: .*; stopped. The "
                                              r"last checkpoint is step 3") as info:
        train(config(ratings, tmp_path, checkpoint_every=1))
    assert info.value.record["status"] == metrics(tmp_path)["status"] == "error"
    assert metrics(tmp_path)["steps"] == 3
    assert run(ratings, tmp_path / "cli", "--steps", "6") == 1
    assert "u.data line 77" in one_clear_line(capsys.readouterr().err)
    assert metrics(tmp_path / "cli")["status"] == "error"


def test_an_interrupted_run_writes_metrics_and_exits_130(ratings, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_loop, "build_task", fail_after(2, KeyboardInterrupt()))
    assert run(ratings, tmp_path, "--steps", "6") == 130
    assert "interrupted" in one_clear_line(capsys.readouterr().err)
    record = metrics(tmp_path)
    assert record["status"] == "interrupted" and record["steps"] == 2
