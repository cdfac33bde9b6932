"""The planner's cost model: memory and step time of each device under a plan.

Memory (bytes, the same on every device: one SPMD program allocates the same buffers
everywhere, see _layout.py):

    per group   R * D * (weight bytes + per-element state bytes) + R * per-row state bytes
                (R = the most rows any device stacks in the group: padding counted)
    dp group    the whole tables, on every device
    buffers     gathered ids (N * C ids, weights, lengths), per group its compacted ids and
                the fused backward's sort (~40 bytes per gathered id), its pooled output,
                cotangent and all-to-all copy (3 x [N*B, width] f32), the output and its
                gradient ([B, sum of dims] f32, twice)

Step time of device d (seconds) = its shards' compute + the communication (the same on
every device: SPMD sends padded slots):

    compute of a shard  (bytes read + written) / hbm_bw, with, for a shard holding a
                        fraction rho of a table's rows and c of its columns, over the
                        global batch's bags (N * B per feature) and ids (N * B * L):
        forward   rho * ids * c * weight bytes   (rows read)   + bags * c * 4   (output)
        backward  bags * c * 4 (cotangent) + rho * ids * (c * (2 * weight bytes + 2 *
                  state bytes) + 2 * row-state bytes)   (each id a unique row: an upper bound)
        input     N * C * 40 bytes per group the shard's device runs (building its ids)
    data parallel       fused: the global batch on every device (identical updates);
                        plain: the local batch, a dense gradient of the table
    communication       forward + backward of the pooled results: a2a and reduce groups
                        2 * N*B * width * 4 bytes, all-gather of the ids, dp: the gathered
                        cotangent (fused) or the all-reduced gradient (plain);
                        ``Topology.send_seconds`` spreads them over NVLink and network

Ids are assumed uniform over a table's rows (as TorchRec's estimator does): with skewed
ids, row-wise shards of hot rows do more than their share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from jaxrec.parallel._layout import A2A, DP, REDUCE, build_layout
from jaxrec.parallel._table_spec import TableSpec, table_specs
from jaxrec.parallel._topology import Topology
from jaxrec.parallel._types import ShardingPlan, ShardingType

_BUILD_BYTES_PER_ID = 40
"""Bytes moved per gathered id while a group builds its compacted ids (bag search,
segment sums, cumsums, the scatter) and the fused backward sorts them."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StateBytes:
    """Optimizer state bytes per weight element and per row (``state_bytes(config)``)."""

    per_element: int = 0
    per_row: int = 0


_INDEX_BYTES_PER_ROW = 13
"""A host-cached group's hash index per cache row: an int32 key, a digest byte, a score and a seen count."""


def state_bytes(optimizer) -> StateBytes:
    """The fused optimizer's state size; zero for plain tables (optax's state of plain
    tables is not counted: leave room for it in ``hbm_cap``)."""
    if optimizer is None:
        return StateBytes()
    item = jnp.dtype(getattr(optimizer, "state_dtype", jnp.float32)).itemsize
    fields = optimizer.state_type._fields[1:]
    rows = sum(1 for f in fields if f in optimizer.state_type.row_fields)
    return StateBytes(per_element=item * (len(fields) - rows), per_row=item * rows)


@dataclasses.dataclass(frozen=True)
class PlanStats:
    """The estimates of a plan (what ``ShardingPlan.table()`` prints)."""

    topology: Topology
    perf: tuple[float, ...]
    """Estimated step seconds of each device (embeddings only)."""
    compute: tuple[float, ...]
    communication: float
    memory: int
    """Bytes of device memory per device (the same on every device)."""
    weights: int
    optimizer_state: int
    buffers: int
    table_perf: Mapping[str, float]
    """Each table's compute seconds summed over devices."""
    table_memory: Mapping[str, int]
    """Each table's weight + state bytes summed over devices (without SPMD padding)."""
    balance_tolerance: float | None = None
    proposals: int = 1
    host_memory: int = 0
    """Bytes of host memory per device: the tables placed there and their optimizer state."""

    @property
    def imbalance(self) -> float:
        """max / mean of the devices' step times (1.0 = perfectly balanced)."""
        return max(self.perf) / (sum(self.perf) / len(self.perf))

    @property
    def fits(self) -> bool:
        return self.memory <= self.topology.hbm_cap and self.host_memory <= self.topology.ddr_cap

    def to_json(self) -> dict:
        return {"perf_ms": [p * 1e3 for p in self.perf], "memory_bytes": self.memory,
                "hbm_cap_bytes": self.topology.hbm_cap, "host_memory_bytes": self.host_memory,
                "ddr_cap_bytes": self.topology.ddr_cap, "imbalance": self.imbalance,
                "balance_tolerance": self.balance_tolerance, "batch_size": self.topology.batch_size}


