"""MovieLens side features: the users' and the movies' fields, as categorical ids.

Read from the files beside the ratings (``load_movielens_side_features(directory)``)::

    ML-100K  u.user    1|24|M|technician|85711                 id|age|gender|occupation|zip
             u.item    1|Toy Story (1995)|01-Jan-1995||URL|0|0|1|...   id|title|date|video|url|19 genre flags
    ML-1M    users.dat 1::F::1::10::48067                      id::gender::age group::occupation::zip
             movies.dat 1::Toy Story (1995)::Animation|Children's|Comedy   id::title::genres

Features (each a table of its own in a model; ids are dense indices into its vocabulary):

* ``user_age``: ML-1M's seven age groups (under 18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+);
  ML-100K's ages are put into the same groups.
* ``user_gender``, ``user_occupation``: the distinct values of the file, sorted.
* ``item_genres``: a bag of the movie's genres (several ids per movie; none for a movie
  without one), vocabulary the genre names of the file.
* ``item_decade``: the decade of the release year (ML-100K: the release date, else the
  title's ``(1995)``; ML-1M: the title's); none when there is no year.

Decisions: the zip code and the title's words are left out (a zip is nearly an id of its
own; words need a tokenizer); ML-10M and later have no user file and are not read here
(a ``FileNotFoundError`` says which files are needed). A user or movie of the ratings
without a line here gets no side ids (empty bags): the ratings decide who exists.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxrec.data._batch import DataFormatError

MOVIELENS_USER_FEATURES = ("user_age", "user_gender", "user_occupation")
MOVIELENS_ITEM_FEATURES = ("item_genres", "item_decade")
_AGE_GROUPS = (18, 25, 35, 45, 50, 56)  # ML-1M's groups start at 1, 18, 25, 35, 45, 50, 56
_ML100K_GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
                  "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
                  "Romance", "Sci-Fi", "Thriller", "War", "Western")
_YEAR = re.compile(r"\((\d{4})\)\s*$")


class MovieLensSideFeatures(NamedTuple):
    """Side ids per raw user and item id.

    ``user_ids`` / ``item_ids``: int64 raw ids (sorted). ``columns``: feature name -> int64
    ``[n, slots]`` ids (users' features over ``user_ids``, items' over ``item_ids``; -1 = no
    id; ``item_genres`` has as many slots as the most genres of one movie, the others one).
    ``sizes``: feature name -> vocabulary size (table rows). ``vocabularies``: feature name
    -> the value of each id, to read a model's tables.
    """

    user_ids: np.ndarray
    item_ids: np.ndarray
    columns: dict[str, np.ndarray]
    sizes: dict[str, int]
    vocabularies: dict[str, tuple]


def load_movielens_side_features(directory: str | os.PathLike) -> MovieLensSideFeatures:
    """The side features of the MovieLens set in ``directory`` (ML-100K's ``u.user`` and
    ``u.item``, or ML-1M's ``users.dat`` and ``movies.dat``; see the module doc)."""
    d = Path(directory)
    if (d / "u.user").is_file() and (d / "u.item").is_file():
        users, items = _read_users(d / "u.user", "|", 1, 2, 3), _read_100k_items(d / "u.item")
    elif (d / "users.dat").is_file() and (d / "movies.dat").is_file():
        users, items = _read_users(d / "users.dat", "::", 2, 1, 3), _read_1m_items(d / "movies.dat")
    else:
        raise FileNotFoundError(
            f"no MovieLens side features in {d}: it needs u.user and u.item (ML-100K) or "
            "users.dat and movies.dat (ML-1M) beside the ratings; later sets (ML-10M on) have "
            "no user file. Train without --side-features, or point --data at such a folder.")
    user_ids, ages, genders, occupations = users
    item_ids, genres, years = items
    columns, sizes, vocabularies = {}, {}, {}

    def add(name, values, vocabulary=None):  # values: per entity, a list of raw values
        vocab = tuple(sorted({v for vs in values for v in vs})) if vocabulary is None else vocabulary
        index = {v: i for i, v in enumerate(vocab)}
        slots = max(1, max((len(vs) for vs in values), default=1))
        out = np.full((len(values), slots), -1, np.int64)
        for row, vs in enumerate(values):
            out[row, :len(vs)] = [index[v] for v in vs]
        columns[name], sizes[name], vocabularies[name] = out, max(1, len(vocab)), vocab

    add("user_age", [[int(np.searchsorted(_AGE_GROUPS, a, side="right"))] for a in ages],
        vocabulary=tuple(range(len(_AGE_GROUPS) + 1)))
    add("user_gender", [[g] for g in genders])
    add("user_occupation", [[o] for o in occupations])
    add("item_genres", genres)
    add("item_decade", [[] if y is None else [y // 10 * 10] for y in years])
    return MovieLensSideFeatures(user_ids, item_ids, columns, sizes, vocabularies)


def _lines(path: Path, sep: str, fields: int) -> list[tuple[int, list[str]]]:
    """(line number, fields) of each non-blank line; a line with the wrong field count is a
    ``DataFormatError`` naming it. MovieLens files are latin-1."""
    out = []
    for number, line in enumerate(path.read_bytes().decode("latin-1").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split(sep)
        if len(parts) != fields:
            raise DataFormatError(f"{path}, line {number}: expected {fields} fields separated by "
                                  f"{sep!r}, found {len(parts)}: {line[:80]!r}")
        out.append((number, parts))
    if not out:
        raise DataFormatError(f"{path} holds no lines")
    return out


def _int(path: Path, number: int, name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise DataFormatError(f"{path}, line {number}, field {name}: {text!r} is not an "
                              "integer") from None


def _sorted(path: Path, ids: list[int], *columns: list) -> tuple:
    """``ids`` sorted, and each column in that order; a repeated id is an error."""
    order = np.argsort(np.asarray(ids, np.int64), kind="stable")
    ids = np.asarray(ids, np.int64)[order]
    if np.unique(ids).size != ids.size:
        raise DataFormatError(f"{path}: id {int(ids[np.argmax(ids[1:] == ids[:-1])])} has more "
                              "than one line; keep one")
    return (ids, *([c[i] for i in order] for c in columns))


def _read_users(path: Path, sep: str, age: int, gender: int, occupation: int):
    """A users file of 5 fields: id first, then age, gender and occupation at these fields."""
    rows = _lines(path, sep, 5)
    ids = [_int(path, n, "user", p[0]) for n, p in rows]
    ages = [_int(path, n, "age", p[age]) for n, p in rows]
    return _sorted(path, ids, ages, [p[gender].strip() for _, p in rows],
                   [p[occupation].strip() for _, p in rows])


def _read_100k_items(path: Path):
    rows = _lines(path, "|", 5 + len(_ML100K_GENRES))
    ids = [_int(path, n, "item", p[0]) for n, p in rows]
    genres = [[g for g, flag in zip(_ML100K_GENRES, p[5:]) if flag.strip() == "1"] for _, p in rows]
    years = [_year(p[2][-4:] if p[2].strip() else "", p[1]) for _, p in rows]
    return _sorted(path, ids, genres, years)


def _read_1m_items(path: Path):
    rows = _lines(path, "::", 3)
    ids = [_int(path, n, "item", p[0]) for n, p in rows]
    genres = [[g for g in p[2].strip().split("|") if g and g != "(no genres listed)"] for _, p in rows]
    years = [_year("", p[1]) for _, p in rows]
    return _sorted(path, ids, genres, years)


def _year(date_year: str, title: str) -> int | None:
    """The release year: the date's, else the title's trailing ``(1995)``, else None."""
    if date_year.isdigit():
        return int(date_year)
    found = _YEAR.search(title.strip())
    return int(found.group(1)) if found else None
