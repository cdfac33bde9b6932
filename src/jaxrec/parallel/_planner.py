"""``EmbeddingShardingPlanner``: a plan that fits every device and balances the step.

Stages (each a function below, as TorchRec's planner has them):

1. **enumerate** each table's options (the sharding types its constraints allow, and the
   optimizer allows: COLUMN_WISE needs an optimizer that updates columns independently)
   with their total cost over all devices (``_estimator``); the cheapest is the start
   (TABLE_WISE as a rule; DATA_PARALLEL for small plain tables).
2. **partition**: fixed shards first (ROW_WISE, DATA_PARALLEL, TABLE_ROW_WISE and forced
   ranks), then the TABLE_WISE / COLUMN_WISE shards greedily, largest cost first, each on
   the device with the least load so far (ties: the fewest rows of its group, which keeps
   the SPMD padding small). This is LPT scheduling: within 4/3 of the best makespan.
3. **fit**: while the estimated memory per device exceeds ``hbm_cap``, the largest
   table not yet split by rows becomes ROW_WISE (TABLE_ROW_WISE if only that is allowed);
   once every table that may be is split, the largest table still in device memory is
   placed in host memory (``placement="host"``, with a fused optimizer; counted against
   ``ddr_cap``), as TorchRec's planner turns to UVM when HBM runs out.
4. **balance**: while the slowest device is more than ``balance_tolerance`` above the
   mean, split the largest table of each of the k slowest devices (COLUMN_WISE in two, or
   ROW_WISE) for k = 1, 2, ..., and keep the proposal that lowers the slowest device's
   time most; stop when none does.

The result carries its estimates (``plan.stats``); ``plan.table()`` prints them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax.numpy as jnp

from jaxrec.parallel._estimator import (
    PlanStats,
    StateBytes,
    estimate,
    shard_bytes,
    state_bytes,
)
from jaxrec.parallel._table_spec import TableSpec, table_specs
from jaxrec.parallel._topology import ParameterConstraints, Topology
from jaxrec.parallel._types import (
    ParameterSharding,
    Shard,
    ShardingPlan,
    column_wise,
    data_parallel,
    row_wise,
    table_row_wise,
)
from jaxrec.parallel._types import (
    ShardingType as ST,
)

_COLUMN_SEPARABLE = ("SGD", "Adagrad", "Adam")
MIN_COLUMN_SHARD = 8
"""The fewest columns a COLUMN_WISE shard may have."""


class PlannerError(ValueError):
    """No plan fits; the message says by how much and what to change."""


@dataclasses.dataclass(frozen=True)
class _Choice:
    kind: ST
    column_shards: int = 1
    placement: str | None = None
    """``"host"`` once the fit stage places the table in host memory; None: its config's."""


