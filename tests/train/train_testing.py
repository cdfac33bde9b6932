"""Helpers shared by the tests of ``jaxrec train``."""

from pathlib import Path

import numpy as np


def write_ratings(path: Path, n: int, *, users: int, items: int, seed: int = 3) -> Path:
    """``n`` random MovieLens ratings (tab-separated, ids from 1) of ``users`` users and
    ``items`` items; rating ``k`` has timestamp ``k``, which names it in every split."""
    rng = np.random.default_rng(seed)
    u, i, stars = rng.integers(1, users + 1, n), rng.integers(1, items + 1, n), rng.integers(1, 6, n)
    path.write_text("".join(f"{a}\t{b}\t{r}\t{k}\n" for k, (a, b, r) in enumerate(zip(u, i, stars))))
    return path
