"""Sharded steps and forwards issued back to back on CPU devices finish: XLA's CPU runtime
can deadlock in a collective when ~40 of them are queued on 8 devices, so jaxrec keeps
the queue short there (``jaxrec._mesh.CpuPacer``)."""

from __future__ import annotations

import jax
import optax
from flax import nnx
from parallel_testing import B, N, build, mesh, plan, random_batch, squared_error

import jaxrec.parallel as par
from jaxrec._mesh import CPU_QUEUED
from jaxrec.nn import make_train_step
from jaxrec.optim import RowWiseAdagrad

ISSUED = 100


def slow_loss(model, batch):
    """The test model's loss, and dense work that makes a step take longer to run than to
    issue, so that the queue fills (its value is not used, but XLA keeps it)."""
    x = jax.numpy.full((192, 192), 0.01) + batch.dense[0, 0]
    for _ in range(4):
        x = jax.numpy.tanh(x @ x)
    return squared_error(model, batch, N * B) + 0.0 * x[0, 0]


def test_steps_and_forwards_issued_back_to_back_finish():
    assert ISSUED > 2 * CPU_QUEUED
    model = par.shard(build(RowWiseAdagrad(learning_rate=0.1)), plan("rows"), mesh())
    optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
    step = make_train_step(slow_loss)
    batches = [par.shard_batch(random_batch(seed, weighted=True), mesh()) for seed in range(4)]
    for i in range(ISSUED):
        step(model, optimizer, batches[i % 4])
    step.check()
    assert step.stats()["steps"] == ISSUED
    forward = par.make_forward(slow_loss)
    outputs = [forward(model, batches[i % 4]) for i in range(ISSUED)]
    jax.block_until_ready(outputs)
