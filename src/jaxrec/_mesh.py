"""``on_mesh`` / ``replicate``: arrays replicated over a mesh, shared by the train step
(``jaxrec.nn``), the sharded collections (``jaxrec.parallel``) and ``jaxrec train``;
``to_host``: an array whole on the host, also across processes (the portable tables,
checkpoints); ``CpuPacer``: a bound on the computations queued on a mesh of CPU devices."""

from __future__ import annotations

import collections
import functools

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def default_device() -> jax.Device:
    """The device that ``jnp`` places new arrays on: ``jax.default_device``'s, else the first."""
    device = jax.config.jax_default_device
    if device is None or isinstance(device, str):
        device = jax.devices(device)[0]
    return device


def on_mesh(x, mesh: jax.sharding.Mesh):
    """``x`` itself when it lives on ``mesh``, else a replicated copy over ``mesh``.

    Over the devices of several processes, the copy is made from the host value: a
    ``device_put`` of a one-device array onto other processes' devices builds an array
    whose shards cannot be read (JAX, one device per process), which orbax then fails to
    save. Every process holds the same value (the same seeds), as replication assumes."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and (sharding.mesh is mesh or sharding.mesh == mesh):
        return x
    target = NamedSharding(mesh, P())
    if target.is_fully_addressable or not isinstance(x, jax.Array):
        return jax.device_put(x, target)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = jax.device_put(np.asarray(jax.random.key_data(x)), target)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(np.asarray(x), target)


def replicate(node, mesh: jax.sharding.Mesh) -> None:
    """Places every array of the NNX ``node`` (a model, an optimizer) that is not on
    ``mesh`` yet replicated over it."""
    nnx.update(node, jax.tree.map(functools.partial(on_mesh, mesh=mesh), nnx.state(node)))


def to_host(x) -> np.ndarray:
    """The whole of ``x`` in this process's memory, also when it spans other processes'
    devices (then all-gathered: every process must call it alike)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


# XLA's CPU runtime can deadlock in a collective's rendezvous, and then abort the process
# ("Termination timeout for `all reduce RendezvousKey`"), when many executions of programs
# with collectives are queued on its devices: with jax 0.10.2 a two-collective shard_map
# issued back to back hung with 50 queued on 2 virtual devices and with 40 on 8, never
# with 30 and 24 (40 to 200 blocks); so did the sharded DLRM train step with 200 queued.
# Disabling async dispatch did not prevent it (jax-ml/jax#25861 reports CPU hangs under
# async dispatch). A sharded step or forward on CPU devices therefore keeps at most this
# many queued.
CPU_QUEUED = 16


class CpuPacer:
    """Before a computation on ``mesh`` joins the queue, waits for the oldest queued one
    when ``CPU_QUEUED`` are queued on a mesh of CPU devices (nothing elsewhere: GPUs queue
    freely)."""

    def __init__(self):
        self._queued = collections.deque()

    def issued(self, mesh: jax.sharding.Mesh | None, out) -> None:
        """``out``: the computation's outputs (any pytree; arrays donated since are skipped)."""
        if mesh is None or mesh.devices.flat[0].platform != "cpu":
            return
        self._queued.append(out)
        if len(self._queued) > CPU_QUEUED:
            oldest = jax.tree.leaves(self._queued.popleft())
            jax.block_until_ready([x for x in oldest if isinstance(x, jax.Array) and not x.is_deleted()])
