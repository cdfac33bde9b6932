"""One process of tests/parallel/test_multiprocess.py: the sharded DLRM of the "mixed" plan
(every sharding type, TABLE_ROW_WISE inside one "host" of 4 devices) and of the
"table_row_wise" plan (every table inside one host, the hosts taking turns) trained 3 steps
with fused Adam on weighted ids, each process feeding only its own rows of the global batch
(``shard_batch(..., process_local=True)``); process 0 saves the losses and the whole model
state, and with ``--save`` every process writes its shards of the "mixed" model's
checkpoint.

    jaxrec launch -n 2 --cpu-devices 4 -- python multiprocess_train.py OUT.npz [--save DIR]
    (or --fail-rank R, --hang-rank R: a peer that dies, or never joins)
    jaxrec launch -n 4 --cpu-devices 2 -- python multiprocess_train.py OUT.npz --restore DIR
    (the model of the same plan on the 4 processes' 8 devices, restored from DIR)

``train_plans()`` is also what the test runs in its own process on 8 devices, to compare.
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

STEPS = 3
PLANS = ("mixed", "table_row_wise")


def train_plans(save: str | None = None) -> dict[str, np.ndarray]:
    """Losses and state of each plan of ``PLANS``, as ``"<plan>.<name>"``."""
    out = {}
    for kind in PLANS:
        result = train(kind, save=save if kind == "mixed" else None)
        out.update({f"{kind}.{name}": x for name, x in result.items()})
    return out


def train(kind: str, save: str | None = None) -> dict[str, np.ndarray]:
    import jax
    import optax
    from flax import nnx
    from parallel_testing import B, build, mesh, plan, random_batch, squared_error

    import jaxrec.parallel as par
    from jaxrec.nn import make_train_step
    from jaxrec.optim import Adam
    from jaxrec.parallel._train import _slice as slice_rows

    model = par.shard(build(Adam(learning_rate=0.05)), plan(kind), mesh())
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = make_train_step(lambda m, b: squared_error(m, b, B))
    rank, count = jax.process_index(), jax.process_count()
    mine = [k for k, d in enumerate(mesh().devices.flat) if d.process_index == rank]
    assert mine == list(range(rank * len(mine), (rank + 1) * len(mine))), mine  # a block of the mesh
    losses = []
    for i in range(STEPS):  # each process builds only its own rows of the global batch
        local = slice_rows(random_batch(i, weighted=True), rank, count)
        losses.append(float(step(model, optimizer, par.shard_batch(local, mesh(), process_local=True))))

    if save:  # every process writes its shards of the state (orbax), process 0 the manifest
        from jaxrec.checkpoint import save_checkpoint

        save_checkpoint(save, STEPS, nnx.state(model), metadata={"processes": count})
    return {"losses": np.asarray(losses), **gathered(nnx.state(model))}


def restore(directory: str) -> dict[str, np.ndarray]:
    """The model of ``train`` restored from ``directory`` on this run's devices."""
    from flax import nnx
    from parallel_testing import build, mesh, plan

    import jaxrec.parallel as par
    from jaxrec.checkpoint import restore_checkpoint
    from jaxrec.optim import Adam

    target = nnx.state(par.shard(build(Adam(learning_rate=0.05)), plan("mixed"), mesh()))
    state, _ = restore_checkpoint(directory, target)
    return gathered(state)


def gathered(state) -> dict[str, np.ndarray]:
    """Every leaf whole in this process (a global array spans other processes' devices)."""
    import jax
    from jax.experimental import multihost_utils

    def whole(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return {f"a{k}": whole(x) for k, x in enumerate(jax.tree.leaves(state))}


if __name__ == "__main__":
    out, rank = sys.argv[1], int(os.environ.get("JAXREC_PROCESS_ID", "0"))
    if sys.argv[2:4] == ["--fail-rank", str(rank)]:
        sys.exit(3)  # a peer that dies before joining
    if sys.argv[2:4] == ["--hang-rank", str(rank)]:
        time.sleep(3600)  # a peer that never joins
    import jaxrec.parallel as par

    par.initialize_distributed(timeout_s=60)  # before any computation
    if sys.argv[2:3] == ["--restore"]:
        result = restore(sys.argv[3])
    else:
        result = train_plans(save=sys.argv[3] if sys.argv[2:3] == ["--save"] else None)
    import jax

    if jax.process_index() == 0:
        np.savez(out, **result)
