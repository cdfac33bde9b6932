"""``ShardingPlan.table()``: the plan as text, like TorchRec's planner statistics::

    --- jaxrec sharding plan: 8 devices (1 host x 8), batch 8192 per device ---
    table     type          devices   shards (rows x cols)   compute (ms)   memory (GiB)
    t_C1      row_wise      0-7       8 x 4985551x128             1.234          20.41
    ...       (a type followed by "(host)": the table is placed in host memory)
    ...
    device   memory (GiB)        step (ms)   compute   shards
    0        12.30 / 16.00 (77%)     2.310     2.100   TW 3, RW 4
    ...
    slowest device 1.06x the mean (tolerance 1.10); communication 0.21 ms per device
"""

from __future__ import annotations

from collections import Counter

_SHORT = {"data_parallel": "DP", "table_wise": "TW", "row_wise": "RW", "column_wise": "CW",
          "table_row_wise": "TRW"}


def _devices(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _shards(ps) -> str:
    if not ps.shards:
        return "replicated"
    sizes = Counter((s.num_rows, s.num_cols) for s in ps.shards)
    return ", ".join(f"{k} x {r}x{c}" if k > 1 else f"{r}x{c}" for (r, c), k in sizes.items())


def format_plan(plan) -> str:
    stats, gib = plan.stats, float(1 << 30)
    n, local = plan.world_size, plan.local_world_size
    head = f"--- jaxrec sharding plan: {n} devices ({n // local} host x {local})"
    if stats is not None:
        head += f", batch {stats.topology.batch_size} per device"
    lines = [head + " ---"]
    rows = [("table", "type", "devices", "hosts", "shards (rows x cols)", "compute (ms)", "memory (GiB)")]
    for name, ps in plan.items():
        perf = f"{stats.table_perf[name] * 1e3:.3f}" if stats else "-"
        mem = f"{stats.table_memory[name] / gib:.3f}" if stats else "-"
        hosts = _devices({r // local for r in ps.ranks})
        kind = ps.sharding_type.value + (" (host)" if ps.placement == "host" else "")
        rows.append((name, kind, _devices(ps.ranks), hosts, _shards(ps), perf, mem))
    lines += _columns(rows)
    if stats is None:
        return "\n".join(lines)
    per_device = [Counter() for _ in range(n)]
    for ps in plan.values():
        for d in (ps.ranks if not ps.shards else [s.device for s in ps.shards]):
            per_device[d][_SHORT[ps.sharding_type.value]] += 1
    cap = stats.topology.hbm_cap
    rows = [("device", "host", "memory (GiB)", "step (ms)", "compute (ms)", "shards")]
    for d in range(n):
        memory = f"{stats.memory / gib:.2f} / {cap / gib:.2f} ({100 * stats.memory / cap:.0f}%)"
        rows.append((str(d), str(d // local), memory,
                     f"{stats.perf[d] * 1e3:.3f}", f"{stats.compute[d] * 1e3:.3f}",
                     ", ".join(f"{k} {v}" for k, v in sorted(per_device[d].items()))))
    lines += [""] + _columns(rows)
    tol = stats.balance_tolerance
    lines.append(f"slowest device {stats.imbalance:.3f}x the mean"
                 + (f" (tolerance {1 + tol:.2f})" if tol is not None else "")
                 + f"; communication {stats.communication * 1e3:.3f} ms per device; memory per "
                 f"device: weights {stats.weights / gib:.2f}, optimizer {stats.optimizer_state / gib:.2f}"
                 f", buffers {stats.buffers / gib:.2f} GiB"
                 + (f", host memory {stats.host_memory / gib:.2f} / {stats.topology.ddr_cap / gib:.2f} GiB"
                    if stats.host_memory else "")
                 + f"; {stats.proposals} proposal(s)")
    return "\n".join(lines)


def _columns(rows) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
