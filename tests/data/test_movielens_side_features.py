"""MovieLens side features: ML-100K and ML-1M files read into categorical ids, a reader's
batches holding each rating's user's and movie's ids (genres a bag of several), multi-id
keys in ``batch_from_ids``, and bad files named."""

from pathlib import Path

import numpy as np
import pytest

from jaxrec import data
from jaxrec.data._batch import batch_from_ids

# Hand-written: users 1, 2, 7 (no line for user 9 of the ratings), movies 10, 20, 30.
U_USER = "7|60|F|writer|02139\n1|24|M|technician|85711\n2|17|F|other|94043\n"
FLAGS = {10: ["Animation", "Children's", "Comedy"], 20: [], 30: ["Drama"]}
GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary",
          "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller",
          "War", "Western")
U_ITEM = "".join(
    f"{i}|{title}|{date}||http://x|" + "|".join("1" if g in FLAGS[i] else "0" for g in GENRES) + "\n"
    for i, title, date in [(10, "Toy Story (1995)", "01-Jan-1995"), (20, "Nameless", ""),
                           (30, "Café Noir (1948)", "")])
U_DATA = "1\t10\t5\t1\n2\t20\t3\t2\n7\t30\t4\t3\n9\t10\t2\t4\n1\t30\t1\t5\n"


def write_100k(folder: Path) -> Path:
    (folder / "u.user").write_text(U_USER)
    (folder / "u.item").write_bytes(U_ITEM.encode("latin-1"))  # MovieLens files are latin-1
    (folder / "u.data").write_text(U_DATA)
    return folder / "u.data"


def test_ml100k_fields_become_ids(tmp_path):
    write_100k(tmp_path)
    side = data.load_movielens_side_features(tmp_path)
    np.testing.assert_array_equal(side.user_ids, [1, 2, 7])
    np.testing.assert_array_equal(side.item_ids, [10, 20, 30])
    # ages 24, 17, 60 -> groups 18-24, under 18, 56+
    np.testing.assert_array_equal(side.columns["user_age"][:, 0], [1, 0, 6])
    assert side.vocabularies["user_gender"] == ("F", "M")
    np.testing.assert_array_equal(side.columns["user_gender"][:, 0], [1, 0, 0])
    assert side.vocabularies["user_occupation"] == ("other", "technician", "writer")
    genres = side.vocabularies["item_genres"]
    assert genres == ("Animation", "Children's", "Comedy", "Drama")
    assert side.columns["item_genres"].shape == (3, 3)  # the most genres of one movie
    np.testing.assert_array_equal(side.columns["item_genres"], [[0, 1, 2], [-1, -1, -1], [3, -1, -1]])
    # 1995 from the date, none for a title without a year, 1948 from the title
    assert side.vocabularies["item_decade"] == (1940, 1990)
    np.testing.assert_array_equal(side.columns["item_decade"][:, 0], [1, -1, 0])
    assert side.sizes == {"user_age": 7, "user_gender": 2, "user_occupation": 3, "item_genres": 4,
                          "item_decade": 2}


def test_ml1m_fields_become_the_same_features(tmp_path):
    (tmp_path / "users.dat").write_text("1::F::1::10::48067\n2::M::56::16::70072\n")
    (tmp_path / "movies.dat").write_text("1::Toy Story (1995)::Animation|Children's|Comedy\n"
                                         "2::Jumanji (1995)::Adventure\n")
    side = data.load_movielens_side_features(tmp_path)
    np.testing.assert_array_equal(side.columns["user_age"][:, 0], [0, 6])  # groups 1 and 56
    assert side.vocabularies["user_occupation"] == ("10", "16")
    assert side.vocabularies["item_genres"] == ("Adventure", "Animation", "Children's", "Comedy")
    np.testing.assert_array_equal(side.columns["item_genres"], [[1, 2, 3], [0, -1, -1]])
    np.testing.assert_array_equal(side.columns["item_decade"][:, 0], [0, 0])


