"""Where every shard lives on each device, as one static SPMD program can see it.

Under ``shard_map`` every device runs the same program on arrays of the same shapes,
but a plan gives devices different tables. The shards of one device are therefore
stacked into one *virtual table* per group, of the same shape on every device::

    # a2a group (TW, CW and TRW shards of dim 64, f32); plan: t0 (800 rows) TW on 0,
    # t1 (500) TW on 1, t2 (300) TW on 1
    # device 0: virtual table [800, 64] = t0 rows 0:800              slots [f_t0, -]
    # device 1: virtual table [800, 64] = t1 rows 0:500 | t2 0:300   slots [f_t1, f_t2]
    # R = max over devices of the rows stacked there = 800; S = max slots = 2

A *slot* is one (feature, shard) lookup: slot i of device d reads feature
``slot_feature[d][i]``'s ids in ``[slot_lo, slot_hi)`` at virtual row
``slot_offset[d][i] + id - slot_lo``. Unused slots (-1) get empty bags. Every device
therefore holds ``R * D`` elements per group (the padding is the price of SPMD; the
planner counts it) and every lookup returns ``[batch, S * D]``.

Groups, by how their pooled results travel back to the batch owners:

* ``a2a``: TABLE_WISE, COLUMN_WISE and TABLE_ROW_WISE shards, by (shard dim, dtype):
  an ``all_to_all``; the receivers concatenate column pieces and sum row pieces.
* ``reduce``: ROW_WISE tables, by (dim, dtype): every device has the same slots (one
  per feature), so one ``psum_scatter`` sums the partial bags and scatters the batch.
  A dynamic vocabulary is a reduce group of its own (``Group.dynamic``), split in equal
  blocks over the devices in order: device d's block is its part of the hash index
  (``jaxrec.parallel._dynamic``).
* ``dp``: DATA_PARALLEL tables, by dtype: the whole tables on every device, in a
  normal ``TableLayout``; no communication in the forward.

Tables in host memory form a2a and reduce groups apart, one per placement
(``Group.placement``): ``"host"``, each device's virtual table in its host memory, each
lookup reading the batch's rows (jaxrec.nn.host_tables); ``"host_cached"``, the same with
a cache of ``Group.cache_rows`` rows per device in its device memory, each device with its
own index (jaxrec.nn.host_cache).

This module is pure Python and NumPy (no Flax): the planner uses it to count memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrec.ops.tbe_layout import TableLayout
from jaxrec.parallel._table_spec import TableSpec
from jaxrec.parallel._types import ShardingPlan, ShardingType

A2A, REDUCE, DP = "a2a", "reduce", "dp"


@dataclasses.dataclass(frozen=True)
class Piece:
    """A shard's rows ``[row_lo, row_hi)`` x columns ``[col_lo, col_hi)`` of ``table``,
    stacked at virtual row ``offset`` on ``device`` (dp: ``offset`` is the table's index
    in the group layout and ``device`` is -1: every device)."""

    table: int
    row_lo: int
    row_hi: int
    col_lo: int
    col_hi: int
    device: int
    offset: int


@dataclasses.dataclass(frozen=True)
class Group:
    """Tables looked up in one launch per device (module doc)."""

    kind: str
    dtype: str
    layout: TableLayout
    """One virtual table (a2a, reduce) or the whole tables (dp); features = slots."""
    slot_feature: tuple[tuple[int, ...], ...]
    slot_offset: tuple[tuple[int, ...], ...]
    slot_lo: tuple[tuple[int, ...], ...]
    slot_hi: tuple[tuple[int, ...], ...]
    pieces: tuple[Piece, ...]
    dynamic: bool = False
    """One dynamic-vocabulary table (ROW_WISE, equal blocks): ids map to rows by its hash index."""
    placement: str = "device"
    """``"device"``, ``"host"`` or ``"host_cached"`` (module doc)."""
    cache_policy: str = "lru"
    """host_cached: its tables' ``cache_policy`` (one per group)."""
    cache_rows: int = 0
    """host_cached: each device's cache rows, a multiple of 128 (the most any device's shards
    ask for: each shard its table's ``cache_size() / num_embeddings`` of its rows)."""

    @property
    def in_host_memory(self) -> bool:
        """Whether each device's virtual table lives in its host memory."""
        return self.placement != "device"

    @property
    def num_slots(self) -> int:
        return self.layout.num_features

    @property
    def width(self) -> int:
        """Columns of the group's pooled output (all slots)."""
        return self.layout.total_dim

    def slot_arrays(self, num_features: int) -> dict[str, np.ndarray]:
        """``[devices, ...]`` int arrays: per feature its slot (-1: not here), per slot its
        feature (-1 unused), virtual offset, row range."""
        feature = np.asarray(self.slot_feature, np.int64)
        slot_of = np.full((feature.shape[0], num_features), -1, np.int64)
        for d, row in enumerate(feature):
            for i, f in enumerate(row):
                if f >= 0:
                    slot_of[d, f] = i
        return {"slot_of_feature": slot_of, "slot_feature": feature,
                "offset": np.asarray(self.slot_offset, np.int64),
                "lo": np.asarray(self.slot_lo, np.int64), "hi": np.asarray(self.slot_hi, np.int64)}


