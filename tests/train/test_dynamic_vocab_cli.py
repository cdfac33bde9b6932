"""``jaxrec train --vocab dynamic``: Criteo's raw hex values reach dynamic tables as int64
ids, unmodded; the tables have the modulo tables' rows (rounded down to buckets, at least one); training
inserts ids and evaluation only looks them up (unknown ids counted); a resumed run equals
the uninterrupted one; the statistics reach metrics.json and the summary; the default
(``--vocab modulo``) stays as it was."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrec import data
from jaxrec.checkpoint import restore_checkpoint
from jaxrec.ops import hash_table
from jaxrec.train import TrainConfig, _processes, main, train
from jaxrec.train._loop import DENSE_OPTIMIZERS, checkpoint_state
from jaxrec.train._tasks import build_task
from jaxrec.train._vocab import dynamic_slots

BIG = 0xFFFFFFF0  # a C1 value far beyond every table's rows and beyond int32
FLAGS = ["--batch-size", "32", "--max-rows", "500", "--embedding-dim", "8", "--eval-every", "4",
         "--eval-batches", "2", "--backend", "reference"]


def write_criteo(path, rows: int, seed: int = 0) -> None:
    """Criteo TSV lines whose categorical values recur (40 per feature, so training finds
    ids again), C1's values near 2**32; the label follows C2's value."""
    rng = np.random.default_rng(seed)
    pools = rng.integers(0, 2**32, size=(26, 40))
    pools[0] = BIG - np.arange(40)
    lines = []
    for _ in range(rows):
        cats = [int(pool[rng.integers(0, 40)]) for pool in pools]
        dense = [str(rng.integers(0, 50)) for _ in range(13)]
        label = str(int(cats[1] % 2 == 0 or rng.random() < 0.2))
        lines.append("\t".join([label, *dense, *(f"{c:08x}" for c in cats)]))
    path.write_text("\n".join(lines) + "\n")


def checkpoints(config: TrainConfig, step: int, *directories) -> list[dict]:
    """The state of each directory's checkpoint ``step``, restored into one target built from
    ``config`` (their index arrays int64: restored with 64-bit types on)."""
    with jax.enable_x64(True):
        task = build_task(config)
        tx = DENSE_OPTIMIZERS[config.dense_optimizer](config.dense_learning_rate)
        target = checkpoint_state(task.model, nnx.Optimizer(task.model, tx, wrt=nnx.Param))
        states = [restore_checkpoint(d, target, step=step)[0] for d in directories]
    return [jax.tree.map(np.asarray, state) for state in states]


def held_ids(state: dict, table: str, since: int = 0) -> np.ndarray:
    """Ids that table ``table`` holds and that training saw at fused step ``since`` or later."""
    index = state["model"]["sparse_arch"]["tables"][table]["index"]
    table = hash_table.HashTable(*(index[f] for f in hash_table.HashTable._fields))
    return hash_table.changed_since(table, since)[0]


def test_criteo_run_takes_raw_ids_reports_its_tables_and_resumes_exactly(tmp_path, capsys):
    path = tmp_path / "day_0"
    write_criteo(path, 300)
    run = ["--data", f"criteo:{path}", "--vocab", "dynamic", *FLAGS]
    assert main([*run, "--steps", "8", "--checkpoint-dir", str(tmp_path / "a"),
                 "--out-dir", str(tmp_path / "out_a")]) == 0
    assert "dynamic tables (26, lru eviction): " in capsys.readouterr().out
    assert not jax.config.jax_enable_x64  # the run turned 64-bit types on for itself only
    whole = json.loads((tmp_path / "out_a" / "metrics.json").read_text())
    stats = whole["dynamic_vocab"]
    sizes = [min(n, 500) for n in data.CRITEO_KAGGLE_CARDINALITIES]
    assert [stats["tables"][f"t_C{j + 1}"]["slots"] for j in range(26)] == [
        dynamic_slots(n)[0] for n in sizes] == whole["data"]["table_sizes"]
    assert stats["tables"]["t_C1"]["slots"] == 384 and stats["tables"]["t_C9"]["slots"] == 128
    assert stats["total"]["inserted"] > 0 and stats["total"]["index_bytes"] > 0
    assert stats["test"]["ids"] == 2 * 32 * 26  # every test row holds one id per feature

    # Interrupted after 4 steps and resumed (its checkpoint is compared at the end).
    assert main([*run, "--steps", "4", "--checkpoint-dir", str(tmp_path / "b"),
                 "--out-dir", str(tmp_path / "out_b")]) == 0
    assert main([*run, "--steps", "8", "--checkpoint-dir", str(tmp_path / "b"), "--resume",
                 "--out-dir", str(tmp_path / "out_b")]) == 0
    config = TrainConfig(data=f"criteo:{path}", vocab="dynamic", batch_size=32, max_rows=500,
                         embedding_dim=8, backend="reference")
    state, resumed_state = checkpoints(config, 8, tmp_path / "a", tmp_path / "b")

    # The raw value reached the index unmodded: an int64 id beyond the rows and int32.
    c1 = held_ids(state, "t_C1")
    assert c1.dtype == np.int64 and c1.size > 30 and set(c1) <= set(range(BIG - 39, BIG + 1))
    # The model computes in float32: no float64 crept in with the 64-bit types.
    floats = {x.dtype for x in jax.tree.leaves(state) if np.issubdtype(x.dtype, np.floating)}
    assert floats == {np.dtype(np.float32)}

    # The interrupted and resumed run: the same state, index and counters.
    resumed = json.loads((tmp_path / "out_b" / "metrics.json").read_text())
    leaves_a, leaves_b = jax.tree.leaves(state), jax.tree.leaves(resumed_state)
    assert len(leaves_a) == len(leaves_b) > 26 * 5
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(x, y)
    assert resumed["dynamic_vocab"] == stats and resumed["final"] == whole["final"]


def test_synthetic_run_evaluates_without_inserting_and_trains_on_after(tmp_path):
    # The synthetic log's ids are Zipf over the 256 rows: the validation and test batches
    # hold ids of the tail that the 6 training batches never drew.
    config = TrainConfig(vocab="dynamic", steps=6, batch_size=64, max_rows=256, embedding_dim=8,
                         eval_every=3, eval_batches=2, backend="reference",
                         checkpoint_dir=str(tmp_path / "ck"), out_dir=str(tmp_path / "out"))
    stats = train(config)["dynamic_vocab"]
    # Evaluation ran in eval mode: unknown ids were counted (training would have inserted them).
    assert stats["total"]["unknown_lookups"] > stats["test"]["unknown_ids"] > 0
    assert stats["test"]["ids"] == 2 * 64 * 26
    # ...and training went on in train mode after the evaluation at step 3: the tables saw
    # ids at the last step (fused step 5, counted from 0).
    [state] = checkpoints(config, 6, tmp_path / "ck")
    for table in ("t_C1", "t_C3"):
        assert held_ids(state, table, since=5).size > 0
        assert held_ids(state, table, since=6).size == 0


def test_the_default_stays_modulo_hashing(tmp_path):
    path = tmp_path / "day_0"
    write_criteo(path, 200)
    config = TrainConfig(data=f"criteo:{path}", batch_size=32, max_rows=500, eval_batches=2)
    assert config.vocab == "modulo"
    task = build_task(config)
    sizes = [min(n, 500) for n in data.CRITEO_KAGGLE_CARDINALITIES]
    reader = data.CriteoReader(path, batch_size=32, num_embeddings_per_feature=sizes)
    want = list(reader)[4]  # the first training batch: 2 test and 2 validation batches before it
    got = next(task.train_batches(0))
    assert got.sparse.values().dtype == np.int32
    np.testing.assert_array_equal(got.sparse.values(), want.sparse.values())
    assert int(got.sparse.values().max()) < 500
    ebc = task.model.sparse_arch
    assert not any(g.dynamic for g in ebc.groups) and len(ebc.groups) == 1
    assert task.info["table_sizes"] == sizes


@pytest.mark.parametrize("changes, message", [
    (dict(vocab="hashed"), "vocab must be one of ('modulo', 'dynamic'), got 'hashed'"),
    (dict(vocab="dynamic", data="movielens:x"), "--vocab dynamic applies to click data"),
    (dict(vocab="dynamic", table_optimizer="plain"), "--vocab dynamic needs a fused table optimizer"),
    (dict(vocab="dynamic", tt_ranks=(4, 4)),
     "--vocab dynamic makes every table a dynamic vocabulary, and a table is either TT or dynamic: drop --tt-ranks"),
])
def test_bad_vocab_settings_are_refused_with_the_fix(changes, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        TrainConfig(**changes)


def test_resume_refuses_another_vocab_and_reads_old_checkpoints_as_modulo():
    saved = json.loads(json.dumps(dataclasses.asdict(TrainConfig())))
    del saved["vocab"]  # a checkpoint written before --vocab existed trained modulo
    assert TrainConfig().resume_differences(saved) == ([], [])
    refused, _ = TrainConfig(vocab="dynamic").resume_differences(saved)
    assert refused == ["--vocab modulo -> dynamic"]


def test_several_processes_refuse_dynamic_tables(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="2 processes: --vocab dynamic: jaxrec train does not shard"):
        _processes.check(TrainConfig(vocab="dynamic"))
