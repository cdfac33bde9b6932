"""MovieLens ratings in the three formats, the ML-100K split files, and the reader's batches.

Fixture lines (written by the tests)::

    u.data / u1.base   196\\t242\\t3\\t881250949
    ratings.dat        1::1193::4.5::978300760
    ratings.csv        userId,movieId,rating,timestamp  (header)  then 1,296,5.0,1147880044
"""

import random

import numpy as np
import pytest
from data_testing import bags, deny_read, valid_rows

from jaxrec.data import (
    MOVIELENS_100K_SPLITS,
    DataFileError,
    DataFormatError,
    MovieLensRatings,
    MovieLensReader,
    load_movielens_ratings,
    movielens_100k_split,
    movielens_ids,
)

FORMATS = {"tab": "\t", "dat": "::", "csv": ","}


def make_ratings(n, seed=0, half_stars=False):
    rng = random.Random(seed)
    stars = [1, 2, 3, 4, 5] + ([0.5, 1.5, 2.5, 3.5, 4.5] if half_stars else [])
    return [(rng.randint(1, 50), rng.randint(1, 80), rng.choice(stars),
             rng.randint(874724710, 1046454590)) for _ in range(n)]


def write(path, ratings, fmt, *, final_newline=True):
    sep = FORMATS[fmt]
    lines = [sep.join(str(x) for x in r) for r in ratings]
    if fmt == "csv":
        lines.insert(0, "userId,movieId,rating,timestamp")
    path.write_text("\n".join(lines) + ("\n" if final_newline else ""))
    return path


def reference_parse(path, sep):
    """The straightforward parse: [(user, item, rating, timestamp)]."""
    out = []
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("userId"):
            continue
        u, i, r, t = line.split(sep)
        out.append((int(u), int(i), float(r), int(t)))
    return out


@pytest.mark.parametrize("fmt,name", [("tab", "u.data"), ("dat", "ratings.dat"),
                                      ("csv", "ratings.csv")])
@pytest.mark.parametrize("final_newline", [True, False])
def test_load_matches_reference_parse(tmp_path, fmt, name, final_newline):
    path = write(tmp_path / name, make_ratings(57, half_stars=fmt != "tab"), fmt,
                 final_newline=final_newline)
    got = load_movielens_ratings(path)
    ref = reference_parse(path, FORMATS[fmt])
    assert len(got) == len(ref) == 57
    assert got.users.tolist() == [r[0] for r in ref]
    assert got.items.tolist() == [r[1] for r in ref]
    assert got.ratings.tolist() == [r[2] for r in ref]
    assert got.timestamps.tolist() == [r[3] for r in ref]
    assert got.ratings.dtype == np.float32 and got.users.dtype == np.int64


@pytest.mark.parametrize("last_batch", ["pad", "drop"])
@pytest.mark.parametrize("fmt", ["tab", "dat"])
def test_reader_batches_match_reference(tmp_path, fmt, last_batch):
    path = write(tmp_path / "r", make_ratings(23, seed=1, half_stars=True), fmt)
    ref = reference_parse(path, FORMATS[fmt])
    reader = MovieLensReader(path, batch_size=5, last_batch=last_batch)
    batches = list(reader)
    assert len(batches) == len(reader) == (4 if last_batch == "drop" else 5)
    users, items = sorted({r[0] for r in ref}), sorted({r[1] for r in ref})
    assert (reader.num_users, reader.num_items) == (len(users), len(items))  # dense rows
    assert reader.user_ids.tolist() == users and reader.item_ids.tolist() == items
    row = 0
    for batch in batches:
        assert batch.sparse.keys() == ["user_id", "item_id"]
        assert batch.sparse.capacity == 10 and batch.dense.shape == (5, 0)
        n = valid_rows(batch)
        got = bags(batch.sparse)
        for b in range(5):
            if b >= n:
                assert got["user_id"][b] == got["item_id"][b] == [] and batch.labels[b] == 0
                continue
            u, i, r, _ = ref[row]
            assert (got["user_id"][b], got["item_id"][b]) == ([users.index(u)], [items.index(i)])
            assert batch.labels[b] == np.float32(r)
            row += 1
    assert row == (20 if last_batch == "drop" else 23)