def estimate(tables: Sequence[TableSpec], plan: ShardingPlan, topology: Topology, *,
             optimizer=None, pooling_factors: Mapping[str, Sequence[float]] | None = None,
             balance_tolerance: float | None = None, proposals: int = 1) -> PlanStats:
    """Memory and step-time estimates of ``plan`` (module doc). ``tables``: TableSpecs or
    table configs (``EmbeddingBagConfig``), as ``EmbeddingShardingPlanner.plan`` takes them."""
    tables = table_specs(tables)
    layout = build_layout(tables, plan)
    n, b = topology.world_size, topology.batch_size
    sb = state_bytes(optimizer)
    fused = optimizer is not None
    factors = _factors(tables, pooling_factors)
    ids_per_sample = sum(sum(f) for f in factors.values())
    gathered = n * b * ids_per_sample                  # ids of the global batch, N * C
    bags_global = n * b

    compute = np.zeros(n)
    table_perf, table_memory = {}, {}
    for spec, kind in zip(tables, layout.kinds):
        wb = jnp.dtype(spec.dtype).itemsize
        ids = bags_global * sum(factors[spec.name])
        bags = bags_global * len(spec.features)
        table_memory[spec.name] = spec.rows * (spec.dim * (wb + sb.per_element) + sb.per_row)
        if kind == ShardingType.DATA_PARALLEL:
            if fused:
                cost = shard_bytes(1.0, spec.dim, ids, bags, wb, sb) / topology.hbm_bw
            else:  # local lookup + a dense gradient of the table
                cost = (shard_bytes(1.0, spec.dim, ids / n, bags / n, wb, StateBytes())
                        + 2 * spec.rows * spec.dim * 4) / topology.hbm_bw
            compute += cost
            table_perf[spec.name] = cost * n
            continue
        total = 0.0
        for s in plan[spec.name].shards:
            rho = s.num_rows / spec.rows
            cost = shard_bytes(rho, s.num_cols, ids, bags, wb, sb) / topology.hbm_bw
            compute[s.device] += cost
            total += cost
        table_perf[spec.name] = total
    for _ in layout.groups:  # building each group's ids, on every device
        compute += n * b * ids_per_sample * _BUILD_BYTES_PER_ID / topology.hbm_bw

    comm_bytes = n * b * ids_per_sample * 8 + n * b * len(layout.features) * 4  # all_gather
    for kind in (A2A, REDUCE):
        comm_bytes += 2 * bags_global * layout.width(kind) * 4
    if layout.groups_of(DP):
        dp_width = layout.width(DP)
        dp_rows = sum(spec.rows * spec.dim for spec, k in zip(tables, layout.kinds)
                      if k == ShardingType.DATA_PARALLEL)
        comm_bytes += bags_global * dp_width * 4 if fused else 2 * dp_rows * 4
    communication = topology.send_seconds(comm_bytes)

    weights = opt = host = indices = 0
    for group in layout.groups:
        wb = jnp.dtype(group.dtype).itemsize
        rows = sum(group.layout.rows)
        elems = sum(r * d for r, d in zip(group.layout.rows, group.layout.dims))
        if group.in_host_memory:  # in host memory; the device holds each batch's rows of it, or a cache
            host += elems * (wb + sb.per_element) + rows * sb.per_row
            cached = group.cache_rows * group.layout.dims[0]
            weights += cached * wb
            opt += cached * sb.per_element + group.cache_rows * sb.per_row
            indices += group.cache_rows * _INDEX_BYTES_PER_ROW
            continue
        weights += elems * wb
        opt += elems * sb.per_element + rows * sb.per_row
    buffers = gathered * 12 + n * b * len(layout.features) * 4 + indices
    for group in layout.groups:
        buffers += gathered * _BUILD_BYTES_PER_ID + 3 * bags_global * group.width * 4
        if group.placement == "host":  # the batch's rows gathered from host memory, one per id at most
            buffers += gathered * (group.layout.dims[0] * (jnp.dtype(group.dtype).itemsize + sb.per_element)
                                   + sb.per_row)
    buffers += 2 * b * layout.total_dim * 4
    perf = tuple(float(c + communication) for c in compute)
    return PlanStats(topology, perf, tuple(float(c) for c in compute), float(communication),
                     int(weights + opt + buffers), int(weights), int(opt), int(buffers),
                     table_perf, table_memory, balance_tolerance, proposals, int(host))


def shard_bytes(rho: float, cols: int, ids: float, bags: float, wb: int, sb: StateBytes) -> float:
    forward = rho * ids * cols * wb + bags * cols * 4
    backward = bags * cols * 4 + rho * ids * (cols * (2 * wb + 2 * sb.per_element) + 2 * sb.per_row)
    return forward + backward


def _factors(tables, pooling_factors) -> dict[str, tuple[float, ...]]:
    out = {}
    for t in tables:
        given = (pooling_factors or {}).get(t.name)
        if given is None:
            out[t.name] = (1.0,) * len(t.features)
        elif len(given) != len(t.features):
            raise ValueError(f"table {t.name!r} has {len(t.features)} features but "
                             f"{len(given)} pooling factors {list(given)}")
        else:
            out[t.name] = tuple(float(x) for x in given)
    return out
