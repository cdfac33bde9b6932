"""The data of ``jaxrec train`` (``jaxrec.train._tasks``): no input hangs, ids get dense rows,
``--max-rows`` caps every table, and bad files are clear errors before any training.

Runs that used to hang are run on a daemon thread with a deadline, so that a regression
fails the test instead of blocking the suite.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import numpy as np
import pytest

from jaxrec.train import TrainConfig, main
from jaxrec.train._tasks import build_task

SMALL = dict(embedding_dim=4, eval_every=1000, max_rows=64)
DEADLINE_S = 30.0


def write_criteo(path: Path, rows: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(rows):
        dense = [str(rng.integers(0, 50)) if rng.random() > 0.2 else "" for _ in range(13)]
        cats = [f"{rng.integers(0, 2**32):08x}" if rng.random() > 0.1 else "" for _ in range(26)]
        lines.append("\t".join([str(rng.integers(0, 2)), *dense, *cats]))
    path.write_text("".join(line + "\n" for line in lines))
    return path


def within_deadline(fn):
    """``fn()``'s result or exception, or a test failure if it runs past the deadline."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), f"still running after {DEADLINE_S} s (a hang)"
    if "error" in out:
        raise out["error"]
    return out["value"]


def criteo_config(path, **kw):
    return TrainConfig(data=f"criteo:{path}", **{**SMALL, "batch_size": 16, "eval_batches": 2,
                                                 "steps": 5, **kw})


# -- Criteo: a file too small for the held-out split and one training batch -----------------


@pytest.mark.parametrize("rows", [1, 10, 63, 64])
def test_criteo_too_small_for_held_out_and_training(tmp_path, rows):
    path = write_criteo(tmp_path / "day_0", rows, seed=rows)
    with pytest.raises(ValueError, match=rf"day_0 holds {rows} rows; a run needs more than 64 "
                                         r"\(2 x --eval-batches 2 x --batch-size 16 held out for "
                                         r"testing and validation, then at least one row to train "
                                         r"on\)"):
        within_deadline(lambda: build_task(criteo_config(path)))


def test_criteo_one_row_past_the_held_out_split_trains(tmp_path):
    path = write_criteo(tmp_path / "day_0", 65, seed=1)
    task = build_task(criteo_config(path))
    batches = within_deadline(lambda: list(itertools.islice(task.train_batches(0), 3)))
    assert [int(np.asarray(b.mask).sum()) for b in batches] == [1, 1, 1]  # one row per pass


@pytest.mark.parametrize("what", ["empty file", "blank lines", "empty folder"])
def test_criteo_nothing_to_read_is_an_error_naming_the_source(tmp_path, what):
    if what == "empty folder":
        path = tmp_path / "days"
        path.mkdir()
        match = r"criteo:.*days is a folder without files"
    else:
        path = tmp_path / "day_0"
        path.write_text("" if what == "empty file" else "\n\n")
        match = r"day_0 holds no rows"
    with pytest.raises(ValueError, match=match):
        within_deadline(lambda: build_task(criteo_config(path)))


def test_criteo_file_shrunk_during_the_run_stops_the_stream(tmp_path):
    path = write_criteo(tmp_path / "day_0", 80, seed=2)
    task = build_task(criteo_config(path))
    write_criteo(path, 40, seed=2)  # now all of it is held out
    with pytest.raises(ValueError, match=r"day_0: pass 1 over the data gave no training batch"):
        within_deadline(lambda: list(itertools.islice(task.train_batches(0), 3)))


@pytest.mark.parametrize("rows", [0, 10, 4000])
def test_cli_criteo_small_files_end_with_a_message(tmp_path, capsys, rows):
    """The issue's reproductions, through the command line (default batch 1024, 2 x 4 held
    out)."""
    path = write_criteo(tmp_path / "train.txt", rows, seed=3)
    code = within_deadline(lambda: main(["--data", f"criteo:{path}", "--out-dir",
                                         str(tmp_path / "out")]))
    err = capsys.readouterr().err
    assert code == 1 and str(path) in err
    assert ("holds no rows" if rows == 0 else f"holds {rows} rows; a run needs more than 8192"
            ) in err


# -- MovieLens: dense rows, --max-rows, bad ratings --------------------------------------------


def write_ratings(path: Path, n: int, seed: int = 0, users=(1, 40), items=(1, 60)) -> Path:
    rng = np.random.default_rng(seed)
    lines = [f"{rng.integers(*users)}\t{rng.integers(*items)}\t{rng.integers(1, 6)}\t"
             f"{874965758 + k}\n" for k in range(n)]
    path.write_text("".join(lines))
    return path


def ratings_config(path, **kw):
    return TrainConfig(data=f"movielens:{path}", **{**SMALL, "batch_size": 16, "epochs": 1,
                                                    "steps": None, **kw})


def table_rows(task):
    return [t.num_embeddings for t in task.model.sparse_arch.table_configs]


def test_movielens_huge_user_id_gets_a_dense_row(tmp_path):
    path = write_ratings(tmp_path / "u.data", 200, seed=4)
    with path.open("a") as f:
        f.write("1500000000\t7\t4\t881250949\n")
    task = within_deadline(lambda: build_task(ratings_config(path)))
    users = np.unique([int(line.split("\t")[0]) for line in path.read_text().splitlines()])
    assert task.info["num_users"] == users.size < 50
    assert table_rows(task) == task.info["table_sizes"] == [users.size, task.info["num_items"]]


@pytest.mark.parametrize("max_rows", [5, 30, 20_000])
def test_movielens_max_rows_caps_the_tables(tmp_path, max_rows):
    path = write_ratings(tmp_path / "u.data", 300, seed=5, users=(1, 40), items=(1000, 1060))
    task = build_task(ratings_config(path, max_rows=max_rows))
    distinct = [task.info["num_users"], task.info["num_items"]]
    assert distinct[1] > 30  # the item ids need folding at max_rows 5 and 30
    assert table_rows(task) == [min(n, max_rows) for n in distinct]
    for batch in itertools.chain(task.val_batches, task.test_batches,
                                 itertools.islice(task.train_batches(0), 4)):
        assert int(np.asarray(batch.sparse.values()).max()) < max_rows


def test_movielens_100k_folder_splits_share_the_rows(tmp_path):
    folder = tmp_path / "ml-100k"
    folder.mkdir()
    write_ratings(folder / "u1.base", 120, seed=6)
    write_ratings(folder / "u1.test", 30, seed=7, users=(30, 70))  # users missing from base
    task = build_task(ratings_config(folder))
    users = np.unique([int(line.split("\t")[0]) for p in ("u1.base", "u1.test")
                       for line in (folder / p).read_text().splitlines()])
    assert task.info["num_users"] == users.size and table_rows(task)[0] == users.size


@pytest.mark.parametrize("bad", ["nan", "inf", "9"])
def test_cli_movielens_bad_rating_names_the_line(tmp_path, capsys, bad):
    path = write_ratings(tmp_path / "ratings.dat", 50, seed=8)
    lines = path.read_text().splitlines()
    lines[36] = lines[36].rsplit("\t", 2)[0] + f"\t{bad}\t874965800"
    path.write_text("\n".join(lines).replace("\t", "::") + "\n")
    code = main(["--data", f"movielens:{path}", "--epochs", "1", "--out-dir",
                 str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1 and f"ratings.dat, line 37, field rating: {float(bad)!r}" in err
