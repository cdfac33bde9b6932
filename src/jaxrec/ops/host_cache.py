"""Rows between a table in host memory and its cache in device memory: the row exchange
of a host-cached table (``EmbeddingBagConfig(placement="host_cached")``, docs/host_memory.md).

A host-cached table keeps all its rows, and their optimizer state, in host memory (JAX's
``"pinned_host"`` memory kind, which the GPU reads and writes over PCIe) and a cache of
some rows in device memory. ``exchange_rows`` moves rows between the two::

    for i with cache_rows[i] >= 0:
        host[evict_rows[i]] = cache[cache_rows[i]]     (if evict_rows[i] >= 0: write back)
        cache[cache_rows[i]] = host[load_rows[i]]      (if load_rows[i] >= 0: load)

for each (cache, host) pair of buffers (the weights, each optimizer-state buffer), in
place. The entries must name distinct cache rows and distinct host rows; rows outside a
buffer are skipped. The host buffers are only ever touched by this op (and by the fused
kernels, in place): XLA cannot run ordinary device operations on host memory, and JAX
refuses a gather that mixes memory spaces, so there is no jnp path for them. The jnp
reference (``exchange_rows_reference``) takes device arrays, for the tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxrec import _ffi

HOST_MEMORY = "pinned_host"
"""The memory kind of host-placed buffers: page-locked, so the GPU reaches it directly
(on the CPU it is ordinary memory)."""


def in_host_memory(x: jax.Array) -> bool:
    """Whether ``x`` (an array or a tracer) lives in host memory."""
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def to_host_memory(x: jax.Array) -> jax.Array:
    """``x`` in host memory, on the devices and with the sharding it has (inside ``jit`` as
    outside: an output so marked stays where it is, with no copy)."""
    if isinstance(x, jax.core.Tracer):
        return jax.device_put(x, jax.memory.Space.Host)
    return jax.device_put(x, x.sharding.with_memory_kind(HOST_MEMORY))


def exchange_rows(cache: Sequence[jax.Array], host: Sequence[jax.Array], cache_rows: jax.Array,
                  evict_rows: jax.Array, load_rows: jax.Array, *, cache_num_rows: int, host_num_rows: int,
                  backend: str = "auto") -> tuple[list[jax.Array], list[jax.Array]]:
    """``(cache, host)`` after the exchange (module doc): flat buffers of ``cache_num_rows``
    and ``host_num_rows`` rows, pair ``k`` of one dtype and width. ``cache_rows``,
    ``evict_rows``, ``load_rows``: ``int32[N]``. Donate the buffers to update them in
    place. Buffers in host memory need the compiled handlers (there is no jnp path)."""
    cache, host = list(cache), list(host)
    if not cache or len(cache) != len(host):
        raise ValueError(f"cache and host must be lists of the same (positive) length, got {len(cache)} "
                         f"and {len(host)} buffers")
    rows = [jnp.asarray(r, jnp.int32) for r in (cache_rows, evict_rows, load_rows)]
    if any(r.ndim != 1 or r.shape != rows[0].shape for r in rows):
        raise ValueError(f"cache_rows, evict_rows and load_rows must be 1-D and alike, got shapes "
                         f"{[list(r.shape) for r in rows]}")
    _check_pairs(cache, host, cache_num_rows, host_num_rows)
    on_host = [in_host_memory(b) for b in cache + host]
    if any(on_host) and backend == "auto":
        backend = "kernel"  # the reference cannot read host memory
    pairs = [b for pair in zip(cache, host) for b in pair]

    def kernel(*operands):
        call = jax.ffi.ffi_call(
            "jaxrec_cache_exchange", [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in pairs],
            input_output_aliases={3 + k: k for k in range(len(pairs))})
        return call(*operands, cache_num_rows=cache_num_rows, host_num_rows=host_num_rows)

    def reference(*operands):
        out = exchange_rows_reference(operands[3::2], operands[4::2], *operands[:3],
                                      cache_num_rows=cache_num_rows, host_num_rows=host_num_rows)
        return [b for pair in zip(*out) for b in pair]

    out = _ffi.dispatch(kernel, reference, *rows, *pairs, backend=backend)
    # The handler's results alias its operands; where an operand was in host memory, so is
    # its result (without the mark XLA would move it to device memory).
    placed = [h for pair in zip(on_host[:len(cache)], on_host[len(cache):]) for h in pair]
    out = [to_host_memory(b) if h else b for b, h in zip(out, placed)]
    return out[0::2], out[1::2]


def exchange_rows_reference(cache, host, cache_rows, evict_rows, load_rows, *, cache_num_rows: int,
                            host_num_rows: int):
    """``exchange_rows`` in jnp, on device arrays."""
    live = (cache_rows >= 0) & (cache_rows < cache_num_rows)
    slot = jnp.where(live, cache_rows, 0)
    evict = jnp.where(live & (evict_rows >= 0) & (evict_rows < host_num_rows), evict_rows, host_num_rows)
    load = live & (load_rows >= 0) & (load_rows < host_num_rows)
    new_cache, new_host = [], []
    for c, h in zip(cache, host):
        c2, h2 = c.reshape(cache_num_rows, -1), h.reshape(host_num_rows, -1)
        h2 = h2.at[evict].set(c2[slot], mode="drop")
        c2 = c2.at[jnp.where(load, slot, cache_num_rows)].set(h2[jnp.where(load, load_rows, 0)], mode="drop")
        new_cache.append(c2.reshape(c.shape))
        new_host.append(h2.reshape(h.shape))
    return new_cache, new_host


def _check_pairs(cache, host, cache_num_rows: int, host_num_rows: int) -> None:
    for k, (c, h) in enumerate(zip(cache, host)):
        width = c.size // cache_num_rows
        if c.dtype != h.dtype or width < 1 or c.size != width * cache_num_rows or h.size != width * host_num_rows:
            raise ValueError(f"buffer pair {k}: cache {c.dtype}{list(c.shape)} and host {h.dtype}{list(h.shape)} "
                             f"must hold cache_num_rows={cache_num_rows} and host_num_rows={host_num_rows} "
                             "rows of one width and dtype")
