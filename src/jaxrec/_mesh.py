"""``on_mesh``: an array replicated over a mesh, shared by the train step (``jaxrec.nn``) and
the sharded collections (``jaxrec.parallel``)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


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
