"""``jaxrec train --placement host_cached``: the dense tables a cache of
``--cache-load-factor`` of their rows would not hold whole (and that hold two batches of
ids) live in host memory with that cache on the device; the run trains, resumes exactly
and refuses what it cannot do. ``--placement host``: the dense tables of two batches of
ids of rows live in host memory; the run trains as the device-placed one."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jaxrec.checkpoint import restore_checkpoint
from jaxrec.ops.host_cache import in_host_memory
from jaxrec.train import TrainConfig, main
from jaxrec.train._loop import DENSE_OPTIMIZERS, checkpoint_state
from jaxrec.train._tasks import build_task

FLAGS = ["--data", "synthetic", "--placement", "host_cached", "--batch-size", "32", "--max-rows", "500",
         "--embedding-dim", "8", "--eval-every", "4", "--eval-batches", "2"]


def restore_target(config: TrainConfig, task):
    """What a run of ``config`` checkpoints, from its ``task``: the structure a restore fills."""
    import optax  # noqa: F401  (the dense optimizer's state)
    from flax import nnx

    tx = DENSE_OPTIMIZERS[config.dense_optimizer](config.dense_learning_rate)
    return checkpoint_state(task.model, nnx.Optimizer(task.model, tx, wrt=nnx.Param))


def test_a_host_cached_run_trains_and_resumes_exactly(tmp_path, capsys):
    config = TrainConfig(placement="host_cached", batch_size=32, max_rows=500, embedding_dim=8)
    task = build_task(config)
    ebc = task.model.sparse_arch
    # host-cached: the tables whose cache (0.2 of the rows, in buckets of 128) is smaller
    # than the table and holds two batches of 32 ids; the others stay on the device
    cached = {t.name: 64 <= t.cache_size() < t.num_embeddings for t in ebc.table_configs
              if t.placement == "host_cached"}
    assert len(cached) > 1 and all(cached.values())
    assert any(t.placement == "device" for t in ebc.table_configs)
    assert in_host_memory(ebc.caches[0].get_value().rows.weights)

    assert main([*FLAGS, "--steps", "8", "--checkpoint-dir", str(tmp_path / "a"),
                 "--out-dir", str(tmp_path / "out_a")]) == 0
    assert main([*FLAGS, "--steps", "4", "--checkpoint-dir", str(tmp_path / "b"),
                 "--out-dir", str(tmp_path / "out_b")]) == 0
    assert main([*FLAGS, "--steps", "8", "--checkpoint-dir", str(tmp_path / "b"), "--resume",
                 "--out-dir", str(tmp_path / "out_b")]) == 0
    assert "host-cached tables (" in capsys.readouterr().out
    whole, resumed = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("out_a", "out_b"))
    assert resumed["final"] == whole["final"] and resumed["host_cache"]["tables"].keys() == cached.keys()
    assert whole["host_cache"]["total"]["inserted"] > whole["host_cache"]["total"]["size"] > 0
    target = restore_target(config, task)  # both runs' checkpoints restore into it
    leaves_a, leaves_b = (jax.tree.leaves(restore_checkpoint(tmp_path / d, target, step=8)[0])
                          for d in ("a", "b"))
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(x, y)
    # a resumed run must keep the placement
    capsys.readouterr()
    assert main([*FLAGS[:2], *FLAGS[4:], "--steps", "9", "--checkpoint-dir", str(tmp_path / "b"),
                 "--resume", "--out-dir", str(tmp_path / "out_c")]) != 0
    assert "--placement host_cached -> device" in capsys.readouterr().err


def test_a_host_placed_run_trains_as_the_device_placed_one(tmp_path):
    config = TrainConfig(placement="host", batch_size=32, max_rows=500, embedding_dim=8)
    ebc = build_task(config).model.sparse_arch
    placed = [t.name for t in ebc.table_configs if t.placement == "host"]
    assert len(placed) > 1 and any(t.placement == "device" for t in ebc.table_configs)
    assert all(t.num_embeddings >= 64 for t in ebc.table_configs if t.name in placed)
    runs = {}
    for placement in ("host", "device"):
        flags = [*FLAGS[:2], "--placement", placement, *FLAGS[4:], "--steps", "8"]
        assert main([*flags, "--out-dir", str(tmp_path / placement)]) == 0
        runs[placement] = json.loads((tmp_path / placement / "metrics.json").read_text())["final"]
    # the host-placed tables are looked up apart: XLA may sum the outputs in another order
    assert runs["host"].keys() == runs["device"].keys() >= {"auc", "log_loss"}
    for key in ("auc", "log_loss"):
        np.testing.assert_allclose(runs["host"][key], runs["device"][key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("changes, message", [
    (dict(placement="uvm"), r"placement must be one of \('device', 'host', 'host_cached'\), got 'uvm'"),
    (dict(placement="host", table_optimizer="plain"), "--placement host needs a fused table optimizer"),
    (dict(placement="host_cached", table_optimizer="plain"), "needs a fused table optimizer"),
    (dict(placement="host_cached", vocab="dynamic"), "drop one of them"),
    (dict(placement="host_cached", cache_load_factor=0.0), r"cache_load_factor must lie in \(0, 1\]"),
])
def test_bad_placements_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**changes)
