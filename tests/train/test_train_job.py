"""The ``jaxrec train`` main job: it learns, writes its outputs, resumes exactly, reads every
data source, and says what is wrong with bad input."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrec.checkpoint import all_steps, restore_checkpoint
from jaxrec.train import TrainConfig, main, train
from jaxrec.train._tasks import best_evaluation, build_task, ratings_splits

SMALL = dict(batch_size=128, max_rows=500, embedding_dim=8, eval_every=20, eval_batches=2)
CRITEO_SAMPLE = (Path(__file__).resolve().parents[3] / "shared" / "data" / "criteo_sample"
                 / "criteo_kaggle_format_100rows.tsv")


def test_default_command_learns_and_writes_its_outputs(tmp_path, capsys):
    # 90 steps (the test AUC is 0.67; 0.50 untrained, 0.70 after 300 steps; the teacher's 0.87).
    out = tmp_path / "run"
    assert main(["--steps", "90", "--batch-size", "512", "--eval-every", "30",
                 "--out-dir", str(out)]) == 0
    record = json.loads((out / "metrics.json").read_text())
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert record["config"]["model"] == "dlrm" and record["steps"] == 90
    assert [e["step"] for e in record["history"]["eval"]] == [30, 60, 90]
    assert record["final"]["auc"] > 0.65, record["final"]
    assert record["train_samples_per_s"] > 0
    assert "test auc" in capsys.readouterr().out


def fresh_state(config):
    """A new run's state, in the form its checkpoints hold."""
    from jaxrec.train._loop import DENSE_OPTIMIZERS, checkpoint_state

    task = build_task(config)
    tx = DENSE_OPTIMIZERS[config.dense_optimizer](config.dense_learning_rate)
    return checkpoint_state(task.model, nnx.Optimizer(task.model, tx, wrt=nnx.Param))


# Also what test_checkpoint_restores_the_model_bit_exactly checked (the first run's
# checkpoint holds the trained state, its step and history; DLRM, fused rowwise Adagrad
# tables, as it ran), on the checkpoints these runs write anyway: one compiled run fewer.
# 8 steps: resuming after 4 still replays the optimizer state, the data position and the
# history. One fresh state is the target of every restore (a restore reads only its
# structure: the runs differ in steps and folders, not in the model).
@pytest.mark.parametrize("table_optimizer, model", [("rowwise_adagrad", "dlrm"), ("plain", "dcn")])
def test_resumed_run_equals_the_uninterrupted_run(tmp_path, table_optimizer, model):
    common = dict(SMALL, table_optimizer=table_optimizer, model=model, eval_every=4)
    whole = TrainConfig(**common, steps=8, checkpoint_dir=str(tmp_path / "a"),
                        out_dir=str(tmp_path / "out_a"))
    train(whole)
    first = TrainConfig(**common, steps=4, checkpoint_dir=str(tmp_path / "b"),
                        out_dir=str(tmp_path / "out_b"))
    train(first)
    fresh = fresh_state(first)
    initial = [np.array(x) for x in jax.tree.leaves(fresh["model"])]  # copies, before any restore
    state, meta = restore_checkpoint(tmp_path / "b", fresh, step=4)
    changed = [not np.array_equal(np.asarray(x), y) for x, y in zip(jax.tree.leaves(state["model"]), initial)]
    assert any(changed)  # the checkpoint holds the trained state, not the initial one
    assert meta["step"] == 4 and len(meta["history"]["eval"]) == 1
    resumed = TrainConfig(**common, steps=8, checkpoint_dir=str(tmp_path / "b"), resume=True,
                          out_dir=str(tmp_path / "out_b"))
    record = train(resumed)
    assert all_steps(tmp_path / "b") == [4, 8]
    a, meta_a = restore_checkpoint(tmp_path / "a", fresh, step=8)
    b, meta_b = restore_checkpoint(tmp_path / "b", fresh, step=8)
    assert meta_a["data_position"] == meta_b["data_position"] == 8
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 10
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # The resumed run's history continues the first one's.
    assert [e["step"] for e in record["history"]["eval"]] == [4, 8]


