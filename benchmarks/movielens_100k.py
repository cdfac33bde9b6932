"""``jaxrec train`` with its defaults on the real MovieLens-100K.

    python benchmarks/movielens_100k.py ML100K_FOLDER --out benchmarks/results/movielens_100k_cpu.json

``ML100K_FOLDER`` holds GroupLens' ``u.data``, ``u.user`` and ``u.item`` (grouplens.org's
ml-100k.zip; this repository does not ship the data). Measured:

* **Ratings** on five 80/20 random splits (by seeds 1..5, written as ``u1.base`` /
  ``u1.test`` into a scratch folder, which the CLI's folder form reads): the test RMSE
  of the default run (``jaxrec train --data movielens:FOLDER``: biased MF, the model of
  its best validation evaluation, validation 10% of the 80%) against the global mean,
  regularised user and item biases and a biased ALS factorisation (rank 8), fitted on
  the whole 80% (``movielens_defaults.als``). Published figures for these splits: about
  0.94 for the biases, 0.91 for tuned MF / SVD++.
* **Retrieval** (``--task retrieval`` on ``u.data``: ratings of 4 or 5 stars are positives,
  the CLI's 90/10 split): Recall@10, NDCG@10, HitRate@10 and MRR@10 of the default run
  (MF over the ids), with ``--side-features`` (users' and movies' fields), and with
  ``--model two_tower --side-features``, against the popularity baseline.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from movielens_defaults import als, train_cli, write_results  # noqa: E402

SPLITS = (1, 2, 3, 4, 5)
RETRIEVAL = {"mf": [], "mf_side_features": ["--side-features"],
             "two_tower_side_features": ["--model", "two_tower", "--side-features"]}


def split_folder(lines: list[str], seed: int, folder: str) -> tuple[np.ndarray, np.ndarray]:
    """Writes an 80/20 random split of ``lines`` as ``folder/u1.base`` and ``u1.test``;
    returns the train and test line numbers."""
    order = np.random.default_rng(seed).permutation(len(lines))
    cut = int(0.8 * len(lines))
    train, test = np.sort(order[:cut]), np.sort(order[cut:])
    for name, rows in (("u1.base", train), ("u1.test", test)):
        with open(os.path.join(folder, name), "w") as f:
            f.writelines(lines[k] for k in rows)
    return train, test


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", help="the ml-100k folder (u.data, u.user, u.item)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    with open(os.path.join(args.folder, "u.data")) as f:
        lines = f.readlines()
    table = np.loadtxt(lines, dtype=np.int64)
    u, i, r = table[:, 0], table[:, 1], table[:, 2].astype(float)
    results = {"benchmark": "movielens_100k", "ratings": len(lines), "splits": {}, "retrieval": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in SPLITS:
            folder = os.path.join(tmp, f"split{seed}")
            os.makedirs(folder)
            tr, te = split_folder(lines, seed, folder)
            record, seconds = train_cli(folder, os.path.join(tmp, f"run{seed}"), [])
            row = {"jaxrec_default_test_rmse": record["final"]["rmse"],
                   "tested_step": record["test"]["step"], "seconds": seconds,
                   "global_mean": float(np.sqrt(np.mean((r[tr].mean() - r[te]) ** 2))),
                   "biases_lambda5": als(u, i, r, tr, te, 0, 5.0),
                   "biases_lambda10": als(u, i, r, tr, te, 0, 10.0),
                   "als_rank8_lambda10": als(u, i, r, tr, te, 8, 10.0)}
            results["splits"][seed] = row
            print("split", seed, row, flush=True)
        runs = results["splits"].values()
        results["mean_over_splits"] = {k: float(np.mean([row[k] for row in runs]))
                                       for k in next(iter(runs)) if k != "tested_step"}
        path = os.path.join(args.folder, "u.data")
        for name, flags in RETRIEVAL.items():
            record, seconds = train_cli(path, os.path.join(tmp, name), ["--task", "retrieval", *flags])
            results["retrieval"][name] = {"test": record["final"], "tested_step": record["test"]["step"],
                                          "seconds": seconds, "flags": flags}
            results["retrieval"]["popularity"] = record["data"]["popularity_test"]
            print(name, results["retrieval"][name], flush=True)
    write_results(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
