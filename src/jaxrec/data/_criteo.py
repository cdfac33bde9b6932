"""Criteo display-advertising logs (Kaggle ``train.txt``, Terabyte ``day_N``), streamed.

Format: one example per line, 40 TAB-separated fields; the last line may lack its newline::

    label  I1 .. I13 (integers)        C1 .. C26 (hashed categories, 8 hex digits)
    0\\t\\t0\\t5\\t-1\\t...\\t4\\t05db9164\\tf0cf0024\\t...\\t\\t32c7478e\\t...
    ^  ^ I1 is empty (missing)              C-fields may be empty too

Decisions, as in the reference DLRM / TorchRec preprocessing:

* **Missing integer** -> 0, then the dense transform. The transform is explicit and a
  parameter: ``dense_log1p`` (default, DLRM's ``log(1 + max(x, 0))``; negatives such as
  -1 become 0), ``dense_log_plus3`` (TorchRec's ``log(x + 3)``, with values below Kaggle's
  minimum -2 clamped to -2, where the log would be -inf or NaN), ``None`` (raw values as
  float32) or any callable ``int64[n, 13] -> float[n, 13]``. Its output must be finite: a
  NaN or infinity is an error naming the line, never a silent NaN in the model.
* **Integers beyond int64** (such as ``99999999999999999999999``) are an error naming the
  line and field: no count is that large, so the line is damaged.
* **Hashing** (``ids="modulo"``, the default): ``id = int(hex, 16) %
  num_embeddings_per_feature[j]`` (unsigned; up to 16 hex digits).
* **Raw ids** (``ids="raw"``, for dynamic-vocabulary tables: ``jaxrec train --vocab
  dynamic``): ``id = int(hex, 16)``, no modulo, as int64. Criteo's values are 8 hex digits
  (32 bits), and the KJT's ids are int32 unless ``jax_enable_x64`` is on: an exact int32
  form would bit-cast the values of 2**31 and more to negative ids, which readers use as
  "no id", so the ids are int64 and the reader needs ``jax_enable_x64`` (an error at
  construction says so). Every value of up to 15 hex digits is its own id; a 16-digit
  value of 2**63 or more has no int64 id of its own and is an error naming the line and
  field, never folded onto another value's id. A missing category is id 0 (or an empty
  bag), as with hashing.
* **Missing category**: ``missing_category="zero"`` (default) hashes the empty string as 0,
  so the bag holds id 0, exactly as TorchRec's ``int(x or "0", 16)`` (row 0 is shared with
  the hashes that are multiples of the table size). ``"empty"`` gives a bag of length 0
  instead (the feature then pools to zeros).
* **Static shapes**: every batch has ``dense`` [B, 13], ``labels`` [B], ``mask`` [B] and a
  KJT with keys ``C1..C26``, stride B and capacity ``B * 26`` (at most one id per bag).
  ``last_batch="pad"`` (default) pads a partial last batch (mask 0, empty bags, zeros);
  ``"drop"`` drops it. Rows of several files run on into each other (no per-file padding).
* **Blank lines** are skipped (they still count in the line numbers of error messages).
* **Nothing to read is an error**: a file with no rows (empty, or blank lines only), a
  damaged or truncated ``.gz`` (``DataFormatError``), and ``last_batch="drop"`` with fewer
  rows than ``batch_size`` in all files (``ValueError``), so that a training loop that
  re-reads the files never spins over empty passes.

Streaming: files are read ``read_chunk_rows`` lines at a time (plain or ``.gz``) and parsed
with NumPy, so memory stays bounded whatever the file size. Throughput is ~110,000 rows/s
on one core of a 2-core CPU (Kaggle's 45M rows in ~7 minutes); wrap the reader in a
``Prefetcher`` so that parsing overlaps training.
"""

from __future__ import annotations

import gzip
import itertools
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import jax
import numpy as np

from jaxrec.data._batch import (
    Batch,
    DataFormatError,
    batch_from_ids,
    check_batch_size,
    check_data_file,
    check_last_batch,
    check_shard,
    check_table_sizes,
    rebatch,
)

