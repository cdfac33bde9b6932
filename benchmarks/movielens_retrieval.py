"""Does ``jaxrec train --data movielens:FILE --task retrieval`` with its defaults beat the
popularity baseline?

    python benchmarks/movielens_retrieval.py --out benchmarks/results/movielens_retrieval_cpu.json

On the MovieLens-100K-like files of ``movielens_defaults.py`` (ratings of 4 and 5 stars
are the positives), compares the test Recall@10 / NDCG@10 / HitRate@10 / MRR@10 of the
default retrieval run (its best validation model) with:

- popularity: every user gets the items with the most training positives that it has not
  seen (as the run excludes: its training and validation positives). The run computes it
  with its own evaluation (``popularity_test`` in metrics.json); this script checks it
  against ``jaxrec.metrics.ranking_metrics`` on the full score matrix.
- the generator's truth (a ceiling): items ranked by ``popularity x P(rating >= 4)`` from
  the generator's own parameters. In these files an item's chance to be rated depends on
  its popularity only, not on the user's taste (the taste moves the stars), so no model
  can be far above popularity here.

``--flags "--retrieval-loss bpr"`` adds flags to the run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from movielens_defaults import FILES, generate, train_cli, write_results  # noqa: E402


def truth_scores(drawn) -> np.ndarray:
    """``log popularity + log P(rating >= 4)`` [users, items] from ``generate``'s parameters."""
    truth = (3.53 + drawn.user_bias[:, None] + drawn.item_bias[None, :]
             + 0.6 * drawn.user_factors @ drawn.item_factors.T)
    # A star of 4 or 5 is truth + N(0, 0.8) >= 3.5 (rounding, then the clip at 5).
    z = (truth - 3.5) / (0.8 * math.sqrt(2))
    positive = 0.5 * (1 + np.vectorize(math.erf)(z))
    return np.log(drawn.popularity)[None, :] + np.log(np.maximum(positive, 1e-300))


def held_out(config: dict, path: str):
    """The run's ``HeldOut`` test set and its user / item raw ids (the same code path)."""
    from jaxrec import data
    from jaxrec.train import TrainConfig
    from jaxrec.train._tasks import build_task, ratings_splits

    conf = TrainConfig(**{**config, "tt_ranks": tuple(config["tt_ranks"]), "resume": False,
                          "checkpoint_dir": None})
    users, items = data.movielens_ids(*[p for p in ratings_splits(conf) if p is not None])
    return build_task(conf), users, items


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--flags", default="", help="extra jaxrec train flags")
    args = p.parse_args(argv)
    from jaxrec.metrics import ranking_metrics
    from jaxrec.train._retrieval import evaluate

    results = {"benchmark": "movielens_retrieval", "files": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in FILES.items():
            path = os.path.join(tmp, f"{name}.data")
            drawn = generate(path, *spec)
            record, seconds = train_cli(path, os.path.join(tmp, name),
                                        ["--task", "retrieval", *args.flags.split()])
            task, user_ids, item_ids = held_out(record["config"], path)
            test, k = task.test_batches, record["config"]["top_k"]
            # Popularity by ranking_metrics on the full matrix (an independent check); the
            # validation set excludes exactly the training positives.
            counts = np.bincount(task.val_batches.exclude % test.num_items,
                                 minlength=test.num_items).astype(np.float64)
            relevant = np.zeros((len(user_ids), test.num_items), bool)
            exclude = np.zeros_like(relevant)
            relevant.flat[test.relevant] = True
            exclude.flat[test.exclude] = True
            row = {"positives": {s: record["data"][f"{s}_positives"] for s in ("train", "val", "test")},
                   "jaxrec_default": {**record["final"], "tested_step": record["test"]["step"],
                                      "steps": record["steps"],
                                      "early_stop": record["early_stop"], "flags": args.flags,
                                      "seconds": seconds},
                   "popularity": record["data"]["popularity_test"]}
            row["popularity_by_ranking_metrics"] = ranking_metrics(
                np.broadcast_to(counts, relevant.shape), relevant, k, exclude=exclude)
            truth = truth_scores(drawn)[np.ix_(user_ids - 1, item_ids - 1)]
            row["generator_truth"] = evaluate(np.eye(len(user_ids), dtype=np.float32),
                                              truth.T.astype(np.float32), test, k)
            results["files"][name] = row
            print(name, json.dumps(row), flush=True)
    write_results(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
