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


GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary",
          "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller",
          "War", "Western")


def write_side_features(folder: Path, *, users: int, items: int, seed: int = 5) -> None:
    """ML-100K's ``u.user`` and ``u.item`` for user ids 1..users and item ids 1..items:
    random ages, genders, occupations, 0-3 genres and release years."""
    rng = np.random.default_rng(seed)
    jobs = ("artist", "doctor", "engineer", "student", "writer")
    (folder / "u.user").write_text("".join(
        f"{u}|{rng.integers(7, 74)}|{'MF'[rng.integers(2)]}|{jobs[rng.integers(len(jobs))]}|"
        f"{rng.integers(10000, 99999)}\n" for u in range(1, users + 1)))
    lines = []
    for i in range(1, items + 1):
        flags = np.zeros(len(GENRES), int)
        flags[rng.choice(len(GENRES), rng.integers(0, 4), replace=False)] = 1
        year = rng.integers(1930, 1999)
        lines.append(f"{i}|Movie {i} ({year})|01-Jan-{year}||http://x/{i}|" + "|".join(map(str, flags)) + "\n")
    (folder / "u.item").write_text("".join(lines), encoding="latin-1")


def write_click_log(path: Path, n: int, *, users: int, items: int, seed: int = 7) -> Path:
    """``n`` impressions (tab-separated, ids from 1): user u clicks item i when (u + i) % 3
    == 0, else skips it, so the clicks have a pattern to learn; timestamp k."""
    rng = np.random.default_rng(seed)
    u, i = rng.integers(1, users + 1, n), rng.integers(1, items + 1, n)
    clicked = ((u + i) % 3 == 0).astype(int)
    path.write_text("".join(f"{a}\t{b}\t{c}\t{k}\n" for k, (a, b, c) in enumerate(zip(u, i, clicked))))
    return path