CRITEO_NUM_DENSE = 13
CRITEO_NUM_SPARSE = 26
CRITEO_DENSE_KEYS = tuple(f"I{i}" for i in range(1, CRITEO_NUM_DENSE + 1))
CRITEO_SPARSE_KEYS = tuple(f"C{i}" for i in range(1, CRITEO_NUM_SPARSE + 1))
_NUM_FIELDS = 1 + CRITEO_NUM_DENSE + CRITEO_NUM_SPARSE

CRITEO_KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
"""Distinct values of C1..C26 in the Kaggle training set (the DLRM/TorchRec table sizes)."""

_MAX_HEX_DIGITS = 16  # fits uint64
_GZIP_MAGIC = b"\x1f\x8b"
_HEX_LUT = np.full(256, -1, np.int8)  # byte -> nibble; -1 not hex; -2 NUL padding of 'S'
_HEX_LUT[0] = -2
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i


def dense_log1p(x: np.ndarray) -> np.ndarray:
    """DLRM's dense transform: ``log(1 + max(x, 0))`` as float32 (missing values are 0)."""
    return np.log1p(np.maximum(np.asarray(x, np.float64), 0.0)).astype(np.float32)


def dense_log_plus3(x: np.ndarray) -> np.ndarray:
    """TorchRec's dense transform: ``log(x + 3)`` as float32. Values below Kaggle's minimum
    -2 are clamped to -2 (giving 0), where the log would be -inf (-3) or NaN (below)."""
    return np.log(np.maximum(np.asarray(x, np.float64), -2.0) + 3.0).astype(np.float32)


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _read_lines(f, path: Path, count: int) -> list[bytes]:
    """Up to ``count`` lines of ``f``; a damaged ``.gz`` is a ``DataFormatError``."""
    try:
        return list(itertools.islice(f, count))
    except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError
        raise DataFormatError(
            f"{path}: not a readable gzip file ({type(e).__name__}: {e}); it is damaged or "
            "truncated (download it again), or a plain TSV file named .gz (rename it)."
        ) from None


def _byte_share(path: Path, k: int, n: int) -> tuple[int, int | None]:
    """Bytes ``[start, end)`` of part ``k`` of ``n`` of a plain file; ``end`` None: all."""
    if n == 1:
        return 0, None
    size = path.stat().st_size
    return size * k // n, size * (k + 1) // n


def _lines_between(f, start: int, end: int) -> Iterator[bytes]:
    """The lines of binary file ``f`` that begin in bytes ``[start, end)``: every line is
    in exactly one part of a split by bytes."""
    position = start
    if start:
        f.seek(start - 1)
        position = start - 1 + len(f.readline())  # the rest of the line begun before start
    while position < end:
        line = f.readline()
        if not line:
            return
        position += len(line)
        yield line


def _line_starts(f, start: int, end: int | None) -> int:
    """Lines of binary file ``f`` that begin in bytes ``[start, end)`` (``end`` None: to the
    end): the first byte of the file and every byte after a newline but the file's end."""
    if start:
        f.seek(start - 1)
    count, previous, position = 0, b"\n" if start == 0 else f.read(1), start
    while end is None or position < end:
        block = f.read(1 << 20 if end is None else min(1 << 20, end - position))
        if not block:
            break
        # a line begins at each byte whose predecessor is a newline
        count += (previous == b"\n") + block[:-1].count(b"\n")
        previous, position = block[-1:], position + len(block)
    return count


def _check_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> tuple[Path, ...]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = tuple(Path(p) for p in paths)
    if not paths:
        raise ValueError("paths is empty; pass the path of a Criteo TSV file (or a list).")
    for p in paths:
        check_data_file(
            p, "Criteo TSV file",
            "pass the path of a Kaggle train.txt or a Terabyte day_N file (plain or .gz), or "
            f"for a folder its files, e.g. sorted(Path({str(p)!r}).glob('day_*')).",
        )
    return paths