@dataclasses.dataclass(frozen=True)
class ShardedLayout:
    """Tables, features, groups and how the output columns are assembled."""

    world_size: int
    tables: tuple[TableSpec, ...]
    kinds: tuple[ShardingType, ...]
    """Each table's sharding type."""
    features: tuple[str, ...]
    """Output order: feature names table by table (TorchRec's order)."""
    feature_table: tuple[int, ...]
    groups: tuple[Group, ...]
    contributors: tuple[tuple[int, ...], ...]
    """``[K][total_dim]``: output column c is the sum over k of column ``contributors[k][c]``
    of ``[received a2a (devices x a2a width) | reduced | dp | zeros]``."""

    @property
    def total_dim(self) -> int:
        return sum(self.tables[t].dim for t in self.feature_table)

    def groups_of(self, kind: str) -> list[Group]:
        return [g for g in self.groups if g.kind == kind]

    def width(self, kind: str) -> int:
        return sum(g.width for g in self.groups_of(kind))


def build_layout(tables: Sequence[TableSpec], plan: ShardingPlan) -> ShardedLayout:
    """The per-device groups of ``tables`` under ``plan`` (module doc)."""
    tables = tuple(tables)
    names = [t.name for t in tables]
    missing = [n for n in names if n not in plan]
    extra = [n for n in plan if n not in names]
    if missing or extra:
        raise ValueError(f"the plan must shard exactly the collection's tables: missing "
                         f"{missing}, unknown {extra}; make the plan for these tables")
    n = plan.world_size
    for t in tables:
        plan[t.name].check(t.name, t.rows, t.dim, n)
        if t.dynamic:
            _check_dynamic(t, plan[t.name], n)
    features = tuple(f for t in tables for f in t.features)
    feature_table = tuple(i for i, t in enumerate(tables) for _ in t.features)
    first_feature = np.concatenate([[0], np.cumsum([len(t.features) for t in tables])])
    kinds = tuple(plan[t.name].sharding_type for t in tables)
    hosted = tuple(placement(t, plan) for t in tables)
    # host-cached tables of one policy share a cache
    stores = [(p, t.cache_policy if p == "host_cached" else "") for p, t in zip(hosted, tables)]

    buckets: dict[tuple, list[int]] = {}
    for i, (t, kind) in enumerate(zip(tables, kinds)):
        if kind == ShardingType.DATA_PARALLEL:
            if hosted[i] != "device":
                raise ValueError(f"table {t.name!r} is placed in host memory, which its DATA_PARALLEL "
                                 "sharding (a copy on every device) cannot use: shard it TABLE_WISE, "
                                 "ROW_WISE or COLUMN_WISE, or place it on the device")
            key = (DP, 0, t.dtype, "", ("device", ""))
        elif kind == ShardingType.ROW_WISE:  # dynamic: a group of its own
            key = (REDUCE, t.dim, t.dtype, t.name if t.dynamic else "", stores[i])
        else:
            for s in plan[t.name].shards:
                members = buckets.setdefault((A2A, s.num_cols, t.dtype, "", stores[i]), [])
                if i not in members:
                    members.append(i)
            continue
        buckets.setdefault(key, []).append(i)

    groups, where = [], {}  # where[(table, device, feature)] = (group, slot)
    order = sorted(buckets, key=lambda k: ({A2A: 0, REDUCE: 1, DP: 2}[k[0]], min(buckets[k])))
    for kind, dim, dtype, dynamic, (placed, policy) in order:
        members = buckets[(kind, dim, dtype, dynamic, (placed, policy))]
        g = len(groups)
        if kind == DP:
            groups.append(_dp_group(tables, members, dtype, n, first_feature))
            pairs = [(t, f) for t in members for f in range(len(tables[t].features))]
            for slot, (t, f) in enumerate(pairs):
                where[(t, -1, f)] = (g, slot)
            continue
        group, slots = _sharded_group(kind, dim, dtype, members, tables, plan, first_feature)
        group = dataclasses.replace(group, dynamic=bool(dynamic), placement=placed)
        if placed == "host_cached":
            group = dataclasses.replace(group, cache_policy=policy, cache_rows=_cache_rows(group, tables))
        groups.append(group)
        where.update({key: (g, slot) for key, slot in slots.items()})

    contributors = _contributors(tables, kinds, plan, groups, where, n)
    return ShardedLayout(n, tables, kinds, features, feature_table, tuple(groups), contributors)


