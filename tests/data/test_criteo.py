"""CriteoReader against a pure-Python parse of fixture files that the tests write.

A fixture line (TAB-separated, 40 fields; the last line has no newline)::

    1  <I1..I13: '', '-1', '0', '13275', ...>  <C1..C26: '05db9164', '', 'FFFFFFFF', ...>
"""

import gzip
import math
import random
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from data_testing import bags, deny_read, valid_rows

from jaxrec.data import (
    CRITEO_KAGGLE_CARDINALITIES,
    CRITEO_SPARSE_KEYS,
    Batch,
    CriteoReader,
    DataFileError,
    DataFormatError,
    dense_log1p,
    dense_log_plus3,
)

SAMPLE = (
    Path(__file__).resolve().parents[2].parent
    / "shared" / "data" / "criteo_sample" / "criteo_kaggle_format_100rows.tsv"
)
SIZES = [7, 1000, 3, 1 << 30] + [97 + j for j in range(22)]  # 1 << 30: big hashes survive


def make_rows(n, seed=0):
    """Rows of 40 str fields with empty fields, -1, big values and every kind of hash."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        dense = [rng.choice(["", "-1", "0", "1", "5", "13275", str(rng.randint(-2, 10**6))])
                 for _ in range(13)]
        cats = [rng.choice(["", f"{rng.getrandbits(32):08x}", f"{rng.getrandbits(32):08X}",
                            "ffffffff", "00000000", "1a"])
                for _ in range(26)]
        rows.append([str(i % 3 % 2)] + dense + cats)
    rows[0][1:14] = [""] * 13  # a row of missing dense values
    rows[1][14:] = [""] * 26  # a row of missing categories
    return rows


def write_tsv(path, rows, *, final_newline=False):
    text = "\n".join("\t".join(r) for r in rows) + ("\n" if final_newline else "")
    path.write_bytes(text.encode())
    return path


def reference_parse(path):
    """The straightforward parse: [(label, [13 ints], [26 hex str])]."""
    out = []
    for line in Path(path).read_text().split("\n"):
        if not line:
            continue
        fields = line.split("\t")
        assert len(fields) == 40
        out.append((int(fields[0]), [int(x) if x else 0 for x in fields[1:14]], fields[14:]))
    return out


def expected_bag(hex_str, size, missing):
    """The bag of one field: the value modulo ``size``, or the value itself (size None)."""
    if not hex_str:
        return [0] if missing == "zero" else []
    return [int(hex_str, 16) if size is None else int(hex_str, 16) % size]


def check_against_reference(batches, ref, batch_size, sizes, missing, last_batch, transform):
    full, partial = divmod(len(ref), batch_size)
    assert len(batches) == (full + (partial > 0) if last_batch == "pad" else full)
    row = 0
    for batch in batches:
        assert batch.dense.shape == (batch_size, 13) and batch.dense.dtype == np.float32
        assert batch.labels.shape == (batch_size,) and batch.sparse.stride() == batch_size
        assert batch.sparse.keys() == list(CRITEO_SPARSE_KEYS)
        assert batch.sparse.capacity == batch_size * 26
        n = valid_rows(batch)
        got = bags(batch.sparse)
        for b in range(batch_size):
            if b >= n:  # padding: zeros and empty bags
                assert all(got[k][b] == [] for k in CRITEO_SPARSE_KEYS)
                assert not np.asarray(batch.dense[b]).any() and batch.labels[b] == 0
                continue
            label, dense, cats = ref[row]
            assert batch.labels[b] == label
            want = [transform(v) for v in dense]
            np.testing.assert_allclose(np.asarray(batch.dense[b]), want, rtol=1e-6, atol=1e-6)
            for j, key in enumerate(CRITEO_SPARSE_KEYS):
                assert got[key][b] == expected_bag(cats[j], sizes[j], missing), (row, key)
            row += 1
    assert row == (len(ref) // batch_size * batch_size if last_batch == "drop" else len(ref))


LOG1P = lambda v: math.log1p(max(v, 0))  # noqa: E731


@pytest.mark.parametrize("missing", ["zero", "empty"])
@pytest.mark.parametrize("last_batch", ["pad", "drop"])
@pytest.mark.parametrize("batch_size,chunk", [(4, 3), (5, 16384), (23, 7)])
def test_batches_match_reference_parse(tmp_path, missing, last_batch, batch_size, chunk):
    path = write_tsv(tmp_path / "train.txt", make_rows(23))  # 23 rows: partial last batch
    reader = CriteoReader(
        path, batch_size=batch_size, num_embeddings_per_feature=SIZES,
        missing_category=missing, last_batch=last_batch, read_chunk_rows=chunk,
    )
    batches = list(reader)
    check_against_reference(batches, reference_parse(path), batch_size, SIZES, missing,
                            last_batch, LOG1P)
    assert list(reader)[0].labels.tolist() == batches[0].labels.tolist()  # re-iterable


def test_several_files_gzip_crlf_blank_lines(tmp_path):
    rows = make_rows(11, seed=3)
    a = write_tsv(tmp_path / "day_0", rows[:4], final_newline=True)
    text = "\r\n".join("\t".join(r) for r in rows[4:]) + "\r\n\r\n"
    b = tmp_path / "day_1.gz"
    with gzip.open(b, "wb") as f:
        f.write(("\n" + text).encode())  # a blank first line, CRLF, blank last line
    reader = CriteoReader([a, b], batch_size=3, num_embeddings_per_feature=1000)
    ref = reference_parse(a) + [
        (int(r[0]), [int(x) if x else 0 for x in r[1:14]], r[14:]) for r in rows[4:]
    ]
    check_against_reference(list(reader), ref, 3, [1000] * 26, "zero", "pad", LOG1P)


@pytest.mark.parametrize(
    "transform,reference",
    [(None, float), (dense_log_plus3, lambda v: math.log(v + 3)), (dense_log1p, LOG1P),
     (lambda x: x * 2.0 - 1.0, lambda v: 2.0 * v - 1.0)],
)
def test_dense_transform(tmp_path, transform, reference):
    rows = make_rows(6, seed=5)
    for r in rows:
        r[1:14] = [x if x in ("", "-1") else str(abs(int(x)) % 50) for x in r[1:14]]
    path = write_tsv(tmp_path / "t.tsv", rows)
    (batch,) = CriteoReader(path, batch_size=6, num_embeddings_per_feature=SIZES,
                            dense_transform=transform)
    want = [[reference(v) for v in dense] for _, dense, _ in reference_parse(path)]
    np.testing.assert_allclose(np.asarray(batch.dense), want, rtol=1e-6)


def test_batches_have_one_static_shape_under_jit(tmp_path):
    path = write_tsv(tmp_path / "t.tsv", make_rows(10))
    batches = list(CriteoReader(path, batch_size=4, num_embeddings_per_feature=SIZES))
    traces = []

    @jax.jit
    def step(batch: Batch):
        traces.append(1)
        ids = batch.sparse.values()
        return (batch.dense.sum(1) * batch.mask).sum(), ids.sum(), batch

    for batch in batches:  # the last one is padded
        _, _, out = step(batch)
        assert isinstance(out, Batch) and out.sparse.keys() == list(CRITEO_SPARSE_KEYS)
    assert len(traces) == 1
    assert jax.tree.structure(batches[0]) == jax.tree.structure(batches[-1])


# -- errors -------------------------------------------------------------------------------


def _error(tmp_path, rows, match, **kw):
    path = write_tsv(tmp_path / "bad.tsv", rows)
    reader = CriteoReader(path, batch_size=2, num_embeddings_per_feature=SIZES,
                          read_chunk_rows=2, **kw)
    with pytest.raises(DataFormatError, match=match):
        list(reader)
    return path


def test_error_wrong_number_of_fields(tmp_path):
    rows = make_rows(5)
    rows[3] = rows[3][:30]
    path = _error(tmp_path, rows, r"bad.tsv, line 4: expected 40 TAB-separated fields "
                  r"\(label, I1..I13, C1..C26\), found 30.*TAB \(not comma\)")
    assert "bad.tsv" in str(path)
    rows = make_rows(5)
    rows[0] = rows[0][1:]
    _error(tmp_path, rows, r"line 1: .*found 39 \(39 fields look like Kaggle's test.txt")
    rows = [",".join(r) for r in make_rows(2)]
    (tmp_path / "c.csv").write_text("\n".join(rows))
    with pytest.raises(DataFormatError, match=r"c.csv, line 1: .* found 1\b"):
        list(CriteoReader(tmp_path / "c.csv", batch_size=2, num_embeddings_per_feature=5))


def test_error_line_numbers_count_blank_lines(tmp_path):
    rows = make_rows(4)
    rows[3][20] = "xyz"
    text = "\n".join("\t".join(r) for r in rows[:2]) + "\n\n\n" + "\n".join(
        "\t".join(r) for r in rows[2:])
    (tmp_path / "b.tsv").write_text(text)
    with pytest.raises(DataFormatError, match=r"b.tsv, line 6, field C7: 'xyz' is not a hex"):
        list(CriteoReader(tmp_path / "b.tsv", batch_size=8, num_embeddings_per_feature=SIZES))


# --- raw ids (ids="raw": jaxrec train --vocab dynamic) ------------------------------------


@pytest.mark.parametrize("missing", ["zero", "empty"])
def test_raw_ids_are_the_values_themselves(tmp_path, x64, missing):
    rows = make_rows(23)
    rows[2][14] = "7fffffffffffffff"  # the largest int64 id
    rows[3][15] = "0123456789abcdef"  # 16 digits below 2**63
    path = write_tsv(tmp_path / "t.tsv", rows)
    reader = CriteoReader(path, batch_size=5, ids="raw", missing_category=missing, read_chunk_rows=7)
    batches = list(reader)
    ref = reference_parse(path)
    check_against_reference(batches, ref, 5, [None] * 26, missing, "pad", LOG1P)
    values = np.concatenate([np.asarray(b.sparse.values()) for b in batches])
    assert values.dtype == np.int64 and values.max() == 2**63 - 1
    assert (values >= 2**31).sum() > 20  # 8-digit values beyond int32 keep their value
    # every batch, the padding one too, has one pytree structure and dtype: one compile
    shapes = {jax.tree.structure(b) for b in [*batches, reader.empty_batch()]}
    dtypes = {tuple(x.dtype for x in jax.tree.leaves(b)) for b in [*batches, reader.empty_batch()]}
    assert len(shapes) == len(dtypes) == 1
    # the modulo reader keeps its int32 ids with 64-bit types on
    (modulo, *_) = CriteoReader(path, batch_size=5, num_embeddings_per_feature=SIZES)
    assert modulo.sparse.values().dtype == np.int32


def test_raw_ids_refuse_values_beyond_int64(tmp_path, x64):
    rows = make_rows(3)
    rows[1][16] = "8000000000000000"
    path = write_tsv(tmp_path / "bad.tsv", rows)
    with pytest.raises(DataFormatError, match=r"line 2, field C3: '8000000000000000' is 2\*\*63 or more, "
                                              r"beyond the int64 ids of ids='raw'.*fix or remove this line"):
        list(CriteoReader(path, batch_size=2, ids="raw"))
    # hashed, it is an ordinary value
    assert len(list(CriteoReader(path, batch_size=2, num_embeddings_per_feature=SIZES))) == 2


def test_raw_id_arguments(tmp_path):
    path = write_tsv(tmp_path / "t.tsv", make_rows(2))
    with pytest.raises(ValueError, match=r"ids='raw' gives int64 ids .* jax.config.update\('jax_enable_x64', True\)"):
        CriteoReader(path, batch_size=2, ids="raw")
    with pytest.raises(ValueError, match=r"num_embeddings_per_feature=5 would do nothing: drop it"):
        CriteoReader(path, batch_size=2, ids="raw", num_embeddings_per_feature=5)
    with pytest.raises(ValueError, match=r"num_embeddings_per_feature is needed with ids='modulo'"):
        CriteoReader(path, batch_size=2)
    with pytest.raises(ValueError, match=r"ids must be 'modulo' .* or 'raw' .*, got 'hashed'"):
        CriteoReader(path, batch_size=2, ids="hashed", num_embeddings_per_feature=5)


@pytest.mark.parametrize("bad", ["xyz", "12g4", "0x1f", " 1f", "1_f", "-1"])
def test_error_non_hex_category(tmp_path, bad):
    rows = make_rows(5)
    rows[2][14 + 4] = bad
    _error(tmp_path, rows, rf"line 3, field C5: '{bad}' is not a hexadecimal hash \(C1..C26 "
                           r"hold hex strings such as '05db9164', or nothing when missing\); "
                           r"fix or remove this line")


def test_error_too_long_hash(tmp_path):
    rows = make_rows(3)
    rows[1][14] = "1" * 17
    _error(tmp_path, rows, r"line 2, field C1: '1{17}' is longer than 16 hex digits")


@pytest.mark.parametrize("bad", ["1.5", "abc", "1e3", "--1"])
def test_error_non_integer_dense(tmp_path, bad):
    rows = make_rows(5)
    rows[4][1 + 12] = bad
    _error(tmp_path, rows, rf"line 5, field I13: '{bad}' is not an integer \(I1..I13 hold "
                           r"integers such as 5 or -1, or nothing\)")


@pytest.mark.parametrize("bad", ["2", "", "-1", "0.5"])
def test_error_bad_label(tmp_path, bad):
    rows = make_rows(3)
    rows[1][0] = bad
    _error(tmp_path, rows, rf"line 2, field label: '{bad}' is not a label \(0 or 1\)")


def test_error_missing_path_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"Criteo TSV file not found: .*nope.txt; pass "
                                                r"the path of a Kaggle train.txt"):
        CriteoReader(tmp_path / "nope.txt", batch_size=2, num_embeddings_per_feature=5)
    with pytest.raises(DataFileError, match=r"is a directory; .* for a folder its files"):
        CriteoReader(tmp_path, batch_size=2, num_embeddings_per_feature=5)


def test_error_unreadable_file(tmp_path, monkeypatch):
    path = write_tsv(tmp_path / "locked.tsv", make_rows(3))
    deny_read(monkeypatch, path)
    with pytest.raises(DataFileError, match=r"locked.tsv cannot be read \(Permission denied\); "
                                            r"check its permissions"):
        CriteoReader(path, batch_size=2, num_embeddings_per_feature=5)


# -- nothing to read, damaged files, values out of range ------------------------------------


@pytest.mark.parametrize("text", ["", "\n\n\r\n"])
def test_error_file_without_rows(tmp_path, text):
    good = write_tsv(tmp_path / "day_0", make_rows(3, seed=11))
    empty = tmp_path / "day_1"
    empty.write_text(text)
    for paths in ([empty], [good, empty]):
        reader = CriteoReader(paths, batch_size=2, num_embeddings_per_feature=SIZES)
        with pytest.raises(DataFormatError, match=r"day_1 holds no rows \(it is empty or has "
                                                  r"only blank lines\)"):
            list(reader)


def test_error_drop_leaves_no_batch(tmp_path):
    path = write_tsv(tmp_path / "t.tsv", make_rows(3, seed=12))
    reader = CriteoReader(path, batch_size=4, num_embeddings_per_feature=SIZES,
                          last_batch="drop")
    with pytest.raises(ValueError, match=r"t.tsv: 3 rows in all, fewer than batch_size=4, and "
                                         r"last_batch='drop' drops them all"):
        list(reader)


def _gzip_bytes(rows):
    return gzip.compress(("\n".join("\t".join(r) for r in rows) + "\n").encode())


@pytest.mark.parametrize("damage", ["plain text", "truncated", "corrupt"])
def test_error_damaged_gzip(tmp_path, damage):
    whole = _gzip_bytes(make_rows(200, seed=13))
    blob = {"plain text": b"1\t2\t3\n", "truncated": whole[: len(whole) // 2],
            "corrupt": whole[:20] + bytes(b ^ 0x5A for b in whole[20:60]) + whole[60:]}[damage]
    path = tmp_path / "day_0.gz"
    path.write_bytes(blob)
    reader = CriteoReader(path, batch_size=8, num_embeddings_per_feature=SIZES)
    with pytest.raises(DataFormatError, match=r"day_0.gz: not a readable gzip file \(.*\); it "
                                              r"is damaged or truncated"):
        list(reader)


def test_error_gzip_without_gz_name(tmp_path):
    path = tmp_path / "day_0"
    path.write_bytes(_gzip_bytes(make_rows(5, seed=18)))
    with pytest.raises(DataFormatError, match=r"day_0, line 1: expected 40 .* \(the file starts "
                                              r"like gzip: name it .gz\)"):
        list(CriteoReader(path, batch_size=2, num_embeddings_per_feature=SIZES))


@pytest.mark.parametrize("bad", ["99999999999999999999999", "-99999999999999999999999",
                                 "9223372036854775808"])
def test_error_dense_beyond_int64(tmp_path, bad):
    rows = make_rows(5, seed=14)
    rows[3][1 + 6] = bad
    _error(tmp_path, rows, rf"line 4, field I7: '{bad}' is out of range \(I1..I13 hold counts, "
                           r"at most 2\*\*63 - 1")


def test_dense_at_the_int64_limits_is_read(tmp_path):
    # 19-20 characters: wider than any hash, which must not make the hashes look too long
    rows = make_rows(2, seed=15)
    rows[0][1:3] = ["9223372036854775807", "-9223372036854775808"]
    (batch,) = CriteoReader(write_tsv(tmp_path / "t.tsv", rows), batch_size=2,
                            num_embeddings_per_feature=SIZES)
    np.testing.assert_allclose(np.asarray(batch.dense[0, :2]), [math.log1p(2.0**63), 0.0],
                               rtol=1e-6)


def test_negative_counts_are_clamped_by_both_transforms(tmp_path):
    rows = make_rows(4, seed=16)
    rows[2][1:5] = ["-1", "-2", "-3", "-1000"]
    path = write_tsv(tmp_path / "t.tsv", rows)
    for transform, want in ((dense_log1p, [0.0] * 4),
                            (dense_log_plus3, [math.log(2.0), 0.0, 0.0, 0.0])):
        (batch,) = CriteoReader(path, batch_size=4, num_embeddings_per_feature=SIZES,
                                dense_transform=transform)
        assert np.isfinite(np.asarray(batch.dense)).all()
        np.testing.assert_allclose(np.asarray(batch.dense[2, :4]), want, atol=1e-7)


def test_error_transform_gives_non_finite(tmp_path):
    rows = make_rows(6, seed=17)
    rows[4][1 + 2] = "-7"
    text = "\n".join("\t".join(r) for r in rows[:2]) + "\n\n" + "\n".join(
        "\t".join(r) for r in rows[2:])
    (tmp_path / "t.tsv").write_text(text)  # a blank line: the row is on line 6

    def log_plus3_unclamped(x):
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.log(x + 3.0)

    reader = CriteoReader(tmp_path / "t.tsv", batch_size=2, num_embeddings_per_feature=SIZES,
                          dense_transform=log_plus3_unclamped, read_chunk_rows=4)
    with pytest.raises(DataFormatError, match=r"t.tsv, line 6, field I3: dense_transform maps "
                                              r"-7 to nan, not a finite number"):
        list(reader)


def test_error_arguments(tmp_path):
    path = write_tsv(tmp_path / "t.tsv", make_rows(2))
    with pytest.raises(ValueError, match=r"one table size per feature \(26\), got 3"):
        CriteoReader(path, batch_size=2, num_embeddings_per_feature=[1, 2, 3])
    with pytest.raises(ValueError, match=r"num_embeddings_per_feature\[0\] must be an int >= 1"):
        CriteoReader(path, batch_size=2, num_embeddings_per_feature=[0] * 26)
    with pytest.raises(ValueError, match=r"last_batch must be one of \('pad', 'drop'\)"):
        CriteoReader(path, batch_size=2, num_embeddings_per_feature=5, last_batch="keep")
    with pytest.raises(ValueError, match=r"missing_category must be 'zero'"):
        CriteoReader(path, batch_size=2, num_embeddings_per_feature=5, missing_category=-1)
    with pytest.raises(ValueError, match=r"batch_size must be >= 1, got batch_size=0"):
        CriteoReader(path, batch_size=0, num_embeddings_per_feature=5)
    reader = CriteoReader(path, batch_size=2, num_embeddings_per_feature=5,
                          dense_transform=lambda x: x[:, :3])
    with pytest.raises(ValueError, match=r"dense_transform must keep the shape \(2, 13\)"):
        list(reader)


# -- the real sample ------------------------------------------------------------------------


@pytest.mark.skipif(not SAMPLE.is_file(), reason=f"the Criteo sample is absent ({SAMPLE})")
@pytest.mark.parametrize("missing", ["zero", "empty"])
def test_real_criteo_sample(missing):
    reader = CriteoReader(SAMPLE, batch_size=32,
                          num_embeddings_per_feature=CRITEO_KAGGLE_CARDINALITIES,
                          missing_category=missing)
    batches = list(reader)
    assert len(batches) == 4  # 32 + 32 + 32 + 4 (padded)
    assert sum(valid_rows(b) for b in batches) == 100
    assert sum(float(b.labels.sum()) for b in batches) == 29.0
    ref = reference_parse(SAMPLE)
    assert len(ref) == 100
    check_against_reference(batches, ref, 32, CRITEO_KAGGLE_CARDINALITIES, missing, "pad",
                            LOG1P)
    for b in batches:
        got = bags(b.sparse)
        for key, size in zip(CRITEO_SPARSE_KEYS, CRITEO_KAGGLE_CARDINALITIES):
            ids = [i for bag in got[key] for i in bag]
            assert all(0 <= i < size for i in ids)
    # the sample has empty categories: "empty" gives bags of length 0
    lengths = np.concatenate([np.asarray(b.sparse.lengths()) for b in batches])
    assert (lengths == 0).any() == True  # noqa: E712 (padding rows in both modes)
    num_ids = sum(int(np.asarray(b.sparse.lengths()).sum()) for b in batches)
    empty = sum(1 for _, _, cats in ref for c in cats if not c)
    assert empty > 0
    assert num_ids == 100 * 26 - (empty if missing == "empty" else 0)


# --- shares per process (shard=) --------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3, 7])
def test_the_shares_of_a_split_read_every_row_once(tmp_path, n):
    # Plain files split by bytes (a blank line, CRLF, no final newline); .gz files whole.
    rows = make_rows(40, seed=5)
    a = write_tsv(tmp_path / "day_0", rows[:25], final_newline=True)
    b = tmp_path / "day_1"
    b.write_bytes(("\r\n".join("\t".join(r) for r in rows[25:33]) + "\r\n\r\n"
                   + "\t".join(rows[33])).encode())
    kwargs = dict(batch_size=3, num_embeddings_per_feature=SIZES)

    def rows_of(paths, shard=(0, 1)):
        return [np.concatenate(x) for x in zip(*CriteoReader(paths, **kwargs, shard=shard).iter_rows())]

    def sorted_rows(parts):  # every row as bytes: the rows as a multiset
        return sorted(b"".join(np.ascontiguousarray(x[i]).tobytes() for x in parts)
                      for i in range(len(parts[0])))

    for paths in ([a, b], [gzip_copy(a, tmp_path), gzip_copy(b, tmp_path)] * n):
        whole = rows_of(paths)
        shares = [rows_of(paths, (k, n)) for k in range(n)]
        together = [np.concatenate([s[j] for s in shares]) for j in range(3)]
        assert sorted_rows(together) == sorted_rows(whole)  # every row in exactly one share
        if paths[0].suffix != ".gz":  # split by bytes: shares of about equal size
            sizes = [len(s[0]) for s in shares]
            assert max(sizes) - min(sizes) <= 2 * 3, sizes


def gzip_copy(path, tmp_path):
    target = tmp_path / f"{path.name}.gz"
    with gzip.open(target, "wb") as f:
        f.write(path.read_bytes())
    return target


def test_an_error_in_a_later_share_names_the_line_of_the_file(tmp_path):
    rows = make_rows(30)
    rows[23][20] = "xyz"
    path = write_tsv(tmp_path / "b.tsv", rows)
    errors = []
    for k in range(3):
        try:
            list(CriteoReader(path, batch_size=4, num_embeddings_per_feature=SIZES, shard=(k, 3)))
        except DataFormatError as e:
            errors.append((k, str(e)))
    assert len(errors) == 1 and errors[0][0] == 2, errors
    assert re.search(r"b.tsv, line 24, field C7: 'xyz' is not a hex", errors[0][1])


def test_shares_that_cannot_be_made_are_refused_clearly(tmp_path):
    a = write_tsv(tmp_path / "a.tsv", make_rows(2))
    with pytest.raises(DataFormatError, match=r"part 1 of 6 .* holds no rows; .* fewer processes"):
        for k in range(6):  # 2 lines for 6 parts: part 1 has none
            list(CriteoReader(a, batch_size=1, num_embeddings_per_feature=5, shard=(k, 6)))
    z = gzip_copy(a, tmp_path)
    with pytest.raises(ValueError, match=r"1 .gz files cannot be split over 2 processes"):
        CriteoReader(z, batch_size=1, num_embeddings_per_feature=5, shard=(0, 2))
    with pytest.raises(ValueError, match=r"shard must be \(k, n\)"):
        CriteoReader(a, batch_size=1, num_embeddings_per_feature=5, shard=(2, 2))


def test_a_share_counts_its_lines_without_parsing_and_pads_with_empty_batches(tmp_path):
    rows = make_rows(38, seed=2)
    a = write_tsv(tmp_path / "a", rows[:23], final_newline=True)
    b = tmp_path / "b"  # CRLF, a blank line, no final newline
    b.write_bytes(("\r\n".join("\t".join(r) for r in rows[23:33]) + "\r\n\r\n"
                   + "\t".join(rows[33])).encode())
    c = write_tsv(tmp_path / "c", rows[34:])
    kwargs = dict(batch_size=4, num_embeddings_per_feature=SIZES)
    for n in (1, 2, 3, 7):
        counts = []
        for k in range(n):
            reader = CriteoReader([a, b, c], **kwargs, shard=(k, n))
            found = sum(labels.shape[0] for labels, *_ in reader.iter_rows())
            counts.append(reader.count_lines())
            assert found <= counts[-1] <= found + 1  # the blank line counts as a line
        assert sum(counts) == 39
    empty = CriteoReader(a, **kwargs).empty_batch()
    real = next(iter(CriteoReader(a, **kwargs)))
    assert [np.shape(x) for x in jax.tree.leaves(empty)] == [np.shape(x) for x in jax.tree.leaves(real)]
    assert not np.asarray(empty.mask).any() and not np.asarray(empty.sparse.lengths()).any()
