"""Held-out AUC of ``jaxrec train --vocab dynamic`` vs modulo hashing at equal rows, on
Criteo-format data.

    python benchmarks/dynamic_vocab_auc.py --out benchmarks/results/dynamic_vocab_auc_cpu.json

The data: the main job's synthetic click log (``jaxrec.data.SyntheticClickLog``) at
Criteo Kaggle's cardinalities, uncapped (up to 10M values a feature, Zipf 1.1, ids
scattered over each feature as hashing scatters them), written as a Criteo TSV file:
13 integer counts, and per feature the id as an 8-hex-digit value (a bijection of the
32-bit values, different per feature, so half of them are 2**31 or more as in Criteo).
Labels come from the log's teacher, which gives every value an embedding of its own, so
two values that share a row do lose information. The file's first ``--eval-batches``
batches are the test set, the next as many the validation set (the CLI's split), the
rest is trained on once (``--epochs 1``).

Each ``--max-rows`` and model ``--seeds`` (the data stays the same) is run twice with the
CLI's default model (DLRM, D=16, fused rowwise
Adagrad 0.1 for the tables, Adam 3e-3, batches of 1024, everything else its default):
``--vocab modulo`` (each value hashed, value % rows) and ``--vocab dynamic`` (each value
its own id in a dynamic table of the same rows rounded down to buckets of 128; LRU). The
rows are chosen below the distinct values of the big features, so that modulo hashing
collides there. Reported per run: the test AUC and log loss of the best validation model,
the dynamic tables' statistics (the test ids they did not hold), the wall time; and per
rows, the AUC of dynamic minus modulo for each seed and on average.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxrec.benchmark._environment import cpu_model, environment
from jaxrec.benchmark._report import write_json
from jaxrec.data import CRITEO_KAGGLE_CARDINALITIES, SyntheticClickLog
from jaxrec.train import TrainConfig, train

_CHUNK = 16384  # samples drawn and written at a time


def write_criteo_tsv(path: Path, log: SyntheticClickLog, rows: int) -> np.ndarray:
    """Writes ``rows`` samples of ``log`` (one id per feature) as Criteo TSV lines; returns
    the values, uint32 [rows, 26]."""
    salts = np.random.default_rng(12345).integers(0, 2**32, size=(2, 26), dtype=np.uint64)
    multipliers, offsets = salts[0] | np.uint64(1), salts[1]  # odd: a bijection mod 2**32
    values = np.zeros((rows, 26), np.uint32)
    with open(path, "w") as f:
        for start in range(0, rows, _CHUNK):
            n = min(_CHUNK, rows - start)
            s = log.sample(n, index=start // _CHUNK)
            ids = s.values.reshape(26, n).T.astype(np.uint64)  # fixed bags of one id
            hashed = (ids * multipliers + offsets) & np.uint64(0xFFFFFFFF)
            values[start:start + n] = hashed
            counts = np.rint(np.expm1(s.dense.astype(np.float64))).astype(np.int64)  # the log's raw counts
            hexes = np.char.mod("%08x", hashed)
            f.writelines("\t".join([str(int(label)), *map(str, dense), *cats]) + "\n"
                         for label, dense, cats in zip(s.labels, counts.tolist(), hexes.tolist()))
    return values


def auc_standard_error(auc: float, positives: int, negatives: int) -> float:
    """Hanley & McNeil's standard error of an AUC."""
    q1, q2 = auc / (2 - auc), 2 * auc**2 / (1 + auc)
    var = (auc * (1 - auc) + (positives - 1) * (q1 - auc**2) + (negatives - 1) * (q2 - auc**2))
    return math.sqrt(var / (positives * negatives))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--train-rows", type=int, default=204_800)
    parser.add_argument("--eval-batches", type=int, default=16, help="of 1024: test, and as many validation")
    parser.add_argument("--max-rows", default="2048,16384", help="comma-separated rows per table to compare at")
    parser.add_argument("--seeds", default="0,1", help="comma-separated model seeds (TrainConfig.seed)")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--note", help="stored in the result, e.g. which commit ran")
    args = parser.parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",")]
    base = TrainConfig(data="criteo:day_0", steps=None, epochs=1,  # day_0: the file written below
                       eval_batches=args.eval_batches)
    held_out = 2 * args.eval_batches * base.batch_size
    log = SyntheticClickLog(num_embeddings_per_feature=CRITEO_KAGGLE_CARDINALITIES, scatter_ids=True,
                            seed=args.data_seed)
    result = environment("dynamic_vocab_auc", cpu_model(), {}, {})
    result["note"] = args.note
    result["config"] = dataclasses.asdict(base) | {"out_dir": None, "seed": seeds}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "day_0"
        start = time.perf_counter()
        values = write_criteo_tsv(path, log, held_out + args.train_rows)
        train_values = values[held_out:]
        test_labels = log_labels(path, args.eval_batches * base.batch_size)
        distinct = [len(np.unique(train_values[:, j])) for j in range(26)]
        result["data"] = {
            "source": "jaxrec.data.SyntheticClickLog(num_embeddings_per_feature=CRITEO_KAGGLE_CARDINALITIES, "
                      f"scatter_ids=True, seed={args.data_seed}) written as a Criteo TSV file (8 hex digits a value)",
            "rows": len(values), "test_rows": held_out // 2, "validation_rows": held_out // 2,
            "train_rows": args.train_rows, "train_distinct_values_per_feature": distinct,
            "test_positives": int(test_labels.sum()), "teacher_auc": log.teacher_auc(),
            "seconds_to_write": time.perf_counter() - start,
        }
        print("data", result["data"], flush=True)
        for rows in (int(r) for r in args.max_rows.split(",")):
            sizes = [min(n, rows) for n in CRITEO_KAGGLE_CARDINALITIES]
            for seed, vocab in itertools.product(seeds, ("modulo", "dynamic")):
                config = dataclasses.replace(base, data=f"criteo:{path}", max_rows=rows, vocab=vocab, seed=seed,
                                             out_dir=str(Path(tmp) / f"{vocab}_{rows}_{seed}"))
                start = time.perf_counter()
                record = train(config)
                run = {"max_rows": rows, "vocab": vocab, "seed": seed, "steps": record["steps"],
                       "final": record["final"], "test_step": record["test"]["step"],
                       "auc_standard_error": auc_standard_error(
                           record["final"]["auc"], int(test_labels.sum()), int((1 - test_labels).sum())),
                       "table_rows": sum(record["data"]["table_sizes"]),
                       "features_with_more_values_than_rows": sum(d > s for d, s in zip(distinct, sizes)),
                       "train_samples_per_s": record["train_samples_per_s"],
                       "seconds": time.perf_counter() - start,
                       "dynamic_vocab": record["dynamic_vocab"] and {
                           k: v for k, v in record["dynamic_vocab"].items() if k != "tables"}}
                runs.append(run)
                print(run, flush=True)
    result["runs"] = runs
    result["summary"] = summary(runs)
    print("summary:", result["summary"])
    write_json(args.out, result)
    return 0


def summary(runs: list[dict]) -> dict[str, dict]:
    """Per rows: the mean test AUC and log loss of each vocab, and dynamic's AUC minus
    modulo's per seed (the same data, the same model seed) and on average."""
    out = {}
    for rows in sorted({r["max_rows"] for r in runs}):
        mine = {(r["vocab"], r["seed"]): r["final"] for r in runs if r["max_rows"] == rows}
        seeds = sorted({seed for _, seed in mine})
        diffs = [mine["dynamic", s]["auc"] - mine["modulo", s]["auc"] for s in seeds]
        out[str(rows)] = {
            **{f"{vocab}_{metric}": float(np.mean([mine[vocab, s][metric] for s in seeds]))
               for vocab in ("modulo", "dynamic") for metric in ("auc", "log_loss")},
            "auc_dynamic_minus_modulo": dict(zip(map(str, seeds), diffs)),
            "auc_dynamic_minus_modulo_mean": float(np.mean(diffs))}
    return out


def log_labels(path: Path, rows: int) -> np.ndarray:
    """The labels of the file's first ``rows`` lines (the test set)."""
    with open(path) as f:
        return np.array([float(next(f).split("\t", 1)[0]) for _ in range(rows)])


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    sys.exit(main())
