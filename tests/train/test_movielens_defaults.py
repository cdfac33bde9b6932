"""The default ``jaxrec train --data movielens:FILE`` beats the bias baseline.

The file is generated here: 600 users, 900 items, about 40,000 ratings drawn by activity
and popularity, each ``3.5 + b_u + b_i + <p_u, q_i> + noise`` (rank-8 taste, noise 0.8)
rounded to 1..5 stars. The baseline is the regularised user and item biases (lambda 5,
alternating least squares) fitted on the run's training and validation ratings, tested
on the run's own test split. (On the real MovieLens-100K: benchmarks/movielens_100k.py.)
"""

import json

import numpy as np

from jaxrec import data
from jaxrec.train import TrainConfig, main
from jaxrec.train._tasks import ratings_splits


def generate(path, users: int = 600, items: int = 900, n: int = 40_000, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    activity, popularity = rng.lognormal(0, 0.8, users), rng.lognormal(0, 1.0, items)
    who = rng.choice(users, n, p=activity / activity.sum())
    what = rng.choice(items, n, p=popularity / popularity.sum())
    pairs = np.unique(np.stack([who, what], 1), axis=0)
    u, i = pairs[rng.permutation(len(pairs))].T
    bu, bi = rng.normal(0, 0.4, users), rng.normal(0, 0.5, items)
    p, q = rng.normal(0, 0.5, (users, 8)), rng.normal(0, 0.5, (items, 8))
    truth = 3.5 + bu[u] + bi[i] + np.sum(p[u] * q[i], 1)
    stars = np.clip(np.rint(truth + rng.normal(0, 0.8, len(u))), 1, 5).astype(int)
    path.write_text("".join(f"{a + 1}\t{b + 1}\t{c}\t{k}\n" for k, (a, b, c) in enumerate(zip(u, i, stars))))


def biases_rmse(train: data.MovieLensRatings, test: data.MovieLensRatings, lam: float = 5.0) -> float:
    """Test RMSE of ``mean + b_u + b_i`` (ridge, alternating), clipped to the stars."""
    u, i, r = train.users, train.items, train.ratings.astype(np.float64)
    mu, nu, ni = r.mean(), max(u.max(), test.users.max()) + 1, max(i.max(), test.items.max()) + 1
    bu, bi = np.zeros(nu), np.zeros(ni)
    for _ in range(10):
        bu = np.bincount(u, r - mu - bi[i], nu) / (np.bincount(u, minlength=nu) + lam)
        bi = np.bincount(i, r - mu - bu[u], ni) / (np.bincount(i, minlength=ni) + lam)
    predicted = np.clip(mu + bu[test.users] + bi[test.items], 1, 5)
    return float(np.sqrt(np.mean((predicted - test.ratings) ** 2)))


def test_the_default_run_beats_user_and_item_biases(tmp_path):
    path = tmp_path / "u.data"
    generate(path)
    assert main(["--data", f"movielens:{path}", "--out-dir", str(tmp_path / "out")]) == 0
    record = json.loads((tmp_path / "out" / "metrics.json").read_text())
    train, val, test = ratings_splits(TrainConfig(data=f"movielens:{path}"))
    fitted_on = data.MovieLensRatings(*(np.concatenate(parts) for parts in zip(train, val)))
    baseline = biases_rmse(fitted_on, test)
    assert record["final"]["rmse"] < baseline - 0.02, (record["final"]["rmse"], baseline)
