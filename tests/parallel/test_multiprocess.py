"""Several processes on one mesh (``jaxrec.parallel.launch`` / ``initialize_distributed``):
2 processes x 4 CPU devices, joined by jax.distributed (gloo collectives), train the
sharded DLRM of every sharding type equal to this process's 8 devices, each feeding its own
rows, and their checkpoint restores here on 8 devices bit for bit; a peer that dies or never
joins fails the launch within its timeout, naming the process."""

import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from multiprocess_train import STEPS, train
from parallel_testing import build, mesh, plan

import jaxrec.parallel as par
from jaxrec.checkpoint import restore_checkpoint
from jaxrec.optim import Adam

SCRIPT = str(Path(__file__).with_name("multiprocess_train.py"))
RTOL, ATOL = 2e-5, 1e-6  # as tests/parallel/test_sharded_training.py: sums in another order


def test_two_processes_train_as_one_and_their_checkpoint_restores_in_one(tmp_path):
    out, ckpt = tmp_path / "two.npz", tmp_path / "ckpt"
    assert par.launch(["python", SCRIPT, str(out), "--save", str(ckpt)], 2, cpu_devices=4, timeout_s=240) == 0
    two, one = np.load(out), train()
    assert sorted(two.files) == sorted(one)
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=RTOL)
    for name, value in one.items():
        np.testing.assert_allclose(two[name], value, rtol=RTOL, atol=ATOL, err_msg=name)
    # The 2 processes' checkpoint, restored here on 8 devices: their state, bit for bit.
    target = nnx.state(par.shard(build(Adam(learning_rate=0.05)), plan("mixed"), mesh()))
    state, meta = restore_checkpoint(ckpt, target)
    assert meta["processes"] == 2 and meta.step == STEPS
    for k, leaf in enumerate(jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(leaf), two[f"a{k}"], err_msg=f"leaf {k}")


def test_a_dead_or_hung_peer_fails_the_launch(tmp_path, capfd):
    start = time.monotonic()
    code = par.launch(["python", SCRIPT, str(tmp_path / "x.npz"), "--fail-rank", "1"], 2, cpu_devices=1,
                      timeout_s=120)
    assert code == 3 and time.monotonic() - start < 60
    assert "process 1 of 2 exited with code 3; stopping the others" in capfd.readouterr().err
    code = par.launch(["python", SCRIPT, str(tmp_path / "x.npz"), "--hang-rank", "1"], 2, cpu_devices=1,
                      timeout_s=5)
    assert code == 124
    assert "processes [0, 1] of 2 still running after 5 s; stopping them" in capfd.readouterr().err


def test_the_launch_command(capsys):
    from jaxrec.__main__ import main

    check = "import os; assert os.environ['JAXREC_NUM_PROCESSES'] == '2'"
    assert main(["launch", "-n", "2", "--", "python", "-c", check]) == 0
    with pytest.raises(SystemExit) as refused:
        main(["launch", "-n", "2", "--", "train", "--steps", "3"])
    assert refused.value.code == 2
    assert "jaxrec train runs in one process" in capsys.readouterr().err
