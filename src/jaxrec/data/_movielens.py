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
* **Ids re-indexed densely**, as every MovieLens loader does: the raw ids (any
  non-negative int64; a stray ``1500000000`` does not make a table of 1.5e9 rows) in sorted
  order are the table rows ``0 .. n-1``. ``MovieLensReader.user_ids`` / ``item_ids`` hold
  the raw ids in row order, to map predictions back. Splits of one data set must share the
  rows of a user: build the ids once from all of them with ``movielens_ids(train, test)``
  and pass them to each reader (an id missing from them is an error).
* **max_rows** caps each table as ``CriteoReader``'s sizes do: the dense index ``i`` lands
  in row ``i % max_rows`` (ids beyond the cap share rows, as hashed Criteo ids do).
* **Ratings must be finite and on the star scale** ``[0.5, 5]`` (ML-100K and ML-1M use
  whole stars 1..5, the later sets half stars): ``nan``, ``inf``, ``7`` or a negative id
  is a ``DataFormatError`` naming the file, line and value, never a model that fails later.
* **Nothing to read is an error**: a file with no ratings, and ``last_batch="drop"`` with
  fewer ratings than ``batch_size``, so that a loop over passes never spins on empty ones.
* Batches: ``sparse`` keys ``("user_id", "item_id")``, one id each, capacity ``2 * B``;
  ``labels`` the ratings (float32); ``dense`` float32[B, 0]; ``last_batch`` as in
  ``CriteoReader`` (``"pad"`` with mask 0, or ``"drop"``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxrec.data._batch import (
    Batch,
    DataFormatError,
    batch_from_ids,
    check_batch_size,
    check_data_file,
    check_dedup_keys,
    check_last_batch,
    rebatch,
)
from jaxrec.data._movielens_side import MOVIELENS_USER_FEATURES, MovieLensSideFeatures

MOVIELENS_KEYS = ("user_id", "item_id")
MOVIELENS_100K_SPLITS = ("u1", "u2", "u3", "u4", "u5", "ua", "ub")
MOVIELENS_RATING_RANGE = (0.5, 5.0)
"""The star scale of every MovieLens data set (half stars from ML-10M on)."""
_HINT = ("pass u.data / u1.base (ML-100K), ratings.dat (ML-1M, ML-10M) or ratings.csv "
         "(ML-20M and later).")
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
    """Loads a whole ratings file (format detected; see the module docstring).

    Raises ``FileNotFoundError``, ``DataFileError`` (a directory, an unreadable file) or
    ``DataFormatError`` naming the line and field of a malformed line or value, or the file
    when it holds no ratings.
    """
    path, ratings, numbers = load_interaction_lines(path, "MovieLens ratings file", "rating", _HINT)
    _check_values(ratings, path, numbers)
    return ratings


def load_interaction_lines(path: str | os.PathLike, what: str, value: str,
                           hint: str) -> tuple[Path, MovieLensRatings, list[int]]:
    """``(path, rows, line numbers)`` of a file of ``user, item, <value>, timestamp`` lines
    in one of the MovieLens layouts (module doc), unchecked but for the format; ``what``
    names the file and ``value`` the third field in errors."""
    path = check_data_file(path, what, hint)
    lines = path.read_bytes().splitlines()
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None:
        raise DataFormatError(f"{path} holds no {value}s (it is empty); {hint}")
    sep = next((s for s in _FORMATS if s in lines[first]), None)
    if sep is None:
        raise DataFormatError(
            f"{path}, line {first + 1}: not a {what.removesuffix(' file')} line "
            f"({lines[first][:60]!r}); expected 'user\\titem\\t{value}\\ttimestamp', "
            f"'user::item::{value}::timestamp' or 'user,item,{value},timestamp'."
        )
    start = first
    if sep == b"," and not lines[first].split(b",")[0].strip().isdigit():
        start = first + 1  # the CSV header
    numbers = [start + 1 + i for i, line in enumerate(lines[start:]) if line.strip()]
    body = [lines[n - 1] for n in numbers]
    if not body:
        raise DataFormatError(f"{path} holds no {value}s (only a header); {hint}")
    try:
        rows = _parse_fast(body, sep)
    except (ValueError, OverflowError):
        _raise_first_error(body, sep, path, numbers, value)
        raise  # pragma: no cover - _raise_first_error always raises here
    return path, rows, numbers


def _parse_fast(lines: list[bytes], sep: bytes) -> MovieLensRatings:
    """Non-blank lines -> arrays; ``ValueError``/``OverflowError`` on any bad field."""
    if not all(line.count(sep) == 3 for line in lines):
        raise ValueError("a line without 4 fields")
    fields = b"\n".join(lines).replace(sep, b"\n").split(b"\n")
    table = np.array(fields, dtype=np.bytes_).reshape(-1, 4)
    return MovieLensRatings(
        users=table[:, 0].astype(np.int64),
        items=table[:, 1].astype(np.int64),
        ratings=table[:, 2].astype(np.float32),
        timestamps=table[:, 3].astype(np.int64),
    )


_INT64 = np.iinfo(np.int64)


def _raise_first_error(lines: list[bytes], sep: bytes, path: Path, numbers: list[int],
                       value_name: str) -> None:
    """Finds the first malformed line (the slow way) and raises a precise error."""
    names = ("user", "item", value_name, "timestamp")
    for number, line in zip(numbers, lines):
        where = f"{path}, line {number}"
        fields = line.split(sep)
        if len(fields) != 4:
            raise DataFormatError(
                f"{where}: expected 4 fields ({', '.join(names)}) separated by "
                f"{sep.decode()!r} ({_FORMATS[sep]}), found {len(fields)}: "
                f"{line[:80].decode('utf-8', 'replace')!r}; fix or remove this line."
            )
        for name, field in zip(names, fields):
            text = field.decode("utf-8", "replace")
            try:
                value = float(field) if name == value_name else int(field)
            except ValueError:
                kind = "a number" if name == value_name else "an integer"
                raise DataFormatError(
                    f"{where}, field {name}: {text!r} is not {kind}; fix or remove this line."
                ) from None
            if name != value_name and not _INT64.min <= value <= _INT64.max:
                raise DataFormatError(
                    f"{where}, field {name}: {text!r} is out of range (at most 2**63 - 1); "
                    "fix or remove this line."
                )
    raise DataFormatError(f"{path}: could not parse the {value_name}s; check the file format.")


def _check_values(ratings: MovieLensRatings, path: Path, numbers: list[int]) -> None:
    """Ids >= 0 and ratings on the star scale, else an error naming the first bad line."""
    low, high = MOVIELENS_RATING_RANGE
    checks = (
        ("user", ratings.users, ratings.users < 0, "is negative (ids are >= 0)"),
        ("item", ratings.items, ratings.items < 0, "is negative (ids are >= 0)"),
        ("rating", ratings.ratings, ~((ratings.ratings >= low) & (ratings.ratings <= high)),
         f"is not a rating (MovieLens stars are finite, from {low} to {high})"),
    )
    for name, values, bad, what in checks:
        if bad.any():
            row = int(np.argmax(bad))
            raise DataFormatError(
                f"{path}, line {numbers[row]}, field {name}: {values[row].item()!r} {what}; "
                "fix or remove this line."
            )


def movielens_ids(*ratings: MovieLensRatings) -> tuple[np.ndarray, np.ndarray]:
    """``(user_ids, item_ids)``: the sorted distinct raw ids over all ``ratings`` (e.g. the
    train and test splits), to pass to every ``MovieLensReader`` of one data set."""
    if not ratings:
        raise ValueError("movielens_ids needs at least one MovieLensRatings.")
    users = np.unique(np.concatenate([r.users for r in ratings]))
    items = np.unique(np.concatenate([r.items for r in ratings]))
    return users, items


def _vocabulary(given: np.ndarray | None, ids: np.ndarray, arg: str) -> np.ndarray:
    """The raw ids of the table rows, in row order (default: ``ids``' distinct, sorted)."""
    if given is None:
        return np.unique(ids)
    vocab = np.asarray(given)
    if vocab.ndim != 1 or vocab.size == 0 or not np.issubdtype(vocab.dtype, np.integer):
        raise ValueError(f"{arg} must be a non-empty 1-D array of integer ids, got {given!r}.")
    if np.unique(vocab).size != vocab.size:
        raise ValueError(f"{arg} holds repeated ids; pass each raw id once (movielens_ids).")
    return vocab.astype(np.int64)


def _rows(vocab: np.ndarray, ids: np.ndarray, name: str, source: str) -> np.ndarray:
    """The dense index of each raw id in ``vocab``; an id missing from it is an error."""
    order = np.argsort(vocab, kind="stable")
    pos = np.minimum(np.searchsorted(vocab[order], ids), vocab.size - 1)
    missing = vocab[order][pos] != ids
    if missing.any():
        raise ValueError(
            f"{source}: {name} id {int(ids[np.argmax(missing)])} is not in {name}_ids (the "
            f"{vocab.size} raw ids of the table rows); build them from every split with "
            "movielens_ids(train, test) and pass them to each reader."
        )
    return order[pos]


class MovieLensReader:
    """Iterates over ``Batch`` es of MovieLens ratings, one pass per ``iter()``.

    Args:
      source: a ratings file path, or ``MovieLensRatings`` already loaded.
      batch_size: ratings per batch (B).
      user_ids, item_ids: the raw ids of the table rows, in row order (default: the
        source's distinct ids, sorted); pass ``movielens_ids(train, test)`` to every split.
      max_rows: caps each table; the dense index ``i`` uses row ``i % max_rows``.
      shuffle_seed: ``None`` keeps file order; an int shuffles, a new order each pass
        (``passes``; ``iter(reader)`` is pass 0), so that a dropped last batch is never the
        same ratings twice.
      last_batch: ``"pad"`` (pad with mask 0) or ``"drop"`` a partial last batch.
      dedup_keys: keys whose ids a batch looks up once per distinct id, e.g.
        ``("user_id",)``: a user with several ratings in a batch is one bag, expanded to its
        rows by the KJT's ``inverse_indices`` (TorchRec's VBE).
      side_features: ``load_movielens_side_features(folder)``: each batch also holds the
        rating's user's and movie's side ids (``user_age``, ..., ``item_genres`` a bag of
        several), keyed by raw id; a user or movie without side ids gets empty bags.

    Attributes ``num_users`` / ``num_items`` are the table sizes, ``user_ids`` /
    ``item_ids`` the raw ids (the id of row ``r`` is ``user_ids[r]`` when nothing is
    folded). An empty source, a non-finite rating or ``"drop"`` with fewer ratings than
    ``batch_size`` is a ``ValueError`` here, not an empty pass later.
    """

    def __init__(
        self,
        source: str | os.PathLike | MovieLensRatings,
        *,
        batch_size: int,
        user_ids: np.ndarray | None = None,
        item_ids: np.ndarray | None = None,
        max_rows: int | None = None,
        shuffle_seed: int | None = None,
        last_batch: str = "pad",
        dedup_keys: Sequence[str] = (),
        side_features: MovieLensSideFeatures | None = None,
    ):
        if isinstance(source, MovieLensRatings):
            self.ratings, name = source, "the ratings"
        else:
            self.ratings, name = load_movielens_ratings(source), str(source)
        _check_in_memory(self.ratings, name)
        self.batch_size = check_batch_size(batch_size)
        self.last_batch = check_last_batch(last_batch)
        self.max_rows = None if max_rows is None else check_batch_size(max_rows, "max_rows")
        self.user_ids = _vocabulary(user_ids, self.ratings.users, "user_ids")
        self.item_ids = _vocabulary(item_ids, self.ratings.items, "item_ids")
        self.num_users = min(self.user_ids.size, self.max_rows or self.user_ids.size)
        self.num_items = min(self.item_ids.size, self.max_rows or self.item_ids.size)
        self._rows = self._table_rows(self.ratings, name)
        self.side_features = side_features
        self._column_keys = list(MOVIELENS_KEYS)  # the key of each id column of a batch
        if side_features is not None:
            self._column_keys += [f for f, c in side_features.columns.items() for _ in range(c.shape[1])]
            self._rows = np.concatenate(
                [self._rows, self._side_ids(self.ratings.users, self.ratings.items)], axis=1)
        self.keys = tuple(dict.fromkeys(self._column_keys))
        self.shuffle_seed = shuffle_seed
        self.dedup_keys = check_dedup_keys(dedup_keys, self.keys)
        if len(self) == 0:
            raise ValueError(
                f"{name}: batch_size={self.batch_size} is larger than its "
                f"{len(self.ratings)} ratings, and last_batch='drop' drops them all; pass a "
                "smaller batch_size or last_batch='pad'."
            )

    def _side_ids(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """int64 [n, side columns]: the side ids of each (raw user, raw item), -1 = none."""
        side = self.side_features
        parts = []
        for name, column in side.columns.items():
            ids, raw = (side.user_ids, users) if name in MOVIELENS_USER_FEATURES else (side.item_ids, items)
            pos = np.minimum(np.searchsorted(ids, raw), ids.size - 1)
            found = ids[pos] == raw
            parts.append(np.where(found[:, None], column[pos], -1))
        return np.concatenate(parts, axis=1)

    def every_row(self) -> Batch:
        """One batch of every user row and every item row, to embed them all (e.g.
        ``query, candidate = model.embed(batch.sparse)``, then ``query[:num_users]`` and
        ``candidate[:num_items]``): row ``r`` holds user row ``r`` and item row ``r`` (no item
        past the smaller table; users repeat) with their side ids (those of the first raw
        id folded into the row). Labels are 0."""
        size = max(self.num_users, self.num_items)
        rows = np.arange(size)
        ids = np.stack([rows % self.num_users, np.where(rows < self.num_items, rows, -1)], axis=1)
        if self.side_features is not None:
            side = self._side_ids(self.user_ids[rows % self.num_users],
                                  self.item_ids[rows % self.num_items])
            item_columns = ~np.isin(self._column_keys[2:], MOVIELENS_USER_FEATURES)
            side[np.ix_(rows >= self.num_items, item_columns)] = -1  # no item in these rows
            ids = np.concatenate([ids, side], axis=1)
        return batch_from_ids(self._column_keys, ids, np.zeros((size, 0), np.float32),
                              np.zeros(size, np.float32), size)

    def rows(self, ratings: MovieLensRatings | None = None) -> np.ndarray:
        """int64 ``[n, 2]``: the (user row, item row) of each rating of ``ratings`` (default:
        the reader's own), as this reader's batches hold them: raw ids through ``user_ids``
        / ``item_ids``, folded by ``max_rows``. E.g. a held-out split's rows, to evaluate
        against. An id outside the vocabulary is a ``ValueError``."""
        if ratings is None:
            return self._rows[:, :2].copy()
        return self._table_rows(ratings, "the ratings")

    def _table_rows(self, ratings: MovieLensRatings, name: str) -> np.ndarray:
        return np.stack([  # index % size folds exactly the indices >= max_rows
            _rows(self.user_ids, ratings.users, "user", name) % self.num_users,
            _rows(self.item_ids, ratings.items, "item", name) % self.num_items,
        ], axis=1)

    def __len__(self) -> int:
        """Batches per pass."""
        n, b = len(self.ratings), self.batch_size
        return n // b if self.last_batch == "drop" else -(-n // b)

    def __iter__(self) -> Iterator[Batch]:
        return self.one_pass(0)

    def one_pass(self, number: int) -> Iterator[Batch]:
        """Pass ``number`` (from 0) over the ratings: its order depends on the seed and the
        number only, so a resumed run replays the passes of the run it continues."""
        ids, labels = self._rows, self.ratings.ratings
        if self.shuffle_seed is not None:
            seed = self.shuffle_seed if number == 0 else [self.shuffle_seed, number]
            order = np.random.default_rng(seed).permutation(len(labels))
            ids, labels = ids[order], labels[order]
        dense = np.zeros((len(labels), 0), np.float32)
        chunks = [(labels, dense, ids)]
        for (lab, den, idx), num_valid in rebatch(chunks, self.batch_size, self.last_batch):
            yield batch_from_ids(self._column_keys, idx, den, lab, num_valid, self.dedup_keys)


def _check_in_memory(ratings: MovieLensRatings, name: str) -> None:
    """Ratings built in memory skip the loader's checks: the ones a model needs."""
    if len(ratings) == 0:
        raise ValueError(f"{name}: no ratings at all; pass a ratings file or split with data.")
    bad = ~np.isfinite(ratings.ratings)
    if bad.any():
        row = int(np.argmax(bad))
        raise ValueError(
            f"{name}: rating {row} is {ratings.ratings[row]}, not a finite number; drop or "
            "fix it before training."
        )