class CriteoReader:
    """Iterates over ``Batch`` es of Criteo TSV files, one pass per ``iter()``.

    Args:
      paths: one file or a list of files (plain text or ``.gz``), read in order.
      batch_size: rows per batch (B).
      num_embeddings_per_feature: table size of C1..C26 (26 ints, or one int for all):
        ``id = int(hex, 16) % size``. Required with ``ids="modulo"``; not given with
        ``ids="raw"``.
      dense_transform: ``int64[n, 13] -> float[n, 13]`` applied after missing -> 0;
        default ``dense_log1p``; ``None`` keeps the raw integers (as float32).
      missing_category: ``"zero"`` (an empty C-field is id 0) or ``"empty"`` (a bag of
        length 0).
      last_batch: ``"pad"`` (pad with mask 0) or ``"drop"`` a partial last batch.
      read_chunk_rows: lines read and parsed at a time.
      ids: ``"modulo"`` (hashed modulo the table sizes, int32 ids) or ``"raw"`` (each
        value its own int64 id; needs ``jax_enable_x64``): module doc.
      shard: ``(k, n)``: read only part ``k`` of ``n`` (one of ``n`` processes,
        docs/multiprocess.md): of each plain file, the lines that begin in its ``k``-th
        ``n``-th of bytes; of ``.gz`` files (no seeking), files ``k, k + n, ...`` (at least
        ``n`` files). Error messages still give the line numbers of the file.

    Raises ``DataFormatError`` (a ``ValueError``) naming the file, line and field of a
    malformed line, or the file with no rows or a damaged ``.gz``; ``FileNotFoundError``
    for a missing file and ``DataFileError`` for a directory or an unreadable file (both
    at construction).
    """

    keys = CRITEO_SPARSE_KEYS

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        batch_size: int,
        num_embeddings_per_feature: int | Sequence[int] | None = None,
        dense_transform: Callable[[np.ndarray], np.ndarray] | None = dense_log1p,
        missing_category: str = "zero",
        last_batch: str = "pad",
        read_chunk_rows: int = 16384,
        shard: tuple[int, int] = (0, 1),
        ids: str = "modulo",
    ):
        self.paths = _check_paths(paths)
        self.shard = check_shard(shard)
        gz = [p for p in self.paths if p.suffix == ".gz"]
        if self.shard[1] > 1 and gz and len(self.paths) < self.shard[1]:
            raise ValueError(
                f"{_names(self.paths)}: {len(self.paths)} .gz files cannot be split over "
                f"{self.shard[1]} processes (a .gz file is read whole, by one process); pass at "
                "least one file per process, or the files unpacked (plain files split by bytes)."
            )
        self.batch_size = check_batch_size(batch_size)
        self.ids = _check_ids(ids, num_embeddings_per_feature)
        self.table_sizes = None if ids == "raw" else check_table_sizes(
            num_embeddings_per_feature, CRITEO_NUM_SPARSE, "num_embeddings_per_feature"
        )
        self._id_dtype = np.int64 if ids == "raw" else np.int32
        if dense_transform is not None and not callable(dense_transform):
            raise TypeError(
                f"dense_transform must be a callable or None, got {dense_transform!r}."
            )
        self.dense_transform = dense_transform
        if missing_category not in ("zero", "empty"):
            raise ValueError(
                f"missing_category must be 'zero' (id 0) or 'empty' (a bag of length 0), "
                f"got {missing_category!r}."
            )
        self.missing_category = missing_category
        self.last_batch = check_last_batch(last_batch)
        self.read_chunk_rows = check_batch_size(read_chunk_rows, "read_chunk_rows")

    def __iter__(self) -> Iterator[Batch]:
        chunks = self.iter_rows()
        num_rows, any_batch = 0, False

        def counted():
            nonlocal num_rows
            for chunk in chunks:
                num_rows += chunk[0].shape[0]
                yield chunk

        try:
            batches = rebatch(counted(), self.batch_size, self.last_batch)
            for (labels, dense, ids), num_valid in batches:
                any_batch = True
                yield batch_from_ids(self.keys, ids, dense, labels, num_valid,
                                     id_dtype=self._id_dtype)
        finally:
            chunks.close()
        if not any_batch:  # only "drop" gets here: every file has rows
            raise ValueError(
                f"{_names(self.paths)}: {num_rows} rows in all, fewer than batch_size="
                f"{self.batch_size}, and last_batch='drop' drops them all; pass a smaller "
                "batch_size or last_batch='pad'."
            )

    def iter_rows(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Chunks of parsed rows on the host, before batching: ``(labels float32[n],
        dense float32[n, 13], ids int64[n, 26])``, ids already hashed, or raw (-1 = empty
        bag). A file with no rows is a ``DataFormatError`` (with ``shard``: a share with none)."""
        table_sizes = None if self.table_sizes is None else np.asarray(self.table_sizes, np.uint64)
        k, n = self.shard
        rows_in_share = 0
        for path, start, end in self._share():
            num_rows = 0
            with _open(path) as f:
                lines = f if end is None else _lines_between(f, start, end)
                first_line = 1  # of the share: the file's numbers are found on errors only
                while chunk := _read_lines(lines, path, self.read_chunk_rows):
                    labels, dense, ids = self._parse(chunk, table_sizes, path, first_line, start)
                    first_line += len(chunk)
                    num_rows += labels.shape[0]
                    yield labels, dense, ids
            if num_rows == 0 and n == 1:
                raise DataFormatError(
                    f"{path} holds no rows (it is empty or has only blank lines); pass a "
                    "Criteo TSV file with data, or leave this one out."
                )
            rows_in_share += num_rows
        if rows_in_share == 0 and n > 1:
            raise DataFormatError(
                f"{_names(self.paths)}: part {k} of {n} (shard={self.shard}) holds no rows; "
                f"the data is too small to split over {n} processes: pass more data or use "
                "fewer processes."
            )

    def empty_batch(self) -> Batch:
        """A batch of padding rows only (mask 0, empty bags), shaped as the reader's."""
        b = self.batch_size
        return batch_from_ids(self.keys, np.full((b, CRITEO_NUM_SPARSE), -1, np.int64),
                              np.zeros((b, CRITEO_NUM_DENSE), np.float32), np.zeros(b, np.float32), 0,
                              id_dtype=self._id_dtype)

    def count_lines(self) -> int:
        """Lines of this reader's share (of every file with ``shard=(0, 1)``), blank ones
        included: an upper bound of its rows, counted without parsing (several processes
        agree on the length of a pass with it)."""
        count = 0
        for path, start, end in self._share():
            with _open(path) as f:
                count += _line_starts(f, start, end)
        return count

    def _share(self) -> list[tuple[Path, int, int | None]]:
        """``(path, start, end)`` of each file this reader reads, ``end`` None: to the end
        (``shard``: byte ranges of plain files, or every n-th ``.gz`` file)."""
        k, n = self.shard
        if n > 1 and any(p.suffix == ".gz" for p in self.paths):
            return [(path, 0, None) for path in self.paths[k::n]]
        return [(path, *_byte_share(path, k, n)) for path in self.paths]

    def _parse(self, lines: list[bytes], table_sizes: np.ndarray | None, path: Path, first_line: int,
               start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        missing = -1 if self.missing_category == "empty" else 0
        try:
            labels, raw_dense, ids = parse_lines(
                lines, table_sizes, path=path, first_line=first_line, missing=missing)
            return labels, self._transform(raw_dense, lines, path, first_line), ids
        except DataFormatError:
            if not start:
                raise
        # A share that starts inside the file: count the lines before it (the error path
        # only) and parse again, which raises the same error with the file's line numbers.
        with open(path, "rb") as f:
            first_line += _line_starts(f, 0, start)
        labels, raw_dense, ids = parse_lines(
            lines, table_sizes, path=path, first_line=first_line, missing=missing)
        self._transform(raw_dense, lines, path, first_line)
        raise AssertionError("parsing the same lines again did not fail")  # pragma: no cover

    def _transform(
        self, raw: np.ndarray, lines: list[bytes], path: Path, first_line: int
    ) -> np.ndarray:
        if self.dense_transform is None:
            return raw.astype(np.float32)
        out = np.asarray(self.dense_transform(raw))
        if out.shape != raw.shape:
            raise ValueError(
                f"dense_transform must keep the shape {raw.shape} of its input, returned "
                f"shape {out.shape}."
            )
        out = out.astype(np.float32)
        finite = np.isfinite(out)
        if not finite.all():
            r, c = np.argwhere(~finite)[0]
            raise DataFormatError(
                f"{path}, line {_row_lines(lines, first_line)[r]}, field "
                f"{CRITEO_DENSE_KEYS[c]}: dense_transform maps {int(raw[r, c])} to "
                f"{out[r, c]}, not a finite number; clamp such values in the transform "
                "(as dense_log1p and dense_log_plus3 do), or fix or remove this line."
            )
        return out


def _check_ids(ids: object, num_embeddings_per_feature) -> str:
    """``ids``, once it is known to be one of the two kinds and to fit the table sizes given."""
    if ids not in ("modulo", "raw"):
        raise ValueError(f"ids must be 'modulo' (int(hex, 16) % table size) or 'raw' (int(hex, 16), "
                         f"an int64 id), got {ids!r}.")
    if ids == "modulo" and num_embeddings_per_feature is None:
        raise ValueError("num_embeddings_per_feature is needed with ids='modulo' (the table sizes "
                         "the values are hashed modulo): pass 26 sizes or one for all, or ids='raw' "
                         "for the values themselves.")
    if ids == "raw" and num_embeddings_per_feature is not None:
        raise ValueError(f"ids='raw' gives each value its own id, without a modulo, so "
                         f"num_embeddings_per_feature={num_embeddings_per_feature!r} would do "
                         "nothing: drop it, or pass ids='modulo'.")
    if ids == "raw" and not jax.config.jax_enable_x64:
        raise ValueError("ids='raw' gives int64 ids (Criteo's values reach 2**32 - 1), which JAX "
                         "holds only with 64-bit types on: call jax.config.update('jax_enable_x64', "
                         "True) before creating the reader and the model (jaxrec train --vocab "
                         "dynamic does).")
    return str(ids)


def _names(paths: Sequence[Path]) -> str:
    return str(paths[0]) if len(paths) == 1 else f"the {len(paths)} files {paths[0]}, ..."


def _row_lines(lines: list[bytes], first_line: int) -> list[int]:
    """The line number of each row (non-blank line) of a chunk."""
    return [first_line + i for i, line in enumerate(lines) if line.rstrip(b"\r\n")]


def parse_lines(
    lines: list[bytes],
    table_sizes: np.ndarray | None,
    *,
    path: Path,
    first_line: int,
    missing: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parses raw lines (bytes, with or without newline) into ``(labels float32[n],
    dense int64[n, 13] (missing -> 0), ids int64[n, 26] (missing -> ``missing``))``;
    ``table_sizes`` None: raw ids, ``int(hex, 16)``."""
    stripped = [line.rstrip(b"\r\n") for line in lines]
    rows = [line for line in stripped if line]  # blank lines are skipped

    def line_of(row: int) -> int:
        return _row_lines(lines, first_line)[row]  # the error path only

    bad = next((r for r, row in enumerate(rows) if row.count(b"\t") != _NUM_FIELDS - 1), None)
    if bad is not None:
        found = rows[bad].count(b"\t") + 1
        hint = (
            " (39 fields look like Kaggle's test.txt, which has no label column)"
            if found == _NUM_FIELDS - 1 else
            " (the file starts like gzip: name it .gz)"
            if first_line == 1 and rows[bad].startswith(_GZIP_MAGIC) else ""
        )
        raise DataFormatError(
            f"{path}, line {line_of(bad)}: expected {_NUM_FIELDS} TAB-separated fields "
            f"(label, I1..I13, C1..C26), found {found}{hint}. Check that the file is a "
            "Criteo Kaggle/Terabyte TSV that is TAB (not comma) separated and not "
            "truncated, or remove this line."
        )
    if not rows:
        return (np.zeros((0,), np.float32), np.zeros((0, CRITEO_NUM_DENSE), np.int64),
                np.zeros((0, CRITEO_NUM_SPARSE), np.int64))
    fields = b"\t".join(rows).split(b"\t")
    table = np.array(fields, dtype=np.bytes_).reshape(len(rows), _NUM_FIELDS)

    def fail(bad: np.ndarray, column0: int, what: str) -> None:
        r, c = np.argwhere(bad)[0]
        name = ("label",) + CRITEO_DENSE_KEYS + CRITEO_SPARSE_KEYS
        value = table[r, column0 + c].decode("utf-8", "replace")
        raise DataFormatError(
            f"{path}, line {line_of(r)}, field {name[column0 + c]}: {value!r} {what}; "
            "fix or remove this line."
        )

    label_col = table[:, 0]
    ones = label_col == b"1"
    bad = ~(ones | (label_col == b"0"))
    if bad.any():
        fail(bad[:, None], 0, "is not a label (0 or 1)")
    labels = ones.astype(np.float32)

    dense_raw = table[:, 1 : 1 + CRITEO_NUM_DENSE]
    try:
        dense = np.where(dense_raw == b"", b"0", dense_raw).astype(np.int64)
    except (ValueError, OverflowError):
        problem, r, c = next(
            (p, r, c) for r, c in np.ndindex(*dense_raw.shape)
            if (p := _int64_problem(dense_raw[r, c])) is not None
        )
        bad = np.zeros(dense_raw.shape, bool)
        bad[r, c] = True
        fail(bad, 1, problem)

    cats = np.ascontiguousarray(table[:, 1 + CRITEO_NUM_DENSE :])
    ids = _hash_hex(cats, table_sizes, missing, lambda bad, what: fail(bad, 14, what))
    return labels, dense, ids


_INT64 = np.iinfo(np.int64)


def _int64_problem(field: bytes) -> str | None:
    """What makes a dense field unreadable as an int64, or None if nothing does."""
    try:
        value = int(field or b"0")
    except ValueError:
        return "is not an integer (I1..I13 hold integers such as 5 or -1, or nothing)"
    if not _INT64.min <= value <= _INT64.max:
        return ("is out of range (I1..I13 hold counts, at most 2**63 - 1; a value this "
                "large means a damaged line)")
    return None


def _hash_hex(cats: np.ndarray, table_sizes: np.ndarray | None, missing: int, fail) -> np.ndarray:
    """``int(hex, 16) % size`` for an ``S``-array [n, 26] of hex strings, vectorized;
    ``table_sizes`` None: ``int(hex, 16)`` itself (raw ids, which must fit int64)."""
    n, f = cats.shape
    if cats.dtype.itemsize > _MAX_HEX_DIGITS:  # wide for a long dense field, or a long hash
        too_long = np.char.str_len(cats) > _MAX_HEX_DIGITS
        if too_long.any():
            fail(too_long, f"is longer than {_MAX_HEX_DIGITS} hex digits (C1..C26 hold "
                           "hashes such as '05db9164')")
        cats = cats.astype(f"S{_MAX_HEX_DIGITS}")
    width = cats.dtype.itemsize
    nibbles = _HEX_LUT[cats.view(np.uint8).reshape(n, f, width)]
    bad = (nibbles == -1).any(axis=2)
    # NUL bytes inside a field (not trailing padding) are not hex either
    bad |= ((nibbles[..., :-1] == -2) & (nibbles[..., 1:] >= 0)).any(axis=2)
    if bad.any():
        fail(bad, "is not a hexadecimal hash (C1..C26 hold hex strings such as '05db9164', "
                  "or nothing when missing)")
    acc = np.zeros((n, f), np.uint64)
    for j in range(width):
        nib = nibbles[..., j]
        digit = nib >= 0
        acc = np.where(digit, acc * np.uint64(16) + nib.astype(np.uint64), acc)
    if table_sizes is None:
        # A value beyond int64 has no id of its own: folding it would merge it with another.
        too_large = acc > np.uint64(_INT64.max)
        if too_large.any():
            fail(too_large, "is 2**63 or more, beyond the int64 ids of ids='raw' (--vocab "
                            "dynamic), and folding it would give it another value's id "
                            "(Criteo's values have 8 hex digits)")
        ids = acc.astype(np.int64)
    else:
        ids = (acc % table_sizes).astype(np.int64)
    if missing != 0:
        ids[nibbles[..., 0] == -2] = missing
    return ids
