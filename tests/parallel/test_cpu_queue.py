"""Sharded steps and forwards issued back to back on CPU devices finish: XLA's CPU runtime
can deadlock in a collective when ~40 of them are queued on 8 devices, so jaxrec keeps
at most ``CPU_QUEUED`` queued there (``jaxrec._mesh.CpuPacer``)."""

from __future__ import annotations

import jax
import optax
from flax import nnx
from parallel_testing import B, N, build, mesh, plan, random_batch, squared_error

import jaxrec.parallel as par
from jaxrec._mesh import CPU_QUEUED
from jaxrec.nn import make_train_step
from jaxrec.optim import RowWiseAdagrad

# Without the bound, the queue of these steps grew past CPU_QUEUED in 3 runs of 3, and
# this test hung in 2 of 3 before it counted the queue.
ISSUED = 100


def slow_loss(model, batch):
    """The test model's loss, and dense work that makes a step take longer to run than to
    issue, so that the queue fills (its value is not used, but XLA keeps it)."""
    x = jax.numpy.full((192, 192), 0.01) + batch.dense[0, 0]
    for _ in range(4):
        x = jax.numpy.tanh(x @ x)
    return squared_error(model, batch, N * B) + 0.0 * x[0, 0]


def test_steps_and_forwards_keep_a_short_queue_on_cpu_devices():
    model = par.shard(build(RowWiseAdagrad(learning_rate=0.1)), plan("rows"), mesh())
    optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
    step = make_train_step(slow_loss)
    forward = par.make_forward(slow_loss)
    batches = [par.shard_batch(random_batch(seed, weighted=True), mesh()) for seed in range(4)]
    for issue in (lambda i: step(model, optimizer, batches[i % 4]),
                  lambda i: forward(model, batches[i % 4])):
        issue(0).block_until_ready()  # compiled
        outputs, most = [], 0
        for i in range(ISSUED):
            outputs.append(issue(i))
            most = max(most, sum(not x.is_ready() for x in outputs[-2 * CPU_QUEUED:]))
        jax.block_until_ready(outputs)
        assert most <= CPU_QUEUED
    step.check()
    assert step.stats()["steps"] == ISSUED + 1