def rows(batches):
    """(user row, item row, rating) of every valid row of ``batches``, in order."""
    out = []
    for batch in batches:
        got = bags(batch.sparse)
        out += [(got["user_id"][b][0], got["item_id"][b][0], float(batch.labels[b]))
                for b in range(valid_rows(batch))]
    return out


def test_shuffle_is_a_deterministic_permutation(tmp_path):
    ratings = load_movielens_ratings(write(tmp_path / "u.data", make_ratings(40), "tab"))

    plain = rows(MovieLensReader(ratings, batch_size=8))
    a = rows(MovieLensReader(ratings, batch_size=8, shuffle_seed=3))
    b = rows(MovieLensReader(ratings, batch_size=8, shuffle_seed=3))
    c = rows(MovieLensReader(ratings, batch_size=8, shuffle_seed=4))
    assert a == b and a != plain and a != c
    assert sorted(a) == sorted(plain)


def test_100k_split_files(tmp_path):
    folder = tmp_path / "ml-100k"
    folder.mkdir()
    all_ratings = make_ratings(60, seed=2)
    write(folder / "u.data", all_ratings, "tab")
    for k, split in enumerate(MOVIELENS_100K_SPLITS):
        test = set(range(k, 60, 7))
        write(folder / f"{split}.base", [r for j, r in enumerate(all_ratings) if j not in test],
              "tab")
        write(folder / f"{split}.test", [r for j, r in enumerate(all_ratings) if j in test], "tab")
    for k, split in enumerate(MOVIELENS_100K_SPLITS):
        base, test = movielens_100k_split(folder, split)
        assert (base.name, test.name) == (f"{split}.base", f"{split}.test")
        train, held_out = load_movielens_ratings(base), load_movielens_ratings(test)
        assert len(train) + len(held_out) == 60
        assert held_out.users.tolist() == [all_ratings[j][0] for j in range(k, 60, 7)]
        # one vocabulary for both halves: a user has one row in each
        user_ids, item_ids = movielens_ids(train, held_out)
        readers = [MovieLensReader(r, batch_size=4, user_ids=user_ids, item_ids=item_ids)
                   for r in (train, held_out)]
        assert {(r.num_users, r.num_items) for r in readers} == {(user_ids.size, item_ids.size)}
        assert user_ids.tolist() == sorted({r[0] for r in all_ratings})
        rows = [bags(b.sparse)["user_id"][j][0] for b in readers[1] for j in range(valid_rows(b))]
        assert user_ids[rows].tolist() == held_out.users.tolist()


def test_errors(tmp_path):
    ok = make_ratings(5)
    with pytest.raises(FileNotFoundError, match=r"MovieLens ratings file not found: .*nope"):
        load_movielens_ratings(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"split must be one of \('u1', .*'ub'\), got 'u9'"):
        movielens_100k_split(tmp_path, "u9")
    with pytest.raises(FileNotFoundError, match=r"split file not found: .*u1.base; pass the "
                                                r"ml-100k folder"):
        movielens_100k_split(tmp_path, "u1")

    p = tmp_path / "a.dat"
    p.write_text("1::2::3::4\n1::2::3\n")
    with pytest.raises(DataFormatError, match=r"a.dat, line 2: expected 4 fields \(user, item, "
                                              r"rating, timestamp\) separated by '::'.*found 3"):
        load_movielens_ratings(p)
    p.write_text("1::2::3::4\n\n1::2::3::4::5\n1::2::3\n")  # 5 + 3 fields: caught per line
    with pytest.raises(DataFormatError, match=r"a.dat, line 3: .*found 5"):
        load_movielens_ratings(p)
    p = tmp_path / "u.data"
    p.write_text("1\t2\t3\t4\n1\tx7\t3\t4\n")
    with pytest.raises(DataFormatError, match=r"u.data, line 2, field item: 'x7' is not an "
                                              r"integer"):
        load_movielens_ratings(p)
    p.write_text("1\t2\tfive\t4\n")
    with pytest.raises(DataFormatError, match=r"line 1, field rating: 'five' is not a number"):
        load_movielens_ratings(p)
    p = write(tmp_path / "ratings.csv", ok, "csv")
    p.write_text(p.read_text() + "1,2,3.5,4.5\n")
    with pytest.raises(DataFormatError, match=r"ratings.csv, line 7, field timestamp: '4.5'"):
        load_movielens_ratings(p)
    p = tmp_path / "x.txt"
    p.write_text("\n1 2 3 4\n")
    with pytest.raises(DataFormatError, match=r"x.txt, line 2: not a MovieLens ratings line"):
        load_movielens_ratings(p)
    path = write(tmp_path / "u1.test", ok, "tab")
    other = max(r[0] for r in ok) + 1
    with pytest.raises(ValueError, match=rf"u1.test: user id {ok[0][0]} is not in user_ids \(the "
                                         r"1 raw ids of the table rows\); .*movielens_ids"):
        MovieLensReader(path, batch_size=2, user_ids=[other])
    with pytest.raises(ValueError, match=r"item_ids holds repeated ids"):
        MovieLensReader(path, batch_size=2, item_ids=[3, 3])


