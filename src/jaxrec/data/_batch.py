"""``Batch``: one step of training data (dense features, a KJT of ids, labels, a row mask).

Every reader in ``jaxrec.data`` yields ``Batch`` es of one static shape, so that a jitted
step compiles once::

    # batch_size B = 3, keys ["C1", "C2"], one id per bag, row 2 is padding (mask 0)
    #              0      1      2  <-- batch
    # "C1"        [7]    [0]    []
    # "C2"        [3]    [5]    []
    # sparse.lengths = [1, 1, 0, 1, 1, 0]; sparse.values = [7, 0, 3, 5, <pad>, <pad>]
    # dense  = float32[3, num_dense]  (row 2 zeros)
    # labels = float32[3]             (row 2 zero)
    # mask   = float32[3] = [1, 1, 0]

``Batch`` is a ``NamedTuple`` of arrays and a ``KeyedJaggedTensor``, hence a pytree: it goes
through ``jax.jit``, ``jax.device_put`` and ``jax.tree.map`` as it is. The mask is always
there (all ones in a full batch) so that a padded last batch has the same pytree structure
and shapes as the others: weight the per-example loss with it, e.g.
``(loss * batch.mask).sum() / batch.mask.sum()``.

The helpers below are shared by the readers: ``rebatch`` cuts a stream of host chunks into
fixed-size batches (dropping or padding the last one), ``make_batch`` builds a ``Batch`` from
host arrays.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from jaxrec.sparse import KeyedJaggedTensor

LAST_BATCH_POLICIES = ("pad", "drop")


class DataFormatError(ValueError):
    """A data file that does not follow its format; the message names the file and line."""


class DataFileError(ValueError, OSError):
    """A data file that cannot be read at all: a directory, no read permission, a damaged
    ``.gz``. The message names the file and the fix. It is an ``OSError`` (what it is) and a
    ``ValueError`` (bad input, like ``DataFormatError``), so either ``except`` catches it."""


def check_data_file(path: str | os.PathLike, what: str, hint: str) -> Path:
    """``path`` as a ``Path`` once it is known to be a readable file.

    Raises ``FileNotFoundError`` (``"{what} not found: {path}; {hint}"``) or
    ``DataFileError`` (a directory, or a file that cannot be opened), at construction
    rather than in the middle of a run.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}; {hint}")
    if not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise DataFileError(f"{path} is {kind}; {hint}")
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise DataFileError(
            f"{path} cannot be read ({e.strerror or e}); check its permissions, or copy it "
            "somewhere readable."
        ) from None
    return path


class Batch(NamedTuple):
    """One batch: ``dense`` float32[B, num_dense], ``sparse`` (KJT, stride B), ``labels``
    float32[B] and ``mask`` float32[B] (1 for a real row, 0 for padding)."""

    dense: jax.Array
    sparse: KeyedJaggedTensor
    labels: jax.Array
    mask: jax.Array

    @property
    def batch_size(self) -> int:
        """B, the static number of rows (padding rows included)."""
        return self.labels.shape[0]


def check_batch_size(value: object, name: str = "batch_size") -> int:
    """A positive Python int (``name`` is the argument, for the message)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {value!r}.")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {name}={value}.")
    return int(value)


def check_shard(shard: object) -> tuple[int, int]:
    """``(k, n)``: part ``k`` of ``n`` (a process's share of the data), ``0 <= k < n``."""
    ok = (isinstance(shard, tuple) and len(shard) == 2
          and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in shard)
          and 0 <= shard[0] < shard[1])
    if not ok:
        raise ValueError(f"shard must be (k, n), part k of n with 0 <= k < n (e.g. "
                         f"(jax.process_index(), jax.process_count())), got {shard!r}.")
    return int(shard[0]), int(shard[1])


def check_last_batch(last_batch: object) -> str:
    if last_batch not in LAST_BATCH_POLICIES:
        raise ValueError(
            f"last_batch must be one of {LAST_BATCH_POLICIES}, got {last_batch!r}: 'pad' "
            "keeps every row (padding rows have mask 0), 'drop' drops a partial last batch."
        )
    return str(last_batch)


