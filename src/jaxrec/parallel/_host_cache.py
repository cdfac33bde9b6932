"""Host-cached tables in a sharded collection (``EmbeddingBagConfig(placement="host_cached")``).

A host-cached group (``Group.placement``, _layout.py) is, on each device, one virtual table
of ``R`` rows (its shards stacked) held as an unsharded host-cached group of one table
(jaxrec.nn.host_cache) of ``Group.cache_rows`` cache rows::

    FusedTables   the caches: global [N * cache_rows * D] in device memory, device d's
                  block its cache
    HostCache     .index: the N indices, global [N * cache_rows / 128, 128] (device d's
                  bucket range is its own index) and counters [N]
                  .rows: the virtual tables, global [N * R * D] in host memory

Inside ``shard_map`` each device sees exactly an unsharded group's arrays, so the lookup
maps its virtual rows to its cache rows with ``cache_rows_for`` as the unsharded
collection does: every device has its own cache, index and LRU / LFU order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrec._mesh import on_mesh, to_host
from jaxrec.fused import FusedEmbeddingTables
from jaxrec.nn import EmbeddingBagConfig
from jaxrec.nn.dynamic import COUNTERS, IndexState
from jaxrec.nn.host_cache import BUCKET_SIZE, CacheState, flushed_rows
from jaxrec.nn.host_tables import buffers, with_buffers
from jaxrec.ops import hash_table
from jaxrec.ops.tbe_layout import TableLayout


def virtual_config(group, names) -> EmbeddingBagConfig:
    """A device's block of host-cached ``group`` as the one table of an unsharded group
    (``names``: its tables')."""
    name = "+".join(names)
    return EmbeddingBagConfig(name=name, num_embeddings=group.layout.rows[0], embedding_dim=group.layout.dims[0],
                              feature_names=[f"{name}.slots"], dtype=group.dtype, placement="host_cached",
                              cache_rows=group.cache_rows, cache_policy=group.cache_policy)


def split(group, rows: FusedEmbeddingTables, mesh, axis: str) -> tuple[FusedEmbeddingTables, CacheState]:
    """``(caches, state)`` of host-cached ``group`` whose virtual tables ``rows`` (global,
    in host memory) hold every row: empty caches and indices (module doc)."""
    n, c = mesh.shape[axis], group.cache_rows
    on_devices = NamedSharding(mesh, P(axis))
    total = sum(rows.layout.rows)
    caches = [jax.device_put(np.zeros((n * c * (b.size // (n * total)),), b.dtype), on_devices)
              for b in buffers(rows)]
    layout = TableLayout(rows=(c,), dims=rows.layout.dims, feature_table_map=rows.layout.feature_table_map)
    fresh = jax.tree.map(lambda x: on_mesh(np.asarray(x), mesh), (rows.state.step, rows.config.hyperparams()))
    cache = with_buffers(dataclasses.replace(rows, layout=layout, state=rows.state._replace(step=fresh[0]),
                                             hparams=fresh[1]), caches)
    empty = hash_table.create(n * c, bucket_size=BUCKET_SIZE)
    index = IndexState(jax.tree.map(lambda x: jax.device_put(np.asarray(x), on_devices), empty),
                       *(jax.device_put(np.zeros((n,), np.int32), on_devices) for _ in COUNTERS))
    host_rows = dataclasses.replace(rows, name=rows.name + ".host")
    return cache, CacheState(index, host_rows)


def flushed(group, state: CacheState, cache: FusedEmbeddingTables, config, n: int) -> list[np.ndarray]:
    """The global buffers (weights, then each state buffer; NumPy) of the group's virtual
    tables, each device's cached rows written over its host rows."""
    def block(x, d):
        x = to_host(x)
        return x.reshape(n, -1)[d] if x.ndim == 1 else x.reshape(n, -1, *x.shape[1:])[d]

    per_device = []
    for d in range(n):
        local = jax.tree.map(lambda x, d=d: block(x, d), state.index.table)
        rows = with_buffers(state.rows, [block(b, d) for b in buffers(state.rows)])
        here = with_buffers(cache, [block(b, d) for b in buffers(cache)])
        per_device.append(list(flushed_rows(CacheState(state.index._replace(table=local), rows), here,
                                            [config]).values()))
    return [np.concatenate(parts) for parts in zip(*per_device)]


def statistics(state: CacheState) -> dict[str, jax.Array]:
    """The group's caches together: rows cached, load factor, rows loaded and written back."""
    return {**hash_table.stats(state.index.table), "inserted": jnp.sum(state.index.inserted),
            "evicted": jnp.sum(state.index.evicted)}