def placement(table: TableSpec, plan: ShardingPlan) -> str:
    """Where ``table``'s rows live under ``plan``: the plan's placement, else the config's."""
    return plan[table.name].placement or table.placement


def _cache_rows(group: Group, tables: Sequence[TableSpec]) -> int:
    """A host-cached group's cache rows per device (``Group.cache_rows``)."""
    wanted = [0] * len(group.slot_feature)
    for p in group.pieces:
        t = tables[p.table]
        wanted[p.device] += -(-(p.row_hi - p.row_lo) * t.cache_rows // t.rows)
    bucket = 128  # jaxrec.nn.host_cache.BUCKET_SIZE
    whole = -(-group.layout.rows[0] // bucket) * bucket
    return min(-(-max(max(wanted), 1) // bucket) * bucket, whole)


def _check_dynamic(table: TableSpec, sharding, n: int) -> None:
    """A dynamic table's plan: ROW_WISE over every device in order, in equal blocks (each
    device's block is one bucket range of the hash index, ``hash_table.shard_of``)."""
    block = table.rows // n
    even = tuple((s.device, s.row_offset, s.num_rows) for s in sharding.shards) == tuple(
        (d, d * block, block) for d in range(n))
    if sharding.sharding_type != ShardingType.ROW_WISE or table.rows % n or not even:
        raise ValueError(
            f"table {table.name!r} is a dynamic vocabulary: it is sharded ROW_WISE over every device "
            f"in order, in equal blocks of rows (each device holds one bucket range of its hash "
            f"index), and its num_embeddings={table.rows} must be a multiple of the {n} devices; got "
            f"{sharding.sharding_type.value} on devices {list(sharding.ranks)}. Plan it with "
            "jaxrec.parallel.row_wise() (the planner does)")


def _sharded_group(kind, dim, dtype, members, tables, plan, first_feature
                   ) -> tuple[Group, dict[tuple[int, int, int], int]]:
    """An a2a or reduce group (each device's shards stacked, its slots listed and padded to
    the most slots of any device) and the slot of each (table, device, feature)."""
    n = plan.world_size
    per_device = [[] for _ in range(n)]  # (table, shard) on each device, in table order
    for t in members:
        for s in plan[tables[t].name].shards:
            if kind == REDUCE or s.num_cols == dim:
                per_device[s.device].append((t, s))
    if kind == REDUCE:  # the same slots on every device: one per feature of the tables
        slots = [(t, f) for t in members for f in range(len(tables[t].features))]
        per_device_slots = [slots] * n
    else:
        per_device_slots = [[(t, f) for t, _ in on for f in range(len(tables[t].features))]
                            for on in per_device]
    num_slots = max(1, max(len(s) for s in per_device_slots))
    rows = max(1, max(sum(s.num_rows for _, s in on) for on in per_device))
    sf, so, lo, hi, pieces, where = [], [], [], [], [], {}
    for d in range(n):
        offset_of, offset = {}, 0
        for t, s in per_device[d]:
            offset_of[t] = (offset, s)
            pieces.append(Piece(t, s.row_offset, s.row_end, s.col_offset, s.col_end, d, offset))
            offset += s.num_rows
        row_f, row_o, row_lo, row_hi = [], [], [], []
        for slot, (t, f) in enumerate(per_device_slots[d]):
            off, s = offset_of.get(t, (0, None))  # a reduce table may have no rows here
            row_f.append(int(first_feature[t]) + f)
            row_o.append(off)
            row_lo.append(s.row_offset if s is not None else 0)
            row_hi.append(s.row_end if s is not None else 0)
            where[(t, d, f)] = slot
        pad = num_slots - len(row_f)
        sf.append(tuple(row_f + [-1] * pad))
        so.append(tuple(row_o + [0] * pad))
        lo.append(tuple(row_lo + [0] * pad))
        hi.append(tuple(row_hi + [0] * pad))
    layout = TableLayout(rows=(rows,), dims=(dim,), feature_table_map=(0,) * num_slots)
    group = Group(kind, dtype, layout, tuple(sf), tuple(so), tuple(lo), tuple(hi), tuple(pieces))
    return group, where


def _dp_group(tables, members, dtype, n, first_feature) -> Group:
    layout = TableLayout(rows=tuple(tables[t].rows for t in members),
                         dims=tuple(tables[t].dim for t in members),
                         feature_table_map=tuple(i for i, t in enumerate(members)
                                                 for _ in tables[t].features))
    row_f = tuple(int(first_feature[t]) + f for t in members for f in range(len(tables[t].features)))
    zeros = (0,) * len(row_f)
    hi = tuple(tables[t].rows for t in members for _ in tables[t].features)
    pieces = tuple(Piece(t, 0, tables[t].rows, 0, tables[t].dim, -1, i)
                   for i, t in enumerate(members))
    return Group(DP, dtype, layout, (row_f,) * n, (zeros,) * n, (zeros,) * n, (hi,) * n, pieces)


def _contributors(tables, kinds, plan, groups, where, n) -> tuple[tuple[int, ...], ...]:
    """Column sources of each output column (see ``ShardedLayout.contributors``)."""
    a2a_width = sum(g.width for g in groups if g.kind == A2A)
    base = {A2A: 0, REDUCE: n * a2a_width}
    base[DP] = base[REDUCE] + sum(g.width for g in groups if g.kind == REDUCE)
    zero = base[DP] + sum(g.width for g in groups if g.kind == DP)
    group_offset, seen = [], {A2A: 0, REDUCE: 0, DP: 0}
    for g in groups:
        group_offset.append(seen[g.kind])
        seen[g.kind] += g.width

    columns = []  # per output column: its source columns
    for t, (spec, kind) in enumerate(zip(tables, kinds)):
        for f in range(len(spec.features)):
            for c in range(spec.dim):
                if kind in (ShardingType.DATA_PARALLEL, ShardingType.ROW_WISE):
                    g, slot = where[(t, -1, f)] if kind == ShardingType.DATA_PARALLEL else \
                        where[(t, plan[spec.name].shards[0].device, f)]
                    group = groups[g]
                    col = group.layout.output_offsets[slot] + c
                    columns.append([base[group.kind] + group_offset[g] + col])
                    continue
                sources = []
                for s in plan[spec.name].shards:
                    if s.col_offset <= c < s.col_end and s.num_rows > 0:
                        g, slot = where[(t, s.device, f)]
                        col = groups[g].layout.output_offsets[slot] + c - s.col_offset
                        sources.append(s.device * a2a_width + group_offset[g] + col)
                columns.append(sources)
    k = max(1, max(len(c) for c in columns))
    return tuple(tuple(c[j] if j < len(c) else zero for c in columns) for j in range(k))