def check_table_sizes(
    num_embeddings_per_feature: int | Sequence[int], num_features: int, name: str
) -> tuple[int, ...]:
    """One int, or one int per feature; every size >= 1. Returns one size per feature."""
    sizes = num_embeddings_per_feature
    if isinstance(sizes, (int, np.integer)) and not isinstance(sizes, bool):
        sizes = [sizes] * num_features
    try:
        sizes = [s for s in sizes]
    except TypeError:
        raise TypeError(
            f"{name} must be an int or a list of {num_features} ints, got {sizes!r}."
        ) from None
    if len(sizes) != num_features:
        raise ValueError(
            f"{name} must hold one table size per feature ({num_features}), got "
            f"{len(sizes)}: {list(sizes)}; or pass one int for all features."
        )
    for i, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1:
            raise ValueError(f"{name}[{i}] must be an int >= 1, got {s!r}.")
        if s > np.iinfo(np.int32).max:
            raise ValueError(
                f"{name}[{i}]={s} does not fit the int32 ids of a KeyedJaggedTensor; use "
                f"at most {np.iinfo(np.int32).max} rows."
            )
    return tuple(int(s) for s in sizes)


def rebatch(
    chunks: Iterable[tuple[np.ndarray, ...]], batch_size: int, last_batch: str
) -> Iterator[tuple[tuple[np.ndarray, ...], int]]:
    """Cuts chunks of rows (tuples of arrays with one leading row axis) into batches.

    Yields ``(arrays, num_valid)``: every array has ``batch_size`` rows; a partial last
    batch is padded with zeros (``num_valid < batch_size``) or dropped, per ``last_batch``.
    Chunks may be of any size; rows keep their order.
    """
    pending: list[tuple[np.ndarray, ...]] = []
    num_pending = 0
    for chunk in chunks:
        n = chunk[0].shape[0]
        if n == 0:
            continue
        pending.append(chunk)
        num_pending += n
        if num_pending < batch_size:
            continue
        merged = _concat(pending)
        start = 0
        while num_pending - start >= batch_size:
            yield tuple(a[start : start + batch_size] for a in merged), batch_size
            start += batch_size
        rest = tuple(a[start:] for a in merged)
        pending, num_pending = ([rest], num_pending - start) if num_pending > start else ([], 0)
    if num_pending and last_batch == "pad":
        merged = _concat(pending)
        padded = tuple(
            np.concatenate([a, np.zeros((batch_size - num_pending,) + a.shape[1:], a.dtype)])
            for a in merged
        )
        yield padded, num_pending