@pytest.mark.parametrize("text,what", [("", "it is empty"), ("\n \n", "it is empty"),
                                       ("userId,movieId,rating,timestamp\n", "only a header")])
def test_error_file_without_ratings(tmp_path, text, what):
    (tmp_path / "ratings.csv").write_text(text)
    with pytest.raises(DataFormatError, match=rf"ratings.csv holds no ratings \({what}\); pass"):
        load_movielens_ratings(tmp_path / "ratings.csv")
    empty = MovieLensRatings(*(np.zeros((0,), t) for t in (np.int64, np.int64, np.float32,
                                                          np.int64)))
    with pytest.raises(ValueError, match=r"the ratings: no ratings at all"):
        MovieLensReader(empty, batch_size=4)


def test_error_drop_leaves_no_batch(tmp_path):
    path = write(tmp_path / "u.data", make_ratings(3, seed=5), "tab")
    with pytest.raises(ValueError, match=r"u.data: batch_size=4 is larger than its 3 ratings, "
                                         r"and last_batch='drop' drops them all"):
        MovieLensReader(path, batch_size=4, last_batch="drop")


def test_error_directory_and_unreadable_file(tmp_path, monkeypatch):
    with pytest.raises(DataFileError, match=r"is a directory; pass u.data / u1.base"):
        load_movielens_ratings(tmp_path)
    path = write(tmp_path / "u.data", make_ratings(3, seed=6), "tab")
    deny_read(monkeypatch, path)
    with pytest.raises(DataFileError, match=r"u.data cannot be read \(Permission denied\)"):
        load_movielens_ratings(path)


# -- ids are re-indexed densely; values are checked -----------------------------------------


def test_huge_ids_get_dense_rows_and_map_back(tmp_path):
    ratings = make_ratings(40, seed=7)
    ratings[5] = (1500000000, 3, 4, 881250949)
    ratings[9] = (2, 9223372036854775807, 2, 881250950)
    path = write(tmp_path / "ratings.dat", ratings, "dat")
    reader = MovieLensReader(path, batch_size=8)
    assert reader.num_users == len({r[0] for r in ratings}) < 60
    assert reader.num_items == len({r[1] for r in ratings}) < 90
    got = [(reader.user_ids[bags(b.sparse)["user_id"][j][0]],
            reader.item_ids[bags(b.sparse)["item_id"][j][0]]) for b in reader
           for j in range(valid_rows(b))]
    assert got == [(r[0], r[1]) for r in ratings]


@pytest.mark.parametrize("max_rows", [1, 7, 1000])
def test_max_rows_folds_the_dense_index(tmp_path, max_rows):
    ratings = load_movielens_ratings(write(tmp_path / "u.data", make_ratings(60, seed=8), "tab"))
    reader = MovieLensReader(ratings, batch_size=60, max_rows=max_rows)
    distinct = np.unique(ratings.users).size
    assert reader.num_users == min(distinct, max_rows)
    (batch,) = reader
    rows = [r[0] for r in bags(batch.sparse)["user_id"]]
    assert rows == (np.searchsorted(reader.user_ids, ratings.users) % max_rows).tolist()
    with pytest.raises(ValueError, match=r"max_rows must be >= 1, got max_rows=0"):
        MovieLensReader(ratings, batch_size=4, max_rows=0)


