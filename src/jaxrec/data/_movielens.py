"""MovieLens ratings (GroupLens) -> ``Batch`` es with a KJT of ``user_id`` and ``item_id``.

Formats, detected from the first non-blank line of the file::

    ML-100K  u.data, u1.base .. u5.test, ua/ub.base/.test   196\\t242\\t3\\t881250949
    ML-1M / ML-10M  ratings.dat                             1::1193::5::978300760
    ML-20M / 25M / latest  ratings.csv (header skipped)     1,296,5.0,1147880044

Each line is ``user, item, rating, timestamp``. ML-10M and the CSV files have half-star
ratings (``4.5``), hence float32 ratings everywhere.

Decisions:

* **Loaded, not streamed**: the largest of these files (ML-25M) has 25M lines, ~650 MB;
  ``load_movielens_ratings`` parses a whole file with NumPy into four arrays.
* **Ids used as they are** in the files (they start at 1, so row 0 of each table is never
  used). Remapping per file would give a base split and its test split different ids for
  one user; raw ids keep every split of one data set in the same rows. Tables need
  ``max id + 1`` rows: ML-100K 944 users x 1683 items, ML-1M 6041 x 3953,
  ML-10M 71568 x 65134. Pass ``num_users`` / ``num_items`` to fix the sizes (then an id
  ``>=`` the size is an error); by default they are the file's ``max id + 1``.
* Batches: ``sparse`` keys ``("user_id", "item_id")``, one id each, capacity ``2 * B``;
  ``labels`` the ratings (float32); ``dense`` float32[B, 0]; ``last_batch`` as in
  ``CriteoReader`` (``"pad"`` with mask 0, or ``"drop"``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxrec.data._batch import Batch
from jaxrec.data._batch import DataFormatError
from jaxrec.data._batch import batch_from_ids
from jaxrec.data._batch import check_batch_size
from jaxrec.data._batch import check_last_batch
from jaxrec.data._batch import rebatch

MOVIELENS_KEYS = ("user_id", "item_id")
MOVIELENS_100K_SPLITS = ("u1", "u2", "u3", "u4", "u5", "ua", "ub")
_FORMATS = {b"::": "ML-1M/10M ratings.dat", b"\t": "ML-100K u.data", b",": "ratings.csv"}


class MovieLensRatings(NamedTuple):
    """All ratings of one file, in file order."""

    users: np.ndarray  # int64[n]
    items: np.ndarray  # int64[n]
    ratings: np.ndarray  # float32[n]
    timestamps: np.ndarray  # int64[n]

    def __len__(self) -> int:  # the number of ratings, not of fields
        return self.users.shape[0]


def movielens_100k_split(directory: str | os.PathLike, split: str) -> tuple[Path, Path]:
    """``(train, test)`` paths of an ML-100K split: ``u1``..``u5`` (5-fold) or ``ua``/``ub``
    (10 ratings per user in test), e.g. ``("ml-100k/u1.base", "ml-100k/u1.test")``."""
    if split not in MOVIELENS_100K_SPLITS:
        raise ValueError(f"split must be one of {MOVIELENS_100K_SPLITS}, got {split!r}.")
    paths = (Path(directory) / f"{split}.base", Path(directory) / f"{split}.test")
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(
                f"MovieLens split file not found: {p}; pass the ml-100k folder that holds "
                f"{split}.base and {split}.test (unzip ml-100k.zip from grouplens.org)."
            )
    return paths


def load_movielens_ratings(path: str | os.PathLike) -> MovieLensRatings:
    """Loads a whole ratings file (format detected; see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"MovieLens ratings file not found: {path}; pass u.data / u1.base (ML-100K), "
            "ratings.dat (ML-1M, ML-10M) or ratings.csv (ML-20M and later)."
        )
    data = path.read_bytes()
    lines = data.splitlines()
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None:
        return _parse_fast([], b"\t")
    sep = next((s for s in _FORMATS if s in lines[first]), None)
    if sep is None:
        raise DataFormatError(
            f"{path}, line {first + 1}: not a MovieLens ratings line "
            f"({lines[first][:60]!r}); expected 'user\\titem\\trating\\ttimestamp' (ML-100K), "
            "'user::item::rating::timestamp' (ratings.dat) or 'userId,movieId,rating,"
            "timestamp' (ratings.csv)."
        )
    start = first
    if sep == b"," and not lines[first].split(b",")[0].strip().isdigit():
        start = first + 1  # the CSV header
    body = lines[start:]
    try:
        return _parse_fast(body, sep)
    except ValueError:
        _raise_first_error(body, sep, path, start + 1)
        raise  # pragma: no cover - _raise_first_error always raises here