def _concat(parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    if len(parts) == 1:
        return parts[0]
    return tuple(np.concatenate(cols) for cols in zip(*parts))


def make_batch(
    keys: Sequence[str],
    values: np.ndarray,
    lengths: np.ndarray,
    dense: np.ndarray,
    labels: np.ndarray,
    num_valid: int,
    capacity: int,
    inverse_indices: np.ndarray | None = None,
    id_dtype: type = np.int32,
) -> Batch:
    """A ``Batch`` from host arrays.

    ``lengths``: int [num_keys, B] (key-major, padding rows 0); ``values``: the ids, key-major
    (all bags of key 0, then key 1, ...); ``dense`` [B, D]; ``labels`` [B]; the first
    ``num_valid`` rows are real. ``capacity`` is the static size of the KJT's values.
    ``inverse_indices`` int [num_keys, B]: row b of the batch uses bag ``[k, b]`` of key k
    (a variable-batch KJT, every key with B bags); None: row b uses bag b.
    ``id_dtype``: the KJT's ids, int32 (ids are row numbers), or int64 for raw ids (every
    batch of a stream alike, so that a jitted step compiles once; needs
    ``jax_enable_x64``, else the KJT refuses ids beyond int32).
    """
    batch_size = labels.shape[0]
    mask = np.zeros((batch_size,), np.float32)
    mask[:num_valid] = 1.0
    values = np.asarray(values, id_dtype)
    lengths = np.asarray(lengths, np.int32).reshape(-1)
    if inverse_indices is None:
        sparse = KeyedJaggedTensor.from_lengths_sync(
            list(keys), values, lengths, stride=batch_size, capacity=capacity
        )
    else:
        sparse = KeyedJaggedTensor(
            list(keys), values, lengths=lengths, capacity=capacity,
            stride_per_key_per_rank=[[batch_size]] * len(keys),
            inverse_indices=(list(keys), np.asarray(inverse_indices, np.int32)),
        )
    return Batch(
        dense=jax.numpy.asarray(np.asarray(dense, np.float32)),
        sparse=sparse,
        labels=jax.numpy.asarray(np.asarray(labels, np.float32)),
        mask=jax.numpy.asarray(mask),
    )


def batch_from_ids(
    keys: Sequence[str],
    ids: np.ndarray,
    dense: np.ndarray,
    labels: np.ndarray,
    num_valid: int,
    dedup_keys: Sequence[str] = (),
    id_dtype: type = np.int32,
) -> Batch:
    """A ``Batch`` from ``ids`` int [B, C], one column per entry of ``keys``, -1 = no id.

    A key named once holds at most one id per row; a key named by several columns (e.g.
    ``("user_id", "item_id", "genre", "genre", "genre")``) holds a bag of up to that many
    ids per row, in column order (multi-valued features such as a movie's genres). The
    batch's keys are the distinct names in order of first appearance. Rows past
    ``num_valid`` are padding (empty bags). Capacity B * C.

    ``dedup_keys`` (single-column keys only): the ids of these keys are looked up once per
    distinct id of the batch (TorchRec's variable batch per key, VBE): such a key holds one
    bag per distinct id, then empty bags up to B (every key keeps B bags, so that every
    batch has one static shape), and the KJT's ``inverse_indices`` map each row to its
    bag; a row without an id (padding rows too) maps to an empty bag, which exists since
    then fewer than B rows have ids. ``id_dtype``: as ``make_batch``'s.
    """
    batch_size, num_columns = ids.shape
    names = list(dict.fromkeys(keys))
    columns = [[c for c, k in enumerate(keys) if k == name] for name in names]
    present = ids >= 0
    present[num_valid:] = False
    inverse = None
    if dedup_keys:
        multi = [n for n, cols in zip(names, columns) if n in dedup_keys and len(cols) > 1]
        if multi:
            raise ValueError(f"dedup_keys {multi} hold several ids per row; only single-id keys "
                             "can be looked up once per distinct id")
        ids, present = ids.copy(), present.copy()
        inverse = np.tile(np.arange(batch_size, dtype=np.int32), (len(names), 1))
        for k, (name, cols) in enumerate(zip(names, columns)):
            if name not in dedup_keys:
                continue
            (c,) = cols
            distinct, rows = np.unique(ids[present[:, c], c], return_inverse=True)
            inverse[k] = batch_size - 1  # an empty bag, for the rows without an id
            inverse[k, present[:, c]] = rows
            ids[:, c] = -1
            ids[: distinct.size, c] = distinct
            present[:, c] = ids[:, c] >= 0
    lengths = np.stack([present[:, cols].sum(axis=1) for cols in columns])
    values = np.concatenate([ids[:, cols][present[:, cols]] for cols in columns])  # key-major
    return make_batch(
        names, values, lengths, dense, labels, num_valid,
        capacity=batch_size * num_columns, inverse_indices=inverse, id_dtype=id_dtype,
    )


def check_dedup_keys(dedup_keys: Sequence[str], keys: Sequence[str]) -> tuple[str, ...]:
    """``dedup_keys`` as a tuple of the reader's keys, or a ``ValueError`` that lists them."""
    if isinstance(dedup_keys, str):
        dedup_keys = (dedup_keys,)
    unknown = [k for k in dedup_keys if k not in keys]
    if unknown:
        raise ValueError(f"dedup_keys={list(dedup_keys)} names {unknown}, which are not keys of this "
                         f"reader; its keys are {list(keys)}.")
    return tuple(dedup_keys)
