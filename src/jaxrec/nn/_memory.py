"""Refuse tables that cannot fit before allocating them.

Building a collection allocates every table (and its fused optimizer's slots) on the
default device. A table sized from raw ids (a MovieLens user id of 1.5e9, a hashed
feature without a cap) would otherwise block for minutes and then die out of memory.
"""

from __future__ import annotations

import jax

from jaxrec.ops.host_cache import HOST_LIMIT_VARIABLE, host_free_bytes, host_limit_bytes

_GIB = 2.0**30


def free_bytes(device: jax.Device | None = None) -> int | None:
    """Bytes the device can still allocate: its allocator's limit on accelerators, the
    system's available memory on the CPU; ``None`` when it cannot be told."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - some backends do not implement it
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return host_free_bytes()


def check_fits(collection: str, tables: dict[str, int], state_bytes: int, drawing_bytes: int,
               available: int | None = None) -> None:
    """Raises ``ValueError`` when the tables (``{name: bytes}``), ``drawing_bytes`` held
    besides them while a group is drawn (``merge_drawn_tables``: a small group's tables
    before they are merged, a large group's largest table) and ``state_bytes`` of
    optimizer slots exceed the free memory of the default device."""
    available = free_bytes() if available is None else available
    need = sum(tables.values()) + drawing_bytes + state_bytes
    if available is None or need <= available:
        return
    largest = max(tables, key=tables.get, default=None)
    device = jax.devices()[0]
    hint = (" (JAX's GPU allocator takes XLA_PYTHON_CLIENT_MEM_FRACTION of the memory, 0.75 "
            "unless set)") if device.platform == "gpu" else ""
    alone = f"; table {largest!r} alone takes {tables[largest] / _GIB:.2f} GiB" if largest else ""
    raise ValueError(
        f"collection {collection!r} needs {need / _GIB:.2f} GiB to build its tables "
        f"({sum(tables.values()) / _GIB:.2f} GiB of weights, {drawing_bytes / _GIB:.2f} GiB more "
        f"while they are drawn, and {state_bytes / _GIB:.2f} GiB of optimizer state) but the "
        f"device ({device.platform}) has {available / _GIB:.2f} GiB free{hint}{alone}. Cap num_embeddings "
        "(jaxrec train: --max-rows; re-index raw ids densely), use a smaller dtype, compress "
        "it (tt=TTConfig(...)) or shard the tables over devices (jaxrec.parallel).")


def check_host_fits(collection: str, tables: dict[str, int], available: int | None = None) -> None:
    """Raises ``ValueError`` when tables in host memory (host-placed or host-cached) and
    their optimizer state (``{name: bytes}``) exceed the host memory available, or on the
    GPU XLA's cap on it."""
    need = sum(tables.values())
    limit = host_limit_bytes()
    if limit is not None and need > limit:
        raise ValueError(
            f"collection {collection!r} places {need / _GIB:.2f} GiB of tables and optimizer state in host "
            f"memory (tables {sorted(tables)}) but XLA hands out at most {limit / _GIB:.2f} GiB of it on the "
            f"GPU: set {HOST_LIMIT_VARIABLE} to {int(need / _GIB) + 8} or more (GiB) before JAX starts, "
            f"e.g. `export {HOST_LIMIT_VARIABLE}={int(need / _GIB) + 8}`.")
    available = host_free_bytes() if available is None else available
    if available is None or need <= available:
        return
    largest = max(tables, key=tables.get)
    raise ValueError(
        f"collection {collection!r} places {need / _GIB:.2f} GiB of tables and optimizer state in host "
        f"memory (tables {sorted(tables)}) but the host has {available / _GIB:.2f} GiB "
        f"available; table {largest!r} alone takes {tables[largest] / _GIB:.2f} GiB. Cap num_embeddings, "
        "use a smaller dtype, or spread the tables over hosts.")
