"""Does ``jaxrec train --data movielens:FILE`` with its defaults beat the simple baselines?

    python benchmarks/movielens_defaults.py --out benchmarks/results/movielens_defaults_cpu.json

Writes MovieLens-100K-like ratings files (``u.data`` format; 943 users, 1,682 items,
long-tailed popularity, user and item biases, rank-8 taste, Gaussian noise, ratings
rounded to 1..5), then on the CLI's own 90/10 split compares the test RMSE of the
default run (the model of its best validation evaluation; the run holds out 10% of its
90% for validation) with: the global mean; regularised user and item biases (alternating
least squares, lambda 5 and 10); a biased ALS factorisation (rank 8, lambda 10); and the
noise-free truth (the floor). The baselines have fixed hyperparameters and no early
stopping, so they train on all of the 90% (the default run's validation ratings
included). The real MovieLens-100K cannot be downloaded here; its published figures are
about 0.94 (biases) and 0.91 (tuned MF). ``--flags "--patience 5"`` adds flags to the
default run (to compare settings).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import numpy as np

# name -> (users, items, ratings drawn, every user's minimum, seed)
FILES = {"ml100k_like": (943, 1682, 100_000, 20, 0),
         "fewer_ratings": (943, 1682, 60_000, 0, 1),
         "fewer_users_and_items": (400, 600, 30_000, 0, 1)}


class Generated(NamedTuple):
    """What ``generate`` drew: the noise-free rating of each line, in file order, and the
    parameters behind it (0-based ids)."""

    truth: np.ndarray  # [ratings]
    popularity: np.ndarray  # [items], an item's weight in drawing who rated what
    user_bias: np.ndarray
    item_bias: np.ndarray
    user_factors: np.ndarray  # [users, 8]
    item_factors: np.ndarray  # [items, 8]


def generate(path: str, users: int, items: int, n: int, minimum: int, seed: int) -> Generated:
    """Writes the file; returns what it drew."""
    rng = np.random.default_rng(seed)
    activity, popularity = rng.lognormal(0, 1.0, users), rng.lognormal(0, 1.3, items)
    base = np.repeat(np.arange(users), minimum)
    who = np.concatenate([base, rng.choice(users, n - len(base), p=activity / activity.sum())])
    what = rng.choice(items, n, p=popularity / popularity.sum())
    pairs = np.unique(np.stack([who, what], 1), axis=0)
    pairs = pairs[rng.permutation(len(pairs))]
    u, i = pairs[:, 0], pairs[:, 1]
    bu, bi = rng.normal(0, 0.4, users), rng.normal(0, 0.5, items)
    p, q = rng.normal(0, 0.5, (users, 8)), rng.normal(0, 0.5, (items, 8))
    truth = 3.53 + bu[u] + bi[i] + 0.6 * np.sum(p[u] * q[i], 1)
    stars = np.clip(np.rint(truth + rng.normal(0, 0.8, len(u))), 1, 5).astype(int)
    with open(path, "w") as f:
        f.writelines(f"{a + 1}\t{b + 1}\t{c}\t{874965758 + k}\n"
                     for k, (a, b, c) in enumerate(zip(u, i, stars)))
    return Generated(truth, popularity, bu, bi, p, q)


def cli_split(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The train and test rows of ``jaxrec train`` on a ratings file (its 90/10 split)."""
    order = np.random.default_rng(seed).permutation(n)
    cut = n - max(n // 10, 1)
    return order[:cut], order[cut:]


def als(u, i, r, tr, te, rank: int, lam: float, iters: int = 12) -> float:
    """Held-out RMSE of biased ALS (rank 0: biases only), predictions clipped to 1..5."""
    mu, users, items = r[tr].mean(), u.max() + 1, i.max() + 1
    rng = np.random.default_rng(0)
    sides = [[np.zeros(users), rng.normal(0, 0.1, (users, rank)), u[tr]],
             [np.zeros(items), rng.normal(0, 0.1, (items, rank)), i[tr]]]
    for _ in range(iters):
        for me, other in ((0, 1), (1, 0)):
            bias, factors, ids = sides[me]
            o_bias, o_factors, o_ids = sides[other]
            residual = r[tr] - mu - o_bias[o_ids]
            for k in np.unique(ids):
                rows = ids == k
                x = np.concatenate([o_factors[o_ids[rows]], np.ones((rows.sum(), 1))], 1)
                solution = np.linalg.solve(x.T @ x + lam * np.eye(rank + 1), x.T @ residual[rows])
                factors[k], bias[k] = solution[:rank], solution[rank]
    (bu, p, _), (bi, q, _) = sides
    pred = np.clip(mu + bu[u[te]] + bi[i[te]] + np.sum(p[u[te]] * q[i[te]], 1), 1, 5)
    return float(np.sqrt(np.mean((pred - r[te]) ** 2)))


def train_cli(path: str, out_dir: str, flags: list[str]) -> tuple[dict, float]:
    """``jaxrec train --data movielens:path`` with ``flags``: its metrics.json record, and
    the seconds it took."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "jaxrec", "train", "--data", f"movielens:{path}",
                    "--out-dir", out_dir, *flags], check=True, capture_output=True)
    with open(os.path.join(out_dir, "metrics.json")) as f:
        return json.load(f), round(time.perf_counter() - start, 1)


def write_results(results: dict, out: str) -> None:
    """``results`` with the date and the environment, as JSON at ``out``."""
    import jax

    import jaxrec
    results.update(date=time.strftime("%Y-%m-%d"), jax=jax.__version__, jaxrec=jaxrec.__version__,
                   device=jax.devices()[0].device_kind, cpu_count=os.cpu_count())
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


def default_run(path: str, out_dir: str, flags: list[str]) -> dict:
    record, seconds = train_cli(path, out_dir, flags)
    return {"test_rmse": record["final"]["rmse"], "tested_step": record["test"]["step"],
            "best_val_rmse": record["best"]["rmse"], "best_step": record["best"]["step"],
            "steps": record["steps"], "early_stop": record["early_stop"],
            "weight_decay": record["config"]["weight_decay"],
            "val_fraction": record["config"]["val_fraction"],
            "patience": record["config"]["patience"], "flags": flags, "seconds": seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--flags", default="", help="extra jaxrec train flags, e.g. '--patience 5'")
    args = p.parse_args(argv)
    results = {"benchmark": "movielens_defaults", "files": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in FILES.items():
            path = os.path.join(tmp, f"{name}.data")
            truth = generate(path, *spec).truth
            data = np.loadtxt(path, dtype=np.int64)
            u, i, r = data[:, 0], data[:, 1], data[:, 2].astype(float)
            tr, te = cli_split(len(r))
            run = default_run(path, os.path.join(tmp, name), args.flags.split())
            row = {"ratings": len(r), "jaxrec_default": run,
                   "global_mean": float(np.sqrt(np.mean((r[tr].mean() - r[te]) ** 2))),
                   "biases_lambda5": als(u, i, r, tr, te, 0, 5.0),
                   "biases_lambda10": als(u, i, r, tr, te, 0, 10.0),
                   "als_rank8_lambda10": als(u, i, r, tr, te, 8, 10.0),
                   "noise_free_truth": float(np.sqrt(np.mean((np.clip(truth[te], 1, 5) - r[te]) ** 2)))}
            results["files"][name] = row
            print(name, json.dumps(row), flush=True)
    write_results(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
