"""What the planner is told: the devices (``Topology``) and the user's wishes per table
(``ParameterConstraints``), as in TorchRec's planner types."""

from __future__ import annotations

import dataclasses

import jax

from jaxrec.ops.host_cache import host_free_bytes, host_limit_bytes
from jaxrec.parallel._types import ShardingType, as_sharding_type


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    """The devices of one mesh axis and the step they run.

    Defaults are one H100 / H200 SXM node: the HBM copy ceiling benchmarks/tbe_gpu.py
    measures (3.0 TB/s, docs/tbe.md) and NVLink 4 / 400 Gb/s InfiniBand per GPU.
    """

    world_size: int
    """Devices along the mesh axis that carries the batch."""
    hbm_cap: int | None = None
    """Bytes per device that the plan may use (weights, optimizer state, buffers); leave
    room for the dense part and XLA's workspace. Default: 0.8 of what the first local
    device's allocator may hold (``bytes_limit``), or 16 GiB where it does not say (CPU)."""
    local_world_size: int | None = None
    """Devices per host (default: all on one host)."""
    batch_size: int = 512
    """Samples per device per step."""
    hbm_bw: float = 3.0e12
    """Device memory bandwidth, bytes/s."""
    intra_host_bw: float = 4.0e11
    """Bytes/s one device sends to peers of its host (NVLink)."""
    inter_host_bw: float = 5.0e10
    """Bytes/s one device sends to other hosts (network)."""
    ddr_cap: int | None = None
    """Bytes of host memory per device that tables placed in host memory may use
    (TorchRec's name). Default: the host's available memory, on the GPU at most XLA's cap
    on host memory (``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``), shared by the host's devices."""

    def __post_init__(self):
        local = self.world_size if self.local_world_size is None else self.local_world_size
        object.__setattr__(self, "local_world_size", int(local))
        if self.hbm_cap is None:
            stats = jax.local_devices()[0].memory_stats() or {}
            object.__setattr__(self, "hbm_cap", int(stats.get("bytes_limit", 16 << 30) * 0.8))
        if self.ddr_cap is None:
            caps = [c for c in (host_free_bytes(), host_limit_bytes()) if c is not None]
            object.__setattr__(self, "ddr_cap", int(min(caps, default=64 << 30) * 0.8) // int(local))
        if self.world_size < 1 or local < 1 or self.world_size % local:
            raise ValueError(f"need world_size >= 1 and local_world_size dividing it, got "
                             f"world_size={self.world_size}, local_world_size={local}")
        for name in ("hbm_cap", "ddr_cap", "batch_size", "hbm_bw", "intra_host_bw", "inter_host_bw"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Topology.{name} must be > 0, got {getattr(self, name)!r}")

    def send_seconds(self, nbytes: float) -> float:
        """Time to send ``nbytes`` spread evenly over every other device (all-to-all,
        reduce-scatter): the share for host peers goes over NVLink, the rest over the network."""
        n, local = self.world_size, self.local_world_size
        if n == 1:
            return 0.0
        return nbytes / n * ((local - 1) / self.intra_host_bw + (n - local) / self.inter_host_bw)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParameterConstraints:
    """What one table must (or may) be (TorchRec's ``ParameterConstraints``)."""

    sharding_types: tuple[ShardingType, ...] | None = None
    """The sharding types the planner may choose from (default: all that apply)."""
    ranks: tuple[int, ...] | None = None
    """Force devices: TABLE_WISE on ``ranks[0]``, COLUMN_WISE over ``ranks``,
    TABLE_ROW_WISE on the host of ``ranks[0]``."""
    pooling_factors: tuple[float, ...] | None = None
    """Mean ids per bag of each of the table's features (default 1.0: one-hot)."""

    def __post_init__(self):
        if self.sharding_types is not None:
            types = tuple(as_sharding_type(t) for t in self.sharding_types)
            if not types:
                raise ValueError("sharding_types must name at least one type, or be None")
            object.__setattr__(self, "sharding_types", types)
        if self.ranks is not None:
            object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        if self.pooling_factors is not None:
            object.__setattr__(self, "pooling_factors", tuple(float(p) for p in self.pooling_factors))
