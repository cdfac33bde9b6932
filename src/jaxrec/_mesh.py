"""``on_mesh`` / ``replicate``: arrays replicated over a mesh, shared by the train step
(``jaxrec.nn``), the sharded collections (``jaxrec.parallel``) and ``jaxrec train``;
``to_host``: an array whole on the host, also across processes (the portable tables,
checkpoints)."""

from __future__ import annotations

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
