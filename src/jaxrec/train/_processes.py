"""``jaxrec train`` as several processes (``jaxrec launch -n N -- train``, docs/multiprocess.md).

One process trains on one device, its model unsharded. When ``jax.distributed`` has
joined several processes (``--distributed`` and its flags, or ``jaxrec launch``'s
environment), the run is one model over every process's devices:

- the tables are sharded by the planner over a mesh of all devices, a process's devices
  one host (``Topology(local_world_size=jax.local_device_count())``); the dense part is
  data parallel;
- each process reads only its share of the data (``shard=(process, processes)`` of the
  synthetic log and the Criteo reader) and places it on its own devices
  (``shard_batch(process_local=True)``, with the KJTs' static capacity, so that no
  collective runs in the data-loading thread): ``--batch-size`` is the global batch;
- the held-out metrics are computed over every process's rows (``gather``), the same in
  every process, so that evaluations, early stopping and the best model agree;
- process 0 alone writes metrics.json, curves.png and the progress lines, and holds the
  checkpoint directory's lock; every process writes its shards of each checkpoint.

With ``--epochs`` the shares' passes differ in length: every process pads its pass with
empty batches (mask 0) to the longest share's, counted before training from the lines
of each share (``equal_passes``), so that no process runs out while the others wait in a
collective. Checkpoints hold the plan-free (portable) state (``_loop.checkpoint_state``),
so a run resumes on any number of processes. Refused for now, with the reason: MovieLens
and click logs (their dense rows are numbered from every rating's raw ids), TT tables (no
sharded TT collection), plain tables (their optax state mirrors the plan) and
``--vocab dynamic`` (not planned over processes yet).
"""

from __future__ import annotations

import itertools
import math

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxrec import data, parallel
from jaxrec.nn import EmbeddingBagCollection
from jaxrec.train._config import TrainConfig

AXIS = "data"


def several() -> bool:
    """Whether this run spans several processes."""
    return jax.process_count() > 1


def data_shard() -> tuple[int, int]:
    """This process's share of the data: ``(process index, process count)``."""
    return jax.process_index(), jax.process_count()


def check(config: TrainConfig) -> None:
    """Refuses, with the reason and the fix, what several processes cannot run yet."""
    n, devices = jax.process_count(), jax.device_count()
    why = None
    if config.data_kind not in ("synthetic", "criteo"):
        why = (f"--data {config.data_kind}: only the synthetic log and Criteo files are read in "
               "shares per process so far; train it in one process")
    elif config.tt_ranks:
        why = "--tt-ranks: TT tables are not sharded; train them in one process"
    elif config.vocab == "dynamic":
        why = ("--vocab dynamic: jaxrec train does not shard dynamic tables yet (their buckets "
               "must split evenly over the devices, which --max-rows does not ensure); train it in "
               "one process")
    elif config.placement != "device":
        why = (f"--placement {config.placement}: tables in host memory are sharded over the devices of "
               "one process only so far; train it in one process, or place the tables on the device")
    elif config.table_optimizer == "plain":
        why = ("--table-optimizer plain: the optax state of sharded plain tables depends on the "
               "plan, so their checkpoints would not restore on another number of processes; "
               "use a fused table optimizer (the default rowwise_adagrad)")
    elif config.batch_size % devices:
        why = (f"--batch-size {config.batch_size} does not split over the {devices} devices of the "
               f"{n} processes; pass a multiple of {devices}")
    if why:
        raise ValueError(f"{n} processes: {why}")


def mesh() -> jax.sharding.Mesh:
    """Every process's devices on one axis, each process's devices a block in process order
    (``shard_batch(process_local=True)`` needs that)."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return jax.sharding.Mesh(np.asarray(devices), (AXIS,))


def shard_model(model, config: TrainConfig):
    """``model`` with its table collection sharded by the planner over ``mesh()``; returns
    ``(model, plan)``."""
    (ebc,) = [m for _, m in nnx.iter_modules(model)
              if isinstance(m, EmbeddingBagCollection)]
    n = jax.device_count()
    topology = parallel.Topology(world_size=n, local_world_size=jax.local_device_count(),
                                 batch_size=config.batch_size // n)
    plan = parallel.EmbeddingShardingPlanner(topology, optimizer=ebc.optimizer).plan(ebc.table_configs)
    return parallel.shard(model, plan, mesh()), plan


def place(batch, the_mesh: jax.sharding.Mesh):
    """This process's batch as global arrays over ``the_mesh`` (no collective: the KJTs keep
    their static capacity, split evenly over the local devices)."""
    capacity = batch.sparse.values().shape[0] // jax.local_device_count()
    return parallel.shard_batch(batch, the_mesh, process_local=True, capacity=capacity)


def local_rows(out: jax.Array) -> np.ndarray:
    """This process's rows of ``make_forward``'s output (``[devices, rows]``), in order."""
    shards = sorted(out.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards]).reshape(-1)


def gather(*arrays: np.ndarray) -> list[np.ndarray]:
    """Every process's ``arrays`` (equal shapes), concatenated in process order: the same
    in every process."""
    if not several():
        return list(arrays)
    return [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in arrays]


def barrier(name: str) -> None:
    """Waits until every process got here (e.g. after process 0 renamed files)."""
    if several():
        multihost_utils.sync_global_devices(name)


def largest(value: int) -> int:
    """The largest ``value`` over the processes (one all-gather)."""
    if not several():
        return value
    return int(np.max(multihost_utils.process_allgather(np.asarray(value, np.int64))))


def equal_passes(one_pass, reader: data.CriteoReader, held_out: int):
    """``one_pass`` (this share's training batches, after ``held_out`` batches) padded with
    empty batches to the longest share's pass, an upper bound counted from every share's
    lines: a step where some processes have no rows is a step of the others' rows."""
    length = largest(math.ceil(reader.count_lines() / reader.batch_size)) - held_out
    empty = reader.empty_batch()

    def padded(number):
        count = 0
        for batch in one_pass(number):
            count += 1
            yield batch
        if count > length:
            raise RuntimeError(f"this process's pass gave {count} batches, more than the {length} "
                               "its lines allow")
        yield from itertools.repeat(empty, length - count)

    return padded