def _parse_fast(lines: list[bytes], sep: bytes) -> MovieLensRatings:
    lines = [line for line in lines if line.strip()]
    if not all(line.count(sep) == 3 for line in lines):
        raise ValueError("a line without 4 fields")
    if not lines:
        empty = np.zeros((0,), np.int64)
        return MovieLensRatings(empty, empty, np.zeros((0,), np.float32), empty)
    fields = b"\n".join(lines).replace(sep, b"\n").split(b"\n")
    table = np.array(fields, dtype=np.bytes_).reshape(-1, 4)
    return MovieLensRatings(
        users=table[:, 0].astype(np.int64),
        items=table[:, 1].astype(np.int64),
        ratings=table[:, 2].astype(np.float32),
        timestamps=table[:, 3].astype(np.int64),
    )


def _raise_first_error(lines: list[bytes], sep: bytes, path: Path, first_line: int) -> None:
    """Finds the first malformed line (the slow way) and raises a precise error."""
    names = ("user", "item", "rating", "timestamp")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{path}, line {first_line + i}"
        fields = line.split(sep)
        if len(fields) != 4:
            raise DataFormatError(
                f"{where}: expected 4 fields (user, item, rating, timestamp) separated by "
                f"{sep.decode()!r} ({_FORMATS[sep]}), found {len(fields)}: "
                f"{line[:80].decode('utf-8', 'replace')!r}; fix or remove this line."
            )
        for name, field in zip(names, fields):
            try:
                float(field) if name == "rating" else int(field)
            except ValueError:
                kind = "a number" if name == "rating" else "an integer"
                raise DataFormatError(
                    f"{where}, field {name}: {field.decode('utf-8', 'replace')!r} is not "
                    f"{kind}; fix or remove this line."
                ) from None
    raise DataFormatError(f"{path}: could not parse the ratings; check the file format.")


def _table_size(given: int | None, ids: np.ndarray, name: str, path: str) -> int:
    needed = int(ids.max()) + 1 if ids.size else 1
    if ids.size and ids.min() < 0:
        raise DataFormatError(f"{path}: negative {name} id {int(ids.min())}.")
    if given is None:
        return needed
    if given < needed:
        raise ValueError(
            f"{path} has {name} id {needed - 1} but num_{name}s={given}; ids are used as "
            f"they are in the file, so pass num_{name}s>={needed}."
        )
    return int(given)


class MovieLensReader:
    """Iterates over ``Batch`` es of MovieLens ratings, one pass per ``iter()``.

    Args:
      source: a ratings file path, or ``MovieLensRatings`` already loaded.
      batch_size: ratings per batch (B).
      num_users, num_items: table sizes (default: the data's ``max id + 1``); ids are the
        file's own (see the module docstring).
      shuffle_seed: ``None`` keeps file order; an int shuffles (the same order each pass).
      last_batch: ``"pad"`` (pad with mask 0) or ``"drop"`` a partial last batch.
    """

    keys = MOVIELENS_KEYS

    def __init__(
        self,
        source: str | os.PathLike | MovieLensRatings,
        *,
        batch_size: int,
        num_users: int | None = None,
        num_items: int | None = None,
        shuffle_seed: int | None = None,
        last_batch: str = "pad",
    ):
        if isinstance(source, MovieLensRatings):
            self.ratings, name = source, "the ratings"
        else:
            self.ratings, name = load_movielens_ratings(source), str(source)
        self.batch_size = check_batch_size(batch_size)
        self.num_users = _table_size(num_users, self.ratings.users, "user", name)
        self.num_items = _table_size(num_items, self.ratings.items, "item", name)
        self.shuffle_seed = shuffle_seed
        self.last_batch = check_last_batch(last_batch)

    def __len__(self) -> int:
        """Batches per pass."""
        n, b = len(self.ratings), self.batch_size
        return n // b if self.last_batch == "drop" else -(-n // b)

    def __iter__(self) -> Iterator[Batch]:
        r = self.ratings
        ids = np.stack([r.users, r.items], axis=1)
        labels = r.ratings
        if self.shuffle_seed is not None:
            order = np.random.default_rng(self.shuffle_seed).permutation(len(r))
            ids, labels = ids[order], labels[order]
        dense = np.zeros((len(r), 0), np.float32)
        chunks = [(labels, dense, ids)]
        for (lab, den, idx), num_valid in rebatch(chunks, self.batch_size, self.last_batch):
            yield batch_from_ids(self.keys, idx, den, lab, num_valid)
