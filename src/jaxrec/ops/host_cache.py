"""Rows between a table in host memory and its cache in device memory: the row exchange
of a host-cached table (``EmbeddingBagConfig(placement="host_cached")``, docs/host_memory.md).

A host-cached table keeps all its rows, and their optimizer state, in host memory (JAX's
``"pinned_host"`` memory kind, which the GPU reads and writes over PCIe) and a cache of
some rows in device memory. ``exchange_rows`` moves rows between the two::

    for i with cache_rows[i] >= 0:
        host[evict_rows[i]] = cache[cache_rows[i]]     (if evict_rows[i] >= 0: write back)
        cache[cache_rows[i]] = host[load_rows[i]]      (if load_rows[i] >= 0: load)

for each (cache, host) pair of buffers (the weights, each optimizer-state buffer), in
place: two ``copy_rows`` per pair, the write-backs first, each in the order of the host
rows (``by_host_row``). The entries must name distinct cache rows and distinct host rows;
rows outside a buffer are skipped.

``start_exchange`` runs the same copies in the background (a prefetch): on the GPU on a
stream of their own, so that they overlap what the computation does next, until
``wait_copies`` makes the computation wait for them. XLA does not know of that stream, so
the caller promises that nothing reads or writes the exchanged rows before the wait, and
passes the copies' row lists (``in_flight``) to the wait, which keeps them alive until then.

The host buffers are only ever touched by the handlers, never by a jnp operation: XLA
cannot run device operations on host memory, and JAX refuses a gather that mixes memory
spaces. So a buffer in host memory needs the compiled handlers, called without the
``platform_dependent`` conditional of other ops (``_ffi.call_kernel``), one result per
call, and each result marked as host memory (``to_host_memory``): what XLA's host
offloading can follow. The jnp reference takes device arrays, for the tests.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxrec import _ffi

HOST_MEMORY = "pinned_host"
"""The memory kind of host-placed buffers: page-locked, so the GPU reaches it directly
(on the CPU it is ordinary memory)."""


def host_free_bytes() -> int | None:
    """Bytes of host memory the system still has available; ``None`` when it cannot be told."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        return None


HOST_LIMIT_VARIABLE = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
"""XLA's cap on the pinned host memory that JAX's GPU client hands out (its host memory
kind), in GiB; 64 unless set before JAX starts."""


def host_limit_bytes() -> int | None:
    """Bytes of host memory JAX may place arrays in: XLA's cap on the GPU
    (``HOST_LIMIT_VARIABLE``); ``None`` (no cap but the system's) elsewhere."""
    if jax.devices()[0].platform != "gpu":
        return None
    return int(float(os.environ.get(HOST_LIMIT_VARIABLE, "64")) * 2**30)


def in_host_memory(x: jax.Array) -> bool:
    """Whether ``x`` (an array or a tracer) lives in host memory."""
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def to_host_memory(x: jax.Array) -> jax.Array:
    """``x`` in host memory, on the devices and with the sharding it has (inside ``jit`` as
    outside: an output so marked stays where it is, with no copy)."""
    if isinstance(x, jax.core.Tracer):
        return jax.device_put(x, jax.memory.Space.Host)
    return jax.device_put(x, x.sharding.with_memory_kind(HOST_MEMORY))


def copy_rows(dst: jax.Array, dst_rows: jax.Array, src: jax.Array, src_rows: jax.Array, *, dst_num_rows: int,
              src_num_rows: int, backend: str = "auto", background: bool = False) -> jax.Array:
    """``dst`` with ``dst[dst_rows[i]] = src[src_rows[i]]`` for every ``i`` whose two rows
    lie in their buffers: flat buffers of ``dst_num_rows`` and ``src_num_rows`` rows of one
    width and dtype; ``dst_rows`` (distinct where in range), ``src_rows``: ``int32[N]``.
    Donate ``dst`` to update it in place. backend: as ``jaxrec._ffi.dispatch``.
    ``background``: a copy touching host memory runs in the background until
    ``wait_copies`` (module doc); others run in place."""
    dst_rows, src_rows = jnp.asarray(dst_rows, jnp.int32), jnp.asarray(src_rows, jnp.int32)
    if dst_rows.ndim != 1 or dst_rows.shape != src_rows.shape:
        raise ValueError(f"dst_rows and src_rows must be 1-D and alike, got shapes {list(dst_rows.shape)} and "
                         f"{list(src_rows.shape)}")
    width = dst.size // dst_num_rows if dst_num_rows > 0 else 0
    if (src.dtype != dst.dtype or width < 1 or dst.size != width * dst_num_rows
            or src.size != width * src_num_rows):
        raise ValueError(f"src {src.dtype}{list(src.shape)} and dst {dst.dtype}{list(dst.shape)} must hold "
                         f"src_num_rows={src_num_rows} and dst_num_rows={dst_num_rows} rows of one width and dtype")

    kernel = functools.partial(_handler, src_num_rows=src_num_rows, dst_num_rows=dst_num_rows)

    def reference(dst_rows, src_rows, src, dst):
        ok = (dst_rows >= 0) & (dst_rows < dst_num_rows) & (src_rows >= 0) & (src_rows < src_num_rows)
        rows = src.reshape(src_num_rows, width)[jnp.where(ok, src_rows, 0)]
        return dst.reshape(dst_num_rows, width).at[jnp.where(ok, dst_rows, dst_num_rows)].set(
            rows, mode="drop").reshape(dst.shape)

    if not (in_host_memory(src) or in_host_memory(dst)):
        return _ffi.dispatch(kernel, reference, dst_rows, src_rows, src, dst, backend=backend)
    if backend == "reference":
        raise ValueError("copy_rows' reference takes buffers in device memory only")
    return _copy_with_host_memory(dst_rows, src_rows, src, dst, src_num_rows=src_num_rows,
                                  dst_num_rows=dst_num_rows, background=background)


