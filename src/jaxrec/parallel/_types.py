"""Sharding types, one table's sharding and a whole plan (TorchRec's vocabulary), as JSON.

A plan says, for every table, how it is cut and which devices hold the pieces. Devices
are positions ``0 .. world_size - 1`` along the mesh axis that carries the batch::

    # t_user  (1000 x 64)  TABLE_WISE  on device 2     Shard(rows 0:1000, cols 0:64, device 2)
    # t_item  (1000 x 64)  ROW_WISE    over 0..3       Shard(rows   0:250, cols 0:64, device 0)
    #                                                  Shard(rows 250:500, cols 0:64, device 1) ...
    # t_geo   (  50 x 64)  COLUMN_WISE on 1, 3         Shard(rows 0:50, cols  0:32, device 1)
    #                                                  Shard(rows 0:50, cols 32:64, device 3)
    # t_tiny  (   4 x 64)  DATA_PARALLEL               (no shards: every device holds it all)

``ShardingPlan.save`` / ``ShardingPlan.load`` write and read it as JSON, so that a
production run uses one fixed plan. Plans are frozen and hashable.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
import pathlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from jaxrec.parallel._table_spec import table_specs

_FORMAT = "jaxrec.parallel.ShardingPlan/1"


class ShardingType(str, enum.Enum):
    """How a table is cut (TorchRec's ``ShardingType``, same values)."""

    DATA_PARALLEL = "data_parallel"
    """Every device holds the whole table (replicated)."""
    TABLE_WISE = "table_wise"
    """One device holds the whole table."""
    ROW_WISE = "row_wise"
    """Rows split evenly over every device."""
    COLUMN_WISE = "column_wise"
    """Columns split over some devices, each holding all rows of its columns."""
    TABLE_ROW_WISE = "table_row_wise"
    """Rows split evenly over the devices of one host."""


def as_sharding_type(value) -> ShardingType:
    """A ShardingType from itself or its value / name (any case)."""
    if isinstance(value, ShardingType):
        return value
    text = str(value).lower()
    for t in ShardingType:
        if text in (t.value, t.name.lower()):
            return t
    raise ValueError(f"sharding type must be one of {[t.value for t in ShardingType]}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shard:
    """A block of one table held by one device: rows ``[row_offset, row_offset + num_rows)``,
    columns ``[col_offset, col_offset + num_cols)``."""

    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int
    device: int

    @property
    def row_end(self) -> int:
        return self.row_offset + self.num_rows

    @property
    def col_end(self) -> int:
        return self.col_offset + self.num_cols


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParameterSharding:
    """One table's sharding (TorchRec's ``ParameterSharding``): its type, the devices
    involved and its shards (none for DATA_PARALLEL, which every device holds whole)."""

    sharding_type: ShardingType
    ranks: tuple[int, ...]
    """The devices that hold a piece of the table (all of them for DATA_PARALLEL)."""
    shards: tuple[Shard, ...] = ()
    placement: str | None = None
    """Where the shards' rows live: ``"device"`` or ``"host"`` (host memory, each batch's
    rows read over PCIe: ``EmbeddingBagConfig.placement``); None: the table config's. The
    planner sets ``"host"`` for tables that device memory cannot hold (TorchRec's
    ``compute_kernel``)."""

    def __post_init__(self):
        if self.placement not in (None, "device", "host"):
            raise ValueError(f"placement must be None (the table config's), 'device' or 'host', got "
                             f"{self.placement!r}")
        object.__setattr__(self, "sharding_type", as_sharding_type(self.sharding_type))
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        object.__setattr__(self, "shards", tuple(self.shards))

    def check(self, name: str, rows: int, dim: int, world_size: int) -> None:
        """Raises ``ValueError`` unless the shards tile the ``rows x dim`` table exactly."""
        kind, shards = self.sharding_type, self.shards
        where = f"table {name!r} ({rows} x {dim}, {kind.value})"
        bad = [r for r in self.ranks if not 0 <= r < world_size]
        if bad or not self.ranks:
            raise ValueError(f"{where}: ranks must be devices in [0, {world_size}), got "
                             f"{list(self.ranks)}")
        if kind == ShardingType.DATA_PARALLEL:
            if shards:
                raise ValueError(f"{where}: a data-parallel table has no shards (every device "
                                 "holds it whole); pass shards=()")
            return
        devices = [s.device for s in shards]
        if sorted(devices) != sorted(self.ranks) or len(set(devices)) != len(devices):
            raise ValueError(f"{where}: each rank must hold exactly one shard; ranks "
                             f"{list(self.ranks)}, shard devices {devices}")
        by_rows = sorted(shards, key=lambda s: (s.row_offset, s.col_offset))
        if kind == ShardingType.COLUMN_WISE:
            cuts = sorted((s.col_offset, s.col_end) for s in shards)
            whole = all(s.row_offset == 0 and s.num_rows == rows for s in shards)
            ok = whole and all(s.num_cols > 0 for s in shards)
            spans, total = cuts, dim
        else:
            ok = all(s.col_offset == 0 and s.num_cols == dim and s.num_rows >= 0 for s in shards)
            spans, total = [(s.row_offset, s.row_end) for s in by_rows], rows
            if kind == ShardingType.TABLE_WISE:
                ok = ok and len(shards) == 1
        ok = ok and spans[0][0] == 0 and spans[-1][1] == total and all(
            a[1] == b[0] for a, b in itertools.pairwise(spans))
        if not ok:
            raise ValueError(f"{where}: the shards {[_shard_text(s) for s in shards]} do not "
                             f"tile the table; build them with jaxrec.parallel.{kind.value}(...)")


def _shard_text(s: Shard) -> str:
    return f"rows {s.row_offset}:{s.row_end} cols {s.col_offset}:{s.col_end} @ {s.device}"


# --- generators, as in torchrec.distributed.sharding_plan -----------------------------

ShardingGenerator = Callable[[int, int, int, int], ParameterSharding]
"""``generator(rows, dim, world_size, local_world_size) -> ParameterSharding``."""


def _even_splits(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` consecutive (offset, size) blocks of ``ceil(total / parts)``; the last
    ones may be smaller or empty (TorchRec's row-wise block size)."""
    block = -(-total // parts)
    return [(min(i * block, total), max(0, min(block, total - i * block))) for i in range(parts)]


def data_parallel() -> ShardingGenerator:
    """Every device holds the whole table."""
    def gen(rows, dim, world_size, local_world_size):
        return ParameterSharding(sharding_type=ShardingType.DATA_PARALLEL,
                                 ranks=tuple(range(world_size)))
    return gen


def table_wise(rank: int) -> ShardingGenerator:
    """Device ``rank`` holds the whole table."""
    def gen(rows, dim, world_size, local_world_size):
        return ParameterSharding(sharding_type=ShardingType.TABLE_WISE, ranks=(rank,),
                                 shards=(Shard(row_offset=0, num_rows=rows, col_offset=0,
                                               num_cols=dim, device=rank),))
    return gen


def row_wise(ranks: Sequence[int] | None = None) -> ShardingGenerator:
    """Rows split evenly over ``ranks`` (default: every device), in order."""
    def gen(rows, dim, world_size, local_world_size):
        rs = tuple(range(world_size)) if ranks is None else tuple(ranks)
        shards = tuple(Shard(row_offset=o, num_rows=n, col_offset=0, num_cols=dim, device=r)
                       for r, (o, n) in zip(rs, _even_splits(rows, len(rs))))
        return ParameterSharding(sharding_type=ShardingType.ROW_WISE, ranks=rs, shards=shards)
    return gen


def column_wise(ranks: Sequence[int]) -> ShardingGenerator:
    """Columns split as evenly as possible over ``ranks`` (one shard each, in order)."""
    def gen(rows, dim, world_size, local_world_size):
        rs = tuple(ranks)
        if not 1 <= len(rs) <= dim:
            raise ValueError(f"column_wise needs 1 to dim={dim} ranks, got {list(rs)}")
        sizes = [dim // len(rs) + (i < dim % len(rs)) for i in range(len(rs))]
        offsets = [sum(sizes[:i]) for i in range(len(rs))]
        shards = tuple(Shard(row_offset=0, num_rows=rows, col_offset=o, num_cols=n, device=r)
                       for r, o, n in zip(rs, offsets, sizes))
        return ParameterSharding(sharding_type=ShardingType.COLUMN_WISE, ranks=rs, shards=shards)
    return gen


def table_row_wise(host_index: int) -> ShardingGenerator:
    """Rows split evenly over the ``local_world_size`` devices of host ``host_index``."""
    def gen(rows, dim, world_size, local_world_size):
        rs = tuple(range(host_index * local_world_size, (host_index + 1) * local_world_size))
        base = row_wise(rs)(rows, dim, world_size, local_world_size)
        return dataclasses.replace(base, sharding_type=ShardingType.TABLE_ROW_WISE)
    return gen


# --- the plan ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Each table's ``ParameterSharding`` for a mesh axis of ``world_size`` devices.

    ``local_world_size`` is the number of devices per host (TABLE_ROW_WISE keeps a table
    inside one host). ``stats`` holds the planner's estimates when a planner made the plan
    (``table()`` prints them); it does not take part in equality.
    """

    shardings: Mapping[str, ParameterSharding] | tuple[tuple[str, ParameterSharding], ...]
    world_size: int
    local_world_size: int | None = None
    stats: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self):
        items = self.shardings.items() if isinstance(self.shardings, Mapping) else self.shardings
        items = tuple((str(k), v) for k, v in items)
        for name, ps in items:
            if not isinstance(ps, ParameterSharding):
                raise TypeError(f"plan entry {name!r} must be a ParameterSharding, got "
                                f"{type(ps).__name__}")
        names = [k for k, _ in items]
        if len(set(names)) != len(names):
            raise ValueError(f"a plan names each table once, got {names}")
        if isinstance(self.world_size, bool) or int(self.world_size) < 1:
            raise ValueError(f"world_size must be an int >= 1, got {self.world_size!r}")
        local = self.world_size if self.local_world_size is None else int(self.local_world_size)
        if local < 1 or self.world_size % local:
            raise ValueError(f"local_world_size (devices per host) must divide world_size="
                             f"{self.world_size}, got {local}")
        object.__setattr__(self, "shardings", items)
        object.__setattr__(self, "world_size", int(self.world_size))
        object.__setattr__(self, "local_world_size", local)

    def __getitem__(self, table: str) -> ParameterSharding:
        for name, ps in self.shardings:
            if name == table:
                return ps
        raise KeyError(f"the plan has no table {table!r}; it shards {list(self)}")

    def __contains__(self, table: str) -> bool:
        return any(name == table for name, _ in self.shardings)

    def __iter__(self) -> Iterator[str]:
        return iter(name for name, _ in self.shardings)

    def __len__(self) -> int:
        return len(self.shardings)

    def items(self) -> list[tuple[str, ParameterSharding]]:
        return list(self.shardings)

    def values(self) -> list[ParameterSharding]:
        return [ps for _, ps in self.shardings]

    def table(self) -> str:
        """The plan as a text table, like TorchRec's planner statistics."""
        from jaxrec.parallel._stats import format_plan
        return format_plan(self)

    # -- JSON ------------------------------------------------------------------------------
    def to_json(self) -> dict:
        tables = {}
        for name, ps in self.shardings:
            tables[name] = {"sharding_type": ps.sharding_type.value, "ranks": list(ps.ranks),
                            "shards": [{"rows": [s.row_offset, s.num_rows],
                                        "cols": [s.col_offset, s.num_cols], "device": s.device}
                                       for s in ps.shards]}
            if ps.placement is not None:
                tables[name]["placement"] = ps.placement
        out = {"format": _FORMAT, "world_size": self.world_size,
               "local_world_size": self.local_world_size, "tables": tables}
        if self.stats is not None and hasattr(self.stats, "to_json"):
            out["stats"] = self.stats.to_json()  # informative only; load() ignores it
        return out

    @classmethod
    def from_json(cls, data: Mapping) -> ShardingPlan:
        if data.get("format") != _FORMAT:
            raise ValueError(f"not a jaxrec sharding plan: format={data.get('format')!r}, "
                             f"expected {_FORMAT!r}")
        shardings = {}
        for name, entry in data["tables"].items():
            shards = tuple(Shard(row_offset=s["rows"][0], num_rows=s["rows"][1],
                                 col_offset=s["cols"][0], num_cols=s["cols"][1],
                                 device=s["device"]) for s in entry["shards"])
            shardings[name] = ParameterSharding(sharding_type=entry["sharding_type"],
                                                ranks=tuple(entry["ranks"]), shards=shards,
                                                placement=entry.get("placement"))
        return cls(shardings, data["world_size"], data.get("local_world_size"))

    def save(self, path) -> pathlib.Path:
        path = pathlib.Path(path)
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path

    @classmethod
    def load(cls, path) -> ShardingPlan:
        return cls.from_json(json.loads(pathlib.Path(path).read_text()))


def construct_plan(tables, per_table: Mapping[str, ShardingGenerator], world_size: int, *,
                   local_world_size: int | None = None) -> ShardingPlan:
    """A plan written by hand (TorchRec's ``construct_module_sharding_plan``)::

        plan = construct_plan(tables, {"t_user": table_wise(rank=2), "t_item": row_wise(),
                                       "t_geo": column_wise(ranks=[1, 3])}, world_size=4)

    ``tables``: the collection's ``EmbeddingBagConfig`` s (or ``TableSpec`` s); every table
    needs a generator.
    """
    local = world_size if local_world_size is None else local_world_size
    by_name = {t.name: t for t in table_specs(tables)}
    missing = sorted(set(by_name) - set(per_table))
    unknown = sorted(set(per_table) - set(by_name))
    if missing or unknown:
        raise ValueError(f"per_table must give one generator per table: missing {missing}, "
                         f"unknown {unknown}")
    shardings = {}
    for name, t in by_name.items():
        ps = per_table[name](t.rows, t.dim, world_size, local)
        ps.check(name, t.rows, t.dim, world_size)
        shardings[name] = ps
    return ShardingPlan(shardings, world_size, local)