def test_rows_map_any_split_as_the_batches_do(tmp_path):
    """``reader.rows(split)``: each rating's (user row, item row) as the reader's batches
    would hold it, folded by max_rows; an id outside the vocabulary is named."""
    ratings = load_movielens_ratings(write(tmp_path / "u.data", make_ratings(60, seed=10), "tab"))
    train, test = (MovieLensRatings(*(f[part] for f in ratings)) for part in (slice(0, 45), slice(45, 60)))
    user_ids, item_ids = movielens_ids(train, test)
    reader = MovieLensReader(train, batch_size=45, user_ids=user_ids, item_ids=item_ids, max_rows=20)
    (batch,) = reader
    got = bags(batch.sparse)
    np.testing.assert_array_equal(reader.rows(), [(u[0], i[0]) for u, i in zip(got["user_id"], got["item_id"])])
    held_out = reader.rows(test)
    np.testing.assert_array_equal(held_out, np.stack([np.searchsorted(user_ids, test.users) % 20,
                                                      np.searchsorted(item_ids, test.items) % 20], 1))
    alone = MovieLensReader(train, batch_size=45)  # its vocabulary: the training ids only
    unseen = [u for u in test.users if u not in set(train.users)]  # in file order
    assert unseen
    with pytest.raises(ValueError, match=rf"the ratings: user id {unseen[0]} is not in user_ids"):
        alone.rows(test)


@pytest.mark.parametrize("fmt", ["tab", "dat", "csv"])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "NaN", "0", "5.5", "-1", "1e9"])
def test_error_rating_not_on_the_star_scale(tmp_path, fmt, bad):
    ratings = make_ratings(9, seed=9, half_stars=fmt != "tab")
    ratings[6] = (ratings[6][0], ratings[6][1], bad, ratings[6][3])
    path = write(tmp_path / "r.txt", ratings, fmt)
    line = 7 + (fmt == "csv")  # the header is line 1
    with pytest.raises(DataFormatError, match=rf"r.txt, line {line}, field rating: "
                                              rf"{float(bad)!r} is not a rating \(MovieLens "
                                              r"stars are finite, from 0.5 to 5.0\)"):
        load_movielens_ratings(path)


@pytest.mark.parametrize("field,bad,what", [
    ("user", "-3", "-3 is negative"), ("item", "-1", "-1 is negative"),
    ("user", "99999999999999999999", "'99999999999999999999' is out of range"),
    ("timestamp", "-99999999999999999999", "'-99999999999999999999' is out of range"),
])
def test_error_bad_ids(tmp_path, field, bad, what):
    ratings = [list(r) for r in make_ratings(6, seed=10)]
    ratings[4][("user", "item", "rating", "timestamp").index(field)] = bad
    path = write(tmp_path / "u.data", ratings, "tab")
    with pytest.raises(DataFormatError, match=rf"u.data, line 5, field {field}: {what}"):
        load_movielens_ratings(path)


def test_error_non_finite_rating_in_memory():
    rng = np.random.default_rng(11)
    ratings = MovieLensRatings(rng.integers(1, 9, 6), rng.integers(1, 9, 6),
                               rng.uniform(1, 5, 6).astype(np.float32), rng.integers(0, 9, 6))
    ratings.ratings[3] = np.inf
    with pytest.raises(ValueError, match=r"the ratings: rating 3 is inf, not a finite number"):
        MovieLensReader(ratings, batch_size=2)


def test_each_pass_is_a_new_order_that_a_new_reader_replays(tmp_path):
    ratings = load_movielens_ratings(write(tmp_path / "u.data", make_ratings(43), "tab"))
    reader = MovieLensReader(ratings, batch_size=8, shuffle_seed=3, last_batch="drop")
    passes = [rows(reader.one_pass(k)) for k in range(3)]
    assert rows(iter(reader)) == passes[0]
    assert len({tuple(p) for p in passes}) == 3  # a new order each pass
    # the 3 ratings dropped at the end are not the same in every pass
    everything = sorted(rows(MovieLensReader(ratings, batch_size=43)))
    dropped = [set(everything) - set(p) for p in passes]
    assert all(len(d) == 3 for d in dropped) and len(set().union(*dropped)) > 3
    again = MovieLensReader(ratings, batch_size=8, shuffle_seed=3, last_batch="drop")
    assert [rows(again.one_pass(k)) for k in range(3)] == passes  # by seed and number only