@functools.partial(jax.jit, static_argnames=("src_num_rows", "dst_num_rows", "background"))
def _copy_with_host_memory(dst_rows, src_rows, src, dst, *, src_num_rows: int, dst_num_rows: int,
                           background: bool = False):
    """The handler on buffers of which one or both live in host memory, the result marked as
    host memory where ``dst`` is: inside a jit always (an eager call of the handler alone
    would return a host buffer unmarked, which XLA refuses: E1200). Inside a caller's jit
    this jit is inlined, and a donated ``dst`` is updated in place."""
    out = _ffi.call_kernel(functools.partial(_handler, src_num_rows=src_num_rows, dst_num_rows=dst_num_rows,
                                             background=background),
                           dst_rows, src_rows, src, dst)
    return to_host_memory(out) if in_host_memory(dst) else out


def _handler(dst_rows, src_rows, src, dst, *, src_num_rows: int, dst_num_rows: int, background: bool = False):
    """The ``jaxrec_copy_rows`` target (``jaxrec_copy_rows_async`` in the background), its
    result aliased to ``dst``."""
    target = "jaxrec_copy_rows_async" if background else "jaxrec_copy_rows"
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(dst.shape, dst.dtype), input_output_aliases={3: 0})
    return call(dst_rows, src_rows, src, dst, src_num_rows=src_num_rows, dst_num_rows=dst_num_rows)


def wait_copies(x: jax.Array, in_flight: Sequence[jax.Array]) -> jax.Array:
    """``x``, once the background copies issued before have finished (``start_exchange``):
    what the computation then does with ``x`` runs after them. ``in_flight``: the arrays
    the copies read (``start_exchange``'s), kept alive until now; empty when nothing ran
    in the background (``x`` is returned as it is)."""
    if not in_flight:
        return x
    call = jax.ffi.ffi_call("jaxrec_wait_copies", jax.ShapeDtypeStruct(x.shape, x.dtype),
                            input_output_aliases={0: 0})
    return _ffi.call_kernel(call, x, *in_flight)


def by_host_row(host_rows: jax.Array, other_rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The pairs ``(host_rows[i], other_rows[i])`` in the order of the host rows.

    Rows copied in the order of their host addresses cross PCIe at the copy rate: on the
    H100, 524,288 random rows of 512 bytes of a 4 GiB host buffer moved at 20 GB/s in
    random order and at 51 GB/s sorted (a bulk copy: 55 GB/s). Random reads over more
    host memory than the GPU's address translation covers at once wait on it; sorted,
    consecutive rows share their pages."""
    return jax.lax.sort((host_rows, other_rows), num_keys=1)


def exchange_rows(cache: Sequence[jax.Array], host: Sequence[jax.Array], cache_rows: jax.Array,
                  evict_rows: jax.Array, load_rows: jax.Array, *, cache_num_rows: int, host_num_rows: int,
                  backend: str = "auto") -> tuple[list[jax.Array], list[jax.Array]]:
    """``(cache, host)`` after the exchange (module doc): ``cache[k]`` and ``host[k]`` flat
    buffers of ``cache_num_rows`` and ``host_num_rows`` rows of one dtype and width;
    ``cache_rows``, ``evict_rows``, ``load_rows``: ``int32[N]``. Donate the buffers to
    update them in place."""
    cache, host, _ = _exchange(cache, host, cache_rows, evict_rows, load_rows, cache_num_rows=cache_num_rows,
                               host_num_rows=host_num_rows, backend=backend, background=False)
    return cache, host


def start_exchange(cache: Sequence[jax.Array], host: Sequence[jax.Array], cache_rows: jax.Array,
                   evict_rows: jax.Array, load_rows: jax.Array, *, cache_num_rows: int,
                   host_num_rows: int) -> tuple[list[jax.Array], list[jax.Array], tuple[jax.Array, ...]]:
    """``exchange_rows`` in the background: ``(cache, host, in_flight)``; the exchange is
    done once ``wait_copies(x, in_flight)`` has returned ``x``. Until then nothing may read
    or write the exchanged rows of ``cache`` or ``host`` (the rest of them may be used)."""
    return _exchange(cache, host, cache_rows, evict_rows, load_rows, cache_num_rows=cache_num_rows,
                     host_num_rows=host_num_rows, backend="auto", background=True)


def _exchange(cache, host, cache_rows, evict_rows, load_rows, *, cache_num_rows: int, host_num_rows: int,
              backend: str, background: bool):
    if not cache or len(cache) != len(host):
        raise ValueError(f"cache and host must be lists of the same (positive) length, got {len(cache)} "
                         f"and {len(host)} buffers")
    cache_rows, evict_rows, load_rows = (jnp.asarray(r, jnp.int32) for r in (cache_rows, evict_rows, load_rows))
    live = cache_rows >= 0
    write_back, written = by_host_row(jnp.where(live, evict_rows, -1), cache_rows)
    load_rows, load_into = by_host_row(load_rows, jnp.where(live & (load_rows >= 0), cache_rows, -1))
    new_cache, new_host = [], []
    for c, h in zip(cache, host):
        h = copy_rows(h, write_back, c, written, dst_num_rows=host_num_rows, src_num_rows=cache_num_rows,
                      backend=backend, background=background)
        c = copy_rows(c, load_into, h, load_rows, dst_num_rows=cache_num_rows, src_num_rows=host_num_rows,
                      backend=backend, background=background)
        new_cache.append(c)
        new_host.append(h)
    in_background = background and any(map(in_host_memory, host))
    return new_cache, new_host, (write_back, written, load_rows, load_into) if in_background else ()
