"""MovieLens ratings in the three formats, the ML-100K split files, and the reader's batches.

Fixture lines (written by the tests)::

    u.data / u1.base   196\\t242\\t3\\t881250949
    ratings.dat        1::1193::4.5::978300760
    ratings.csv        userId,movieId,rating,timestamp  (header)  then 1,296,5.0,1147880044
"""

import random

import numpy as np
import pytest

from data_testing import bags, valid_rows
from jaxrec.data import (
    MOVIELENS_100K_SPLITS,
    DataFormatError,
    MovieLensRatings,
    MovieLensReader,
    load_movielens_ratings,
    movielens_100k_split,
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
    assert reader.num_users == max(r[0] for r in ref) + 1  # ids as they are
    assert reader.num_items == max(r[1] for r in ref) + 1
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
            assert (got["user_id"][b], got["item_id"][b]) == ([u], [i])
            assert batch.labels[b] == np.float32(r)
            row += 1
    assert row == (20 if last_batch == "drop" else 23)


def test_shuffle_is_a_deterministic_permutation(tmp_path):
    ratings = load_movielens_ratings(write(tmp_path / "u.data", make_ratings(40), "tab"))

    def rows(reader):
        out = []
        for batch in reader:
            got = bags(batch.sparse)
            out += [(got["user_id"][b][0], got["item_id"][b][0], float(batch.labels[b]))
                    for b in range(valid_rows(batch))]
        return out

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
        # one table size for both halves: ids index the same rows
        reader = MovieLensReader(held_out, batch_size=4, num_users=51, num_items=81)
        assert (reader.num_users, reader.num_items) == (51, 81)
        assert sum(valid_rows(b) for b in reader) == len(held_out)


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
    most = max(r[0] for r in ok)
    with pytest.raises(ValueError, match=rf"has user id {most} but num_users=2; .*pass "
                                         rf"num_users>={most + 1}"):
        MovieLensReader(path, batch_size=2, num_users=2)


def test_empty_file_and_header_only(tmp_path):
    (tmp_path / "e.dat").write_text("\n")
    assert len(load_movielens_ratings(tmp_path / "e.dat")) == 0
    header_only = write(tmp_path / "ratings.csv", [], "csv")
    ratings = load_movielens_ratings(header_only)
    assert isinstance(ratings, MovieLensRatings) and len(ratings) == 0
    assert list(MovieLensReader(ratings, batch_size=4)) == []
