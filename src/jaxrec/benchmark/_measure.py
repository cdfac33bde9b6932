"""How the benchmarks measure: the id sets they rotate, the timing loops, the bytes moved.

* GPU (:func:`timed`): median of 5 repeats of `iters` back-to-back calls after a
  warm-up; asynchronous dispatch keeps the device busy and the host waits once per
  repeat, so launch overhead hides behind the kernels as it does in training.
* GPU, several cases side by side (:func:`interleaved_timed`; named and warmed up:
  :func:`interleaved_by_name`): the same back-to-back repeats, each case in turn, round
  after round, so that a drift of the machine's speed touches every case alike.
* CPU (:func:`interleaved_medians`): the peers run round-robin, one blocking call
  each in turn, so that they share whatever else the machine is doing; median per peer.

Both rotate among :data:`NUM_ID_SETS` pre-generated id sets, so that no two
consecutive calls look up the same rows.

Bytes are counted as FBGEMM's benchmark counts them (:func:`lookup_bytes`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

NUM_ID_SETS = 4
"""Id sets generated per case; the timed calls rotate among them."""


def timed(fn: Callable[..., Any], arg_sets: Sequence[tuple], iters: int,
          sync: Callable[[Any], Any]) -> float:
    """Seconds per call of `fn`: median of 5 repeats of `iters` back-to-back calls.

    Call i takes ``arg_sets[i % len(arg_sets)]``; ``sync(out)`` waits for the device
    (``jax.block_until_ready``, or ``torch.cuda.synchronize`` for PyTorch).
    """
    sync(fn(*arg_sets[0]))
    for i in range(3):
        sync(fn(*arg_sets[i % len(arg_sets)]))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for i in range(iters):
            out = fn(*arg_sets[i % len(arg_sets)])
        sync(out)
        times.append((time.perf_counter() - start) / iters)
    return statistics.median(times)


def interleaved_medians(steps: dict[str, Callable[[int], Any]], num_inputs: int, iters: int,
                        warmup: int = 3) -> dict[str, float]:
    """steps: {name: fn(i)} (fn runs with id set i and blocks until done).

    The peers run round-robin, one iteration each in turn, so that they share whatever
    else the machine is doing; returns {name: median ms}.
    """
    for i in range(warmup):
        for fn in steps.values():
            fn(i % num_inputs)
    times = {name: [] for name in steps}
    for i in range(iters):
        for name, fn in steps.items():
            start = time.perf_counter()
            fn(i % num_inputs)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def interleaved_timed(cases: Sequence[tuple[Callable[[Any], Any], Sequence[Any]]], iters: int,
                      rounds: int, sync: Callable[[Any], Any]) -> tuple[list[float], list[float]]:
    """Seconds per call of each ``(fn, args)`` case, and the host's seconds per call (until
    the last call of a repeat returns, before ``sync`` waits for the device).

    Each round runs ``iters`` back-to-back calls ``fn(args[i % len(args)])`` of every case,
    in an order rotated round by round; the median over the rounds. Warm the cases up
    first (compiles excluded).
    """
    steps, hosts = [[] for _ in cases], [[] for _ in cases]
    for r in range(rounds):
        for k in [(r + j) % len(cases) for j in range(len(cases))]:
            fn, args = cases[k]
            start = time.perf_counter()
            for i in range(iters):
                out = fn(args[i % len(args)])
            hosts[k].append(time.perf_counter() - start)
            sync(out)
            steps[k].append(time.perf_counter() - start)
    median = lambda xs: [statistics.median(x) / iters for x in xs]
    return median(steps), median(hosts)


def interleaved_by_name(cases: dict[str, tuple[Callable[[Any], Any], Sequence[Any]]], iters: int,
                        rounds: int, sync: Callable[[Any], Any]) -> dict[str, float]:
    """:func:`interleaved_timed` of named ``{name: (fn, args)}`` cases, each first called
    once on every ``args`` (compiles and warm-up); ``{name: seconds per call}``."""
    for fn, args in cases.values():
        for a in args:
            sync(fn(a))
    seconds, _ = interleaved_timed(list(cases.values()), iters, rounds, sync)
    return dict(zip(cases, seconds))


def lookup_bytes(batch: int, dims: Sequence[int], ids_per_feature: Sequence[int], *,
                 weight_bytes: int = 4, output_bytes: int = 4):
    """Bytes a pooled lookup moves, as FBGEMM counts them.

    ``output_bytes * B * sum(D) + weight_bytes * sum_f(ids_f * D_f)``: the pooled output
    written once, one row read per id looked up (for fixed bags of L ids, ids_f = B * L).
    Returns an int when every argument is one.
    """
    if len(dims) != len(ids_per_feature):
        raise ValueError(f"dims has {len(dims)} features but ids_per_feature has "
                         f"{len(ids_per_feature)}; give one count of ids per feature")
    return output_bytes * batch * sum(dims) + weight_bytes * sum(n * d for n, d in zip(ids_per_feature, dims))
