"""Several processes on one mesh (``jaxrec.parallel.launch`` / ``initialize_distributed``):
2 processes x 4 CPU devices, joined by jax.distributed (gloo collectives), train the
sharded DLRM of every sharding type, and of TABLE_ROW_WISE tables on each of the two
processes ("hosts"), equal to this process's 8 devices, each feeding its own
rows, and their checkpoint restores here on 8 devices and in 4 processes x 2 devices bit
for bit; ``jaxrec launch -n 2 -- train`` is one run with one global AUC, whose checkpoint
resumes in one process; a peer that dies or never joins fails the launch within its
timeout, naming the process."""

import json
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from multiprocess_train import STEPS, train_plans
from parallel_testing import build, mesh, plan

import jaxrec.parallel as par
from jaxrec.checkpoint import restore_checkpoint
from jaxrec.optim import Adam

SCRIPT = str(Path(__file__).with_name("multiprocess_train.py"))
RTOL, ATOL = 2e-5, 1e-6  # as tests/parallel/test_sharded_training.py: sums in another order


def test_two_processes_train_as_one_and_their_checkpoint_restores_in_one(tmp_path):
    out, ckpt = tmp_path / "two.npz", tmp_path / "ckpt"
    assert par.launch(["python", SCRIPT, str(out), "--save", str(ckpt)], 2, cpu_devices=4, timeout_s=240) == 0
    two, one = np.load(out), train_plans()
    assert sorted(two.files) == sorted(one)
    for name, value in one.items():  # every plan's losses and state
        np.testing.assert_allclose(two[name], value, rtol=RTOL, atol=ATOL, err_msg=name)
    # The 2 processes' checkpoint, restored here on 8 devices: their state, bit for bit.
    target = nnx.state(par.shard(build(Adam(learning_rate=0.05)), plan("mixed"), mesh()))
    state, meta = restore_checkpoint(ckpt, target)
    assert meta["processes"] == 2 and meta.step == STEPS
    for k, leaf in enumerate(jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(leaf), two[f"mixed.a{k}"], err_msg=f"leaf {k}")
    # ... and in 4 processes x 2 devices (each reads the shards of its devices).
    four = tmp_path / "four.npz"
    assert par.launch(["python", SCRIPT, str(four), "--restore", str(ckpt)], 4, cpu_devices=2,
                      timeout_s=240) == 0
    four = np.load(four)
    for k in range(len(jax.tree.leaves(state))):
        np.testing.assert_array_equal(four[f"a{k}"], two[f"mixed.a{k}"], err_msg=f"leaf {k}")


def test_jaxrec_train_as_two_processes_is_one_run_that_resumes_in_one(tmp_path, capfd):
    from jaxrec.data import SyntheticClickLog
    from jaxrec.train import TrainConfig
    from jaxrec.train import train as train_run
    from jaxrec.train._loop import checkpoint_state, load_checkpoint_state
    from jaxrec.train._tasks import _TEST_START, build_task

    small = dict(steps=12, eval_every=6, batch_size=128, eval_batches=2, max_rows=500,
                 embedding_dim=8, checkpoint_dir=str(tmp_path / "ck"), out_dir=str(tmp_path / "out"))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in small.items()]
    assert par.launch(["train", *flags], 2, cpu_devices=1, timeout_s=300) == 0
    out, err = capfd.readouterr()
    assert out.count("test auc") == 1, out  # process 0 alone reports
    record = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert record["processes"] == 2 and record["devices"] == 2 and record["status"] == "completed"
    # One global AUC: the test set is both processes' shares; the best checkpoint, restored
    # unsharded here, scores their union to the same AUC.
    config = TrainConfig(**small)
    task = build_task(config)
    optimizer = nnx.Optimizer(task.model, optax.adam(1e-3), wrt=nnx.Param)
    state, _ = restore_checkpoint(config.checkpoint_dir, checkpoint_state(task.model, optimizer),
                                  step=record["test"]["step"])
    load_checkpoint_state(task.model, state)
    log = SyntheticClickLog(max_rows=config.max_rows, seed=config.seed)
    union = [b for k in range(2) for b in log.batches(config.batch_size, config.eval_batches,
                                                      start=_TEST_START, shard=(k, 2))]
    auc = task.evaluate(nnx.jit(task.predict), union)["auc"]
    assert abs(auc - record["final"]["auc"]) < 1e-4, (auc, record["final"])
    # The 2 processes' checkpoint resumes in this one process (another process count).
    resumed = train_run(TrainConfig(**{**small, "steps": 18}, resume=True))
    assert resumed["resumed"]["from_step"] == 12 and resumed["steps"] == 18
    assert resumed["status"] == "completed" and resumed["processes"] == 1


def test_a_dead_or_hung_peer_fails_the_launch(tmp_path, capfd):
    start = time.monotonic()
    code = par.launch(["python", SCRIPT, str(tmp_path / "x.npz"), "--fail-rank", "1"], 2, cpu_devices=1,
                      timeout_s=120)
    assert code == 3 and time.monotonic() - start < 60
    assert "process 1 of 2 exited with code 3; stopping the others" in capfd.readouterr().err
    code = par.launch(["python", SCRIPT, str(tmp_path / "x.npz"), "--hang-rank", "1"], 2, cpu_devices=1,
                      timeout_s=2)  # idle time: rank 0 waits for rank 1, which sleeps
    assert code == 124
    assert "processes [0, 1] of 2 still running after 2 s; stopping them" in capfd.readouterr().err


def test_the_launch_command(capsys):
    from jaxrec.__main__ import main

    check = "import os; assert os.environ['JAXREC_NUM_PROCESSES'] == '2'"
    assert main(["launch", "-n", "2", "--", "python", "-c", check]) == 0


def test_what_several_processes_cannot_train_yet_is_refused_clearly(monkeypatch):
    from jaxrec.train import TrainConfig, _processes

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for changes, why in [({"data": "movielens:x"}, "only the synthetic log and Criteo"),
                         ({"tt_ranks": (4, 4)}, "TT tables are not sharded"),
                         ({"table_optimizer": "plain"}, "use a fused table optimizer"),
                         ({"placement": "host_cached"}, "tables in host memory are sharded over the devices of one"),
                         ({"batch_size": 100}, "pass a multiple of 8")]:
        with pytest.raises(ValueError, match=f"2 processes: .*{why}"):
            _processes.check(TrainConfig(**changes))
