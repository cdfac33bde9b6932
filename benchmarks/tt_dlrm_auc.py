"""DLRM with TT tables vs dense tables on the main job's synthetic click log: AUC and memory.

    python benchmarks/tt_dlrm_auc.py --out benchmarks/results/tt_dlrm_auc_<device>.json
    python benchmarks/tt_dlrm_auc.py --max-rows 1000000 --tt-min-rows 100000 \
        --ranks "8,8;16,16;32,32" --out benchmarks/results/tt_dlrm_auc_1m_<device>.json

Each variant is ``jaxrec train`` (``jaxrec.train.train``) with the main job's defaults
(DLRM, 26 tables capped at ``--max-rows`` rows, default 20,000, D=16, 2500 steps of
1024, fused rowwise Adagrad for dense tables, Adam for the MLPs) and one change: the
tables of at least
``--tt-min-rows`` rows are TT-compressed with the given ranks (fused Adagrad on their
cores, at the same learning rate). The held-out set is 32 batches (32,768 samples:
the AUC's standard error is about 0.002), the same for every variant. Reported per
variant: final held-out AUC and log loss, AUC minus the dense model's, the floats of
the TT-compressed tables (dense vs cores) and of all tables, and the wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time

import jax

from jaxrec.benchmark._environment import environment
from jaxrec.benchmark._report import write_json
from jaxrec.train import TrainConfig, train


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--ranks", default="8,8;16,16", help="';'-separated rank lists to try")
    parser.add_argument("--max-rows", type=int, default=TrainConfig.max_rows)
    parser.add_argument("--tt-min-rows", type=int, default=10_000)
    parser.add_argument("--eval-batches", type=int, default=32)
    args = parser.parse_args(argv)
    base = TrainConfig(steps=args.steps, eval_batches=args.eval_batches, max_rows=args.max_rows,
                       eval_every=max(args.steps // 5, 1), tt_min_rows=args.tt_min_rows)
    variants = {"dense": ()} | {f"tt_{r.replace(',', 'x')}": tuple(int(x) for x in r.split(","))
                                for r in args.ranks.split(";") if r}
    result = environment("tt_dlrm_auc", jax.devices()[0].device_kind, {}, {})
    result["config"] = dataclasses.asdict(base) | {"out_dir": None}
    runs = {}
    for name, ranks in variants.items():
        with tempfile.TemporaryDirectory() as out_dir:
            start = time.perf_counter()
            record = train(dataclasses.replace(base, tt_ranks=ranks, out_dir=out_dir))
            seconds = time.perf_counter() - start
        memory = record["data"]["table_memory"]
        runs[name] = dict(tt_ranks=list(ranks), final=record["final"], seconds=seconds,
                          table_memory=memory,
                          tt_tables_compression=(memory["tt_tables_dense_floats"]
                                                 / max(memory["tt_tables_stored_floats"], 1)),
                          all_tables_compression=memory["dense_floats"] / memory["stored_floats"])
        print(name, runs[name], flush=True)
    dense_auc = runs["dense"]["final"]["auc"]
    for run in runs.values():
        run["auc_minus_dense"] = run["final"]["auc"] - dense_auc
    result["runs"] = runs
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
