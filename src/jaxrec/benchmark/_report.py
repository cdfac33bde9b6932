"""What a run leaves behind: progress lines, a table for the terminal, the JSON file.

The table has one line per implementation and case; "vs jaxrec" is the time of that
implementation over jaxrec's (above 1: jaxrec is faster), and "max |diff|" is its
distance to jaxrec's output in the benchmark's own check (empty where none is made):

    case                    implementation          ms      GB/s  vs jaxrec  max |diff|
    T4 E10000 D64 B128 L10  jaxrec_forward        0.21       3.3
    T4 E10000 D64 B128 L10  xla_forward           0.58            2.76x      3.7e-09
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def write_json(path: str | Path, result: dict[str, Any]) -> None:
    """Writes `result` to `path` (its folder created if missing), indented, tuples as lists."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")


def gpu_line(row: dict[str, Any]) -> str:
    """One case of the GPU benchmark on one line: GB/s and jaxrec's speedup per peer."""
    gbs = ", ".join(f"{k} {v:.0f}" for k, v in row["GB_per_s"].items())
    sp = ", ".join(f"{k} {v:.2f}x" for k, v in row["speedup_of_jaxrec"].items())
    return f"{row['config']:<28} {row.get('weights', ''):<8} {row.get('ids', ''):<7} GB/s: {gbs} | jaxrec speedup: {sp}"


def cpu_case(config: dict[str, Any]) -> str:
    return " ".join(f"{k}{config[k]}" for k in "TEDBL")


def cpu_line(run: dict[str, Any]) -> str:
    """One case of the CPU benchmark on one line: ms per implementation, jaxrec's GB/s."""
    times = ", ".join(f"{k.removesuffix('_ms')} {v:.2f}" for k, v in run["times_ms"].items())
    return f"{cpu_case(run['config'])}: ms: {times} | jaxrec forward {run['jaxrec_forward_GB_per_s']:.1f} GB/s"


def table(result: dict[str, Any]) -> str:
    """The result of :func:`tbe_gpu` or :func:`tbe_cpu` as a plain-text table, with a title."""
    versions = ", ".join(f"{k} {result.get(k) or '-'}" for k in ("jax", "jaxlib", "jaxrec", "torch", "fbgemm_gpu")
                         if k in result)
    lines = [f"{result['benchmark']} on {result['device']} ({versions})"]
    if "copy_ceiling_GB_per_s" in result:
        lines.append(f"device-to-device copy ceiling: {result['copy_ceiling_GB_per_s']:.0f} GB/s")
    lines += [f"skipped {peer}: {note}" for peer, note in result.get("skipped", {}).items()]
    headers = ["case", "implementation", "ms", "GB/s", "vs jaxrec", "max |diff|"]
    rows = _gpu_rows(result["results"]) if "results" in result else _cpu_rows(result["runs"])
    return "\n".join(lines + [_format(headers, rows)])


def _gpu_rows(results: Sequence[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for row in results:
        case = " ".join(str(x) for x in (row["config"], row.get("weights"), row.get("ids")) if x)
        diff = row.get("max_abs_diff_vs_xla")
        first_xla = next((k for k in row["ms"] if k.startswith("xla")), None)
        for name, ms in row["ms"].items():
            speedup = row["speedup_of_jaxrec"].get(name)
            rows.append([case, name, f"{ms:.3f}", f"{row['GB_per_s'][name]:.0f}",
                         f"{speedup:.2f}x" if speedup else "",
                         f"{diff:.1e}" if name == first_xla and diff is not None else ""])
    return rows


def _cpu_rows(runs: Sequence[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for run in runs:
        case, times = cpu_case(run["config"]), run["times_ms"]
        diffs = run.get("check", {}).get("max_abs_diff", {})
        for key, ms in times.items():
            name = key.removesuffix("_ms")
            jaxrec = times["jaxrec_forward_backward_ms" if "backward" in name else "jaxrec_forward_ms"]
            gbs = f"{run['jaxrec_forward_GB_per_s']:.1f}" if name == "jaxrec_forward" else ""
            diff = diffs.get(name)  # keyed by the peer's name, e.g. "xla_forward"
            rows.append([case, name, f"{ms:.2f}", gbs, "" if name.startswith("jaxrec") else f"{ms / jaxrec:.2f}x",
                         f"{diff:.1e}" if diff is not None else ""])
    return rows


def _format(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows)]
    left = {0, 1}  # text columns; numbers are right-aligned

    def line(cells):
        return "  ".join(f"{c:<{w}}" if i in left else f"{c:>{w}}"
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])