class EmbeddingShardingPlanner:
    """Plans the sharding of a collection's tables over ``topology`` (module doc).

    Args:
      topology: the devices, their memory and bandwidths, the batch per device.
      optimizer: the fused optimizer config (its state counts in memory, and decides
        whether COLUMN_WISE is exact), or None for plain tables.
      constraints: ``{table name: ParameterConstraints}``.
      balance_tolerance: the slowest device may be this fraction above the mean.
      max_proposals: how many plans the fit and balance stages may try.
    """

    def __init__(self, topology: Topology, *, optimizer=None,
                 constraints: Mapping[str, ParameterConstraints] | None = None,
                 balance_tolerance: float = 0.1, max_proposals: int = 64):
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a jaxrec.parallel.Topology, got {topology!r}")
        self.topology = topology
        self.optimizer = optimizer
        self.constraints = dict(constraints or {})
        self.balance_tolerance = float(balance_tolerance)
        self.max_proposals = int(max_proposals)
        self._state = state_bytes(optimizer)

    def plan(self, tables) -> ShardingPlan:
        specs = table_specs(tables)
        unknown = sorted(set(self.constraints) - {t.name for t in specs})
        if unknown:
            raise ValueError(f"constraints name tables {unknown} that are not among the tables "
                             f"{[t.name for t in specs]}")
        choices = {t.name: self._enumerate(t)[0] for t in specs}
        proposals = 0
        smallest = None  # the plan that needed the least memory, for the error
        while True:  # fit
            proposals += 1
            plan, stats = self._evaluate(specs, choices, proposals)
            if stats.fits:
                break
            smallest = stats if smallest is None or stats.memory < smallest.memory else smallest
            bigger = self._split_for_memory(specs, choices) or self._place_in_host(specs, choices)
            if bigger is None or proposals >= self.max_proposals:
                raise PlannerError(self._no_fit_message(smallest))
            choices = bigger
        best = (plan, stats)
        while stats.imbalance > 1 + self.balance_tolerance and proposals < self.max_proposals:
            candidates = []
            for k in range(1, self.topology.world_size + 1):
                proposal = self._split_for_balance(specs, choices, best[0], best[1], k)
                if proposal is None:
                    break
                proposals += 1
                plan, trial = self._evaluate(specs, proposal, proposals)
                if trial.fits:
                    candidates.append((max(trial.perf), proposal, plan, trial))
            if not candidates:
                break
            fastest = min(candidates, key=lambda c: c[0])
            if fastest[0] >= max(best[1].perf) * (1 - 1e-9):
                break
            choices, best = fastest[1], (fastest[2], fastest[3])
            stats = best[1]
        plan, stats = best
        return dataclasses.replace(plan, stats=dataclasses.replace(stats, proposals=proposals))

    # -- stage 1: options -----------------------------------------------------------------
    def _allowed(self, spec: TableSpec) -> list[ST]:
        c = self.constraints.get(spec.name)
        if spec.dynamic:  # each device holds one bucket range of the hash index: rows split evenly
            if c and c.sharding_types and ST.ROW_WISE not in c.sharding_types:
                raise ValueError(f"table {spec.name!r} is a dynamic vocabulary, which is sharded ROW_WISE "
                                 f"over every device only; its constraints allow "
                                 f"{[t.value for t in c.sharding_types]}: allow 'row_wise'")
            return [ST.ROW_WISE]
        allowed = list(c.sharding_types) if c and c.sharding_types else [
            ST.TABLE_WISE, ST.COLUMN_WISE, ST.ROW_WISE, ST.DATA_PARALLEL]
        if spec.placement != "device" and ST.DATA_PARALLEL in allowed and len(allowed) > 1:
            allowed.remove(ST.DATA_PARALLEL)  # a copy on every device has no place in host memory
        separable = self.optimizer is None or type(self.optimizer).__name__ in _COLUMN_SEPARABLE
        if not separable or spec.dim < 2 * MIN_COLUMN_SHARD:
            if c and c.sharding_types == (ST.COLUMN_WISE,) and not separable:
                raise ValueError(f"table {spec.name!r} is constrained to COLUMN_WISE but "
                                 f"{type(self.optimizer).__name__} reads whole rows; allow another "
                                 "type or use SGD, Adagrad or Adam")
            if ST.COLUMN_WISE in allowed and len(allowed) > 1:
                allowed.remove(ST.COLUMN_WISE)
        return allowed

    def _enumerate(self, spec: TableSpec) -> list[_Choice]:
        """The allowed options, cheapest total cost first."""
        topo, n = self.topology, self.topology.world_size
        factors = self._factors(spec)
        ids = n * topo.batch_size * sum(factors)
        bags = n * topo.batch_size * len(spec.features)
        wb = _itemsize(spec.dtype)
        out_bytes = 2 * bags * spec.dim * 4
        fused = self.optimizer is not None

        def cost(kind: ST) -> float:
            if kind in (ST.TABLE_WISE, ST.COLUMN_WISE):
                compute, comm = shard_bytes(1.0, spec.dim, ids, bags, wb, self._state), out_bytes
            elif kind in (ST.ROW_WISE, ST.TABLE_ROW_WISE):
                k = n if kind == ST.ROW_WISE else topo.local_world_size
                compute = k * shard_bytes(1 / k, spec.dim, ids, bags, wb, self._state)
                comm = k * out_bytes
            elif fused:  # DATA_PARALLEL: the global batch on every device
                compute, comm = n * shard_bytes(1.0, spec.dim, ids, bags, wb, self._state), \
                    n * out_bytes / 2
            else:  # DATA_PARALLEL, plain: local batches, all-reduced dense gradient
                compute = shard_bytes(1.0, spec.dim, ids, bags, wb, StateBytes()) + \
                    2 * n * spec.rows * spec.dim * 4
                comm = 2 * n * spec.rows * spec.dim * 4
            return compute / topo.hbm_bw + topo.send_seconds(comm)

        order = {ST.TABLE_WISE: 0, ST.COLUMN_WISE: 1, ST.TABLE_ROW_WISE: 2, ST.ROW_WISE: 3,
                 ST.DATA_PARALLEL: 4}
        kinds = sorted(self._allowed(spec), key=lambda k: (cost(k), order[k]))
        return [_Choice(k, 2 if k == ST.COLUMN_WISE else 1) for k in kinds]

    def _factors(self, spec: TableSpec) -> tuple[float, ...]:
        c = self.constraints.get(spec.name)
        if c and c.pooling_factors:
            if len(c.pooling_factors) != len(spec.features):
                raise ValueError(f"table {spec.name!r}: pooling_factors needs one value per "
                                 f"feature {list(spec.features)}, got {list(c.pooling_factors)}")
            return c.pooling_factors
        return (1.0,) * len(spec.features)

    # -- stage 2: partition -----------------------------------------------------------------
    def _partition(self, specs: Sequence[TableSpec], choices: Mapping[str, _Choice]) -> ShardingPlan:
        topo, n = self.topology, self.topology.world_size
        load = [0.0] * n
        rows: dict[tuple, list[int]] = {}
        shardings, free = {}, []
        for spec in specs:
            choice, c = choices[spec.name], self.constraints.get(spec.name)
            ranks = c.ranks if c and c.ranks else None
            if choice.kind == ST.DATA_PARALLEL:
                shardings[spec.name] = data_parallel()(spec.rows, spec.dim, n, topo.local_world_size)
            elif choice.kind == ST.ROW_WISE:
                shardings[spec.name] = row_wise()(spec.rows, spec.dim, n, topo.local_world_size)
            elif choice.kind == ST.TABLE_ROW_WISE:
                host = (ranks[0] // topo.local_world_size) if ranks else self._quiet_host(load)
                shardings[spec.name] = table_row_wise(host)(spec.rows, spec.dim, n,
                                                            topo.local_world_size)
            elif ranks is not None:
                k = len(ranks) if choice.kind == ST.COLUMN_WISE else 1
                shardings[spec.name] = column_wise(ranks[:k])(spec.rows, spec.dim, n,
                                                              topo.local_world_size)
                if choice.kind == ST.TABLE_WISE:
                    shardings[spec.name] = dataclasses.replace(shardings[spec.name],
                                                               sharding_type=ST.TABLE_WISE)
            else:
                k = choice.column_shards if choice.kind == ST.COLUMN_WISE else 1
                for j, (col, cols) in enumerate(_column_splits(spec.dim, k)):
                    free.append((self._shard_seconds(spec, spec.rows, cols), spec.rows, spec, j,
                                 col, cols))
                continue
            for s in shardings[spec.name].shards:
                load[s.device] += self._shard_seconds(spec, s.num_rows, s.num_cols)
                group = rows.setdefault((s.num_cols, spec.dtype), [0] * n)
                group[s.device] += s.num_rows
        placed: dict[str, list[Shard]] = {}
        for seconds, num_rows, spec, _, col, cols in sorted(
                free, key=lambda f: (-f[0], -f[1], f[2].name, f[3])):
            group = rows.setdefault((cols, spec.dtype), [0] * n)
            taken = {s.device for s in placed.get(spec.name, [])}
            device = min((d for d in range(n) if d not in taken),
                         key=lambda d: (load[d] + seconds, group[d] + num_rows, d))
            load[device] += seconds
            group[device] += num_rows
            placed.setdefault(spec.name, []).append(
                Shard(row_offset=0, num_rows=num_rows, col_offset=col, num_cols=cols, device=device))
        for name, shards in placed.items():
            kind = choices[name].kind
            shards.sort(key=lambda s: s.col_offset)
            shardings[name] = ParameterSharding(sharding_type=kind,
                                                ranks=tuple(s.device for s in shards),
                                                shards=tuple(shards))
        for name, choice in choices.items():
            if choice.placement is not None:
                shardings[name] = dataclasses.replace(shardings[name], placement=choice.placement)
        return ShardingPlan({s.name: shardings[s.name] for s in specs}, n, topo.local_world_size)

    def _quiet_host(self, load: list[float]) -> int:
        local = self.topology.local_world_size
        hosts = [sum(load[h * local:(h + 1) * local]) for h in range(len(load) // local)]
        return min(range(len(hosts)), key=lambda h: (hosts[h], h))

    def _shard_seconds(self, spec: TableSpec, num_rows: int, cols: int) -> float:
        n, b = self.topology.world_size, self.topology.batch_size
        ids = n * b * sum(self._factors(spec))
        bags = n * b * len(spec.features)
        return shard_bytes(num_rows / spec.rows, cols, ids, bags, _itemsize(spec.dtype),
                            self._state) / self.topology.hbm_bw

    def _evaluate(self, specs, choices, proposals: int) -> tuple[ShardingPlan, PlanStats]:
        plan = self._partition(specs, choices)
        factors = {t.name: self._factors(t) for t in specs}
        stats = estimate(specs, plan, self.topology, optimizer=self.optimizer,
                         pooling_factors=factors, balance_tolerance=self.balance_tolerance,
                         proposals=proposals)
        return plan, stats

    # -- stages 3 and 4: split tables ---------------------------------------------------------
    def _split_for_memory(self, specs, choices) -> dict[str, _Choice] | None:
        candidates = []
        for spec in specs:
            allowed = self._allowed(spec)
            kind = choices[spec.name].kind
            if kind in (ST.ROW_WISE,):
                continue
            target = ST.ROW_WISE if ST.ROW_WISE in allowed else (
                ST.TABLE_ROW_WISE if ST.TABLE_ROW_WISE in allowed and kind != ST.TABLE_ROW_WISE
                else None)
            if target is not None:
                size = spec.rows * spec.dim * _itemsize(spec.dtype)
                candidates.append((size, spec.name, target))
        if not candidates:
            return None
        _, name, target = max(candidates)
        return {**choices, name: _Choice(target)}

    def _place_in_host(self, specs, choices) -> dict[str, _Choice] | None:
        """The largest table still in device memory placed in host memory; None when none
        may be (plain tables, dynamic vocabularies, data-parallel ones)."""
        if self.optimizer is None:
            return None
        candidates = [(spec.rows * spec.dim * _itemsize(spec.dtype), spec.name) for spec in specs
                      if spec.placement == "device" and choices[spec.name].placement is None and not spec.dynamic
                      and choices[spec.name].kind != ST.DATA_PARALLEL]
        if not candidates:
            return None
        _, name = max(candidates)
        return {**choices, name: dataclasses.replace(choices[name], placement="host")}

    def _split_for_balance(self, specs, choices, plan: ShardingPlan, stats: PlanStats, k: int
                           ) -> dict[str, _Choice] | None:
        """Splits the most expensive splittable table of each of the k slowest devices."""
        slowest = sorted(range(len(stats.perf)), key=lambda d: -stats.perf[d])[:k]
        by_name = {s.name: s for s in specs}
        new = dict(choices)
        for device in slowest:
            options = []
            for name, ps in plan.items():
                kind = new[name].kind
                if new[name] is not choices[name] or kind not in (ST.TABLE_WISE, ST.COLUMN_WISE):
                    continue
                c = self.constraints.get(name)
                if (c and c.ranks) or device not in ps.ranks:
                    continue
                allowed = self._allowed(by_name[name])
                if ST.COLUMN_WISE in allowed and by_name[name].dim >= MIN_COLUMN_SHARD * 2 * \
                        new[name].column_shards and 2 * new[name].column_shards <= len(stats.perf):
                    split = _Choice(ST.COLUMN_WISE, 2 * new[name].column_shards)
                elif ST.ROW_WISE in allowed:
                    split = _Choice(ST.ROW_WISE)
                else:
                    continue
                options.append((stats.table_perf[name], name, split))
            if not options:
                return None
            _, name, split = max(options)
            new[name] = split
        return new

    def _no_fit_message(self, stats: PlanStats) -> str:
        """``stats``: the plan tried that needed the least memory per device."""
        floor = sum(stats.table_memory.values()) / stats.topology.world_size
        host = (f" and {_size(stats.host_memory)} of host memory per device (ddr_cap "
                f"{_size(stats.topology.ddr_cap)})") if stats.host_memory else ""
        fallback = ("" if self.optimizer is None else
                    ", or give the host more memory for tables placed there (Topology.ddr_cap)")
        return (f"no plan fits: the best one needs {_size(stats.memory)} per device "
                f"(weights {_size(stats.weights)}, optimizer state {_size(stats.optimizer_state)}, "
                f"buffers {_size(stats.buffers)}){host} but hbm_cap is {_size(stats.topology.hbm_cap)}; "
                f"spread evenly over the {stats.topology.world_size} devices, the tables and their "
                f"optimizer state alone need {_size(floor)} per device. Add devices, allow "
                "ROW_WISE for the large tables, use a smaller batch, or float16 / bfloat16 tables"
                f"{fallback}")


def _size(nbytes: float) -> str:
    """Bytes in GiB, or MiB below a tenth of a GiB (so that a small cap does not read 0.00)."""
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= (1 << 30) / 10 else f"{nbytes / (1 << 20):.1f} MiB"


def _column_splits(dim: int, k: int) -> list[tuple[int, int]]:
    sizes = [dim // k + (i < dim % k) for i in range(k)]
    return [(sum(sizes[:i]), sizes[i]) for i in range(k)]


def _itemsize(dtype: str) -> int:
    return jnp.dtype(dtype).itemsize