def write_criteo(path: Path, rows: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(rows):
        label = str(rng.integers(0, 2))
        dense = [str(rng.integers(0, 50)) if rng.random() > 0.2 else "" for _ in range(13)]
        cats = [f"{rng.integers(0, 2**32):08x}" if rng.random() > 0.1 else "" for _ in range(26)]
        lines.append("\t".join([label, *dense, *cats]))
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("source", ["fixture", "shared_sample"])
def test_criteo_files_train(tmp_path, source):
    if source == "fixture":
        path = tmp_path / "day_0"
        write_criteo(path, 300)
    else:
        if not CRITEO_SAMPLE.is_file():
            pytest.skip(f"{CRITEO_SAMPLE} is not present")
        path = CRITEO_SAMPLE
    config = TrainConfig(data=f"criteo:{path}", **{**SMALL, "batch_size": 16}, steps=12,
                         out_dir=str(tmp_path / "out"))
    record = train(config)
    assert record["steps"] == 12 and 0.0 <= record["final"]["auc"] <= 1.0
    assert record["data"]["files"] == [str(path)]
    assert record["dynamic_vocab"] is None  # the default, --vocab modulo: no dynamic tables


def test_criteo_epochs_end_the_run(tmp_path):
    write_criteo(tmp_path / "day_0", 100)
    config = TrainConfig(data=f"criteo:{tmp_path}", **{**SMALL, "batch_size": 16}, steps=None,
                         epochs=2, out_dir=str(tmp_path / "out"))
    # 100 rows = 7 batches (the last padded); 2 test and 2 validation batches are held out
    # -> 3 per epoch.
    assert train(config)["steps"] == 6


def test_movielens_ratings_train(tmp_path):
    # The same ratings in both layouts. The layout is detected and parsed when the file is
    # read, and everything after is one code path: the run trains on u.data (one compiled
    # run, not one per layout), and ratings.dat must give the very same splits.
    rng = np.random.default_rng(1)
    users, items, n = 30, 20, 1200
    u, v = rng.normal(size=(users, 3)), rng.normal(size=(items, 3))
    uid, iid = rng.integers(1, users, n), rng.integers(1, items, n)
    rating = np.clip(np.round(3 + (u[uid] * v[iid]).sum(1)), 1, 5).astype(int)
    configs = {}
    for layout, sep in (("u.data", "\t"), ("ratings.dat", "::")):
        (tmp_path / layout).write_text("".join(
            f"{a}{sep}{b}{sep}{r}{sep}{874965758 + k}\n" for k, (a, b, r) in enumerate(zip(uid, iid, rating))))
        configs[layout] = TrainConfig(data=f"movielens:{tmp_path / layout}", batch_size=64, epochs=8,
                                      steps=None, eval_every=1000, table_learning_rate=0.3,
                                      out_dir=str(tmp_path / "out"))
    for a, b in zip(ratings_splits(configs["u.data"]), ratings_splits(configs["ratings.dat"]), strict=True):
        assert len(a) == len(b) > 0
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)
    config = configs["u.data"]
    record = train(config)
    # 10% test, then 10% of the rest validation: 1200 - 120 - 108 ratings train.
    assert config.model == "mf" and record["steps"] == 8 * (972 // 64)
    written = json.loads((tmp_path / "out" / "metrics.json").read_text())
    rmse = written["final"]["rmse"]
    assert rmse < float(np.std(rating)), rmse  # better than predicting the mean
    assert written["best"] == best_evaluation("ratings", written["history"]["eval"])


def test_best_evaluation_is_the_best_point_of_the_curve():
    curve = [{"step": 10, "rmse": 1.2, "mae": 0.9}, {"step": 20, "rmse": 0.95, "mae": 0.8},
             {"step": 30, "rmse": 0.95, "mae": 0.7}, {"step": 40, "rmse": 1.01, "mae": 0.6}]
    assert best_evaluation("ratings", curve) == curve[1]  # lowest RMSE, earliest of equals
    clicks = [{"step": 5, "auc": 0.7, "log_loss": 0.5}, {"step": 9, "auc": 0.71, "log_loss": 0.6}]
    assert best_evaluation("ctr", clicks) == clicks[1]  # highest AUC
    assert best_evaluation("ctr", []) == {}


def test_a_run_in_epochs_evaluates_at_every_epoch_end(tmp_path):
    rng = np.random.default_rng(5)
    (tmp_path / "u.data").write_text("".join(
        f"{rng.integers(1, 20)}\t{rng.integers(1, 15)}\t{rng.integers(1, 6)}\t{k}\n" for k in range(300)))
    record = train(TrainConfig(data=f"movielens:{tmp_path / 'u.data'}", batch_size=32, epochs=3,
                               steps=None, out_dir=str(tmp_path / "out")))
    per_epoch = 243 // 32  # 81% of the ratings train; the partial last batch is dropped
    assert [e["step"] for e in record["history"]["eval"]] == [per_epoch, 2 * per_epoch, 3 * per_epoch]


def test_mf_is_biased_and_its_weight_decay_pulls_the_rows_each_rating_uses(tmp_path):
    rng = np.random.default_rng(5)
    lines = "".join(f"{rng.integers(1, 9)}\t{rng.integers(1, 7)}\t{rng.integers(1, 6)}\t{k}\n"
                    for k in range(60))
    (tmp_path / "u.data").write_text(lines)
    losses = {}
    for decay in (0.0, 0.3):
        task = build_task(TrainConfig(data=f"movielens:{tmp_path / 'u.data'}", batch_size=16,
                                      steps=1, weight_decay=decay, embedding_dim=4,
                                      backend="reference"))
        batch = next(task.train_batches(0))
        losses[decay] = float(nnx.jit(task.loss_fn)(task.model, batch))  # one compile, not op by op
    assert task.model.biased  # factors | bias: each table has embedding_dim + 1 columns
    tables = {k: np.asarray(v, np.float64) for k, v in
              task.model.sparse_arch.split_embedding_weights().items()}
    assert all(t.shape[1] == 5 for t in tables.values())
    mask = np.asarray(batch.mask, np.float64)
    norms = 0.0
    for k in batch.sparse.keys():  # one id per bag (none in padding rows)
        bags = batch.sparse[k]
        ids = np.asarray(bags.values())[np.asarray(bags.offsets())[:-1]]
        rows = tables[f"t_{k}"][ids] * (np.asarray(bags.lengths()) == 1)[:, None]
        norms = norms + (rows ** 2).sum(1)
    want = losses[0.0] + 0.3 * (norms * mask).sum() / mask.sum()
    np.testing.assert_allclose(losses[0.3], want, rtol=1e-5)


def test_rating_predictions_stay_on_the_star_scale(tmp_path):
    rng = np.random.default_rng(4)
    lines = "".join(f"{rng.integers(1, 9)}\t{rng.integers(1, 7)}\t{rng.integers(1, 6)}\t{k}\n"
                    for k in range(40))
    (tmp_path / "u.data").write_text(lines)
    task = build_task(TrainConfig(data=f"movielens:{tmp_path / 'u.data'}", batch_size=8, steps=1))
    predict = nnx.jit(task.predict)  # one compile, not op by op
    for offset, want in ((100.0, 5.0), (-100.0, 0.5)):  # a model far off either end
        task.model.bias[...] = offset
        got = np.concatenate([np.asarray(predict(task.model, b)) for b in task.test_batches])
        assert (got == want).all(), (offset, got)


@pytest.mark.parametrize("args, message", [
    (["--data", "parquet:x"], "data must be 'synthetic', 'criteo:PATH', 'movielens:PATH' or 'clicks:PATH'"),
    (["--data", "movielens:x", "--model", "dlrm"], "does not fit data 'movielens'"),
    (["--batch-size", "0"], "batch_size must be an int >= 1, got 0"),
    (["--table-lr", "inf"], "table_learning_rate must be a finite number > 0, got inf"),
    (["--weight-decay", "0.1"], "weight_decay applies to ratings (movielens data)"),
    (["--data", "movielens:x", "--weight-decay", "-1"],
     "weight_decay must be a finite number >= 0, got -1.0"),
    (["--resume"], "resume needs checkpoint_dir"),
    (["--data", "criteo:/no/such/file.tsv"], "/no/such/file.tsv"),
    (["--data", "movielens:/no/such/u.data"], "MovieLens ratings file not found"),
])
def test_bad_input_gets_a_clear_message(args, message, capsys, tmp_path):
    assert main([*args, "--out-dir", str(tmp_path)]) != 0
    assert message in capsys.readouterr().err


def test_file_in_the_wrong_format(tmp_path, capsys):
    bad = tmp_path / "train.txt"
    bad.write_text("1\t2\t3\n")
    assert main(["--data", f"criteo:{bad}", "--steps", "2", "--out-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert str(bad) in err and "line 1" in err
    assert main(["--data", f"movielens:{bad}", "--steps", "2", "--out-dir", str(tmp_path)]) == 1
    assert "line 1" in capsys.readouterr().err


def test_resume_without_a_checkpoint(tmp_path, capsys):
    assert main(["--checkpoint-dir", str(tmp_path / "none"), "--resume", "--steps", "2",
                 "--out-dir", str(tmp_path)]) == 1
    assert "no checkpoint in" in capsys.readouterr().err


def test_each_process_pads_its_pass_of_a_criteo_file_to_the_longest(tmp_path, monkeypatch):
    """--epochs on several processes: every share's pass has the longest share's length
    (padding batches hold no rows), so that no process runs out while the others train."""
    import itertools
    import math

    from jaxrec.data import CriteoReader
    from jaxrec.train import _processes

    path = tmp_path / "day_0"
    write_criteo(path, 203)
    readers = [CriteoReader(path, batch_size=8, num_embeddings_per_feature=50, shard=(k, 3))
               for k in range(3)]
    longest = max(math.ceil(r.count_lines() / 8) for r in readers)
    monkeypatch.setattr(_processes, "largest", lambda value: longest)  # the all-gather's answer
    held_out, rows = 2, 0
    for r in readers:
        one_pass = _processes.equal_passes(lambda _, r=r: itertools.islice(iter(r), held_out, None),
                                           r, held_out)
        for number in range(2):  # every pass alike
            batches = list(one_pass(number))
            assert len(batches) == longest - held_out
            rows += int(sum(np.asarray(b.mask).sum() for b in batches))
        rows += int(sum(np.asarray(b.mask).sum() for b in itertools.islice(iter(r), held_out)))
    held = 3 * held_out * 8  # rows held out by the 3 shares, read once above
    assert rows == 2 * (203 - held) + held  # two passes of every training row, no row twice