def test_reader_batches_hold_each_ratings_side_ids(tmp_path):
    path = write_100k(tmp_path)
    side = data.load_movielens_side_features(tmp_path)
    reader = data.MovieLensReader(path, batch_size=5, side_features=side)
    assert reader.keys == ("user_id", "item_id", "user_age", "user_gender", "user_occupation",
                           "item_genres", "item_decade")
    (batch,) = list(reader)
    bags = batch.sparse.to_dict()

    ratings = data.load_movielens_ratings(path)
    for r, (user, item) in enumerate(zip(ratings.users, ratings.items)):
        u = np.flatnonzero(side.user_ids == user)
        i = np.flatnonzero(side.item_ids == item)
        for key in data.MOVIELENS_USER_FEATURES:
            expected = [] if u.size == 0 else [int(x) for x in side.columns[key][u[0]] if x >= 0]
            assert _bags(bags[key])[r] == expected, (key, r)  # user 9 has no line: empty bags
        for key in data.MOVIELENS_ITEM_FEATURES:
            expected = [int(x) for x in side.columns[key][i[0]] if x >= 0]
            assert _bags(bags[key])[r] == expected, (key, r)
    np.testing.assert_array_equal(reader.rows(), np.stack([[0, 1, 2, 3, 0], [0, 1, 2, 0, 2]], 1))


def _bags(jagged) -> list[list[int]]:
    values, offsets = np.asarray(jagged.values()), np.asarray(jagged.offsets())
    return [values[offsets[b]:offsets[b + 1]].tolist() for b in range(len(offsets) - 1)]


def test_every_row_batch_has_each_users_and_items_side_ids(tmp_path):
    path = write_100k(tmp_path)
    side = data.load_movielens_side_features(tmp_path)
    reader = data.MovieLensReader(path, batch_size=2, side_features=side)
    bags = reader.every_row().sparse.to_dict()  # rows: users 1, 2, 7, 9; items 10, 20, 30
    assert _bags(bags["user_id"]) == [[0], [1], [2], [3]]
    assert _bags(bags["item_id"]) == [[0], [1], [2], []]  # row 3 has a user and no item
    assert _bags(bags["item_genres"]) == [[0, 1, 2], [], [3], []]
    assert _bags(bags["item_decade"]) == [[1], [], [0], []]
    assert _bags(bags["user_age"]) == [[1], [0], [6], []]  # user 9 has no line


def test_a_key_of_several_columns_is_a_bag_of_their_ids():
    keys = ["a", "g", "g", "g", "b"]
    ids = np.array([[3, 1, 2, -1, 5], [4, -1, -1, -1, -1], [0, 7, -1, 8, 6]])
    batch = batch_from_ids(keys, ids, np.zeros((3, 0), np.float32), np.zeros(3, np.float32), 3)
    assert batch.sparse.keys() == ["a", "g", "b"]
    bags = batch.sparse.to_dict()
    assert _bags(bags["g"]) == [[1, 2], [], [7, 8]]
    assert _bags(bags["b"]) == [[5], [], [6]]
    with pytest.raises(ValueError, match="several ids per row"):
        batch_from_ids(keys, ids, np.zeros((3, 0), np.float32), np.zeros(3, np.float32), 3,
                       dedup_keys=("g",))


def test_bad_or_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="u.user and u.item"):
        data.load_movielens_side_features(tmp_path)
    write_100k(tmp_path)
    (tmp_path / "u.user").write_text("1|24|M|technician|85711\n2|old|F|other|94043\n")
    with pytest.raises(data.DataFormatError, match=r"u.user, line 2, field age: 'old'"):
        data.load_movielens_side_features(tmp_path)
    (tmp_path / "u.user").write_text("1|24|M|technician\n")
    with pytest.raises(data.DataFormatError, match=r"u.user, line 1: expected 5 fields"):
        data.load_movielens_side_features(tmp_path)
    (tmp_path / "u.user").write_text("1|24|M|technician|1\n1|30|F|other|2\n")
    with pytest.raises(data.DataFormatError, match="id 1 has more than one line"):
        data.load_movielens_side_features(tmp_path)
