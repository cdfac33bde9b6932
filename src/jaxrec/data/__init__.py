"""Data for recommendation models: real formats and a synthetic click log -> KJT batches.

- ``CriteoReader``: Criteo Kaggle / Terabyte TSV files, streamed in chunks.
- ``MovieLensReader``, ``load_movielens_ratings``, ``movielens_100k_split``,
  ``movielens_ids``: MovieLens ratings (ML-100K ``u.data`` and splits, ML-1M/10M
  ``ratings.dat``, ``ratings.csv``), ids re-indexed densely.
- ``load_movielens_side_features``, ``MovieLensSideFeatures``: the users' and movies' fields
  (age group, gender, occupation; genres, decade) as categorical ids, for
  ``MovieLensReader(side_features=...)``.
- ``load_click_log``: a click log of (user, item, clicked, timestamp) lines, implicit
  feedback for retrieval, in the ``MovieLensRatings`` form (clicks as the ratings).
- ``random_split``, ``k_fold``, ``leave_last_out``, ``temporal_split``: train / validation /
  test parts of a ratings set (disjoint, covering, deterministic by seed).
- ``DataFormatError`` (a malformed file, naming the line) and ``DataFileError`` (a file
  that cannot be read), both ``ValueError`` s.
- ``SyntheticClickLog``: Zipf ids over Criteo-like tables, jagged bags, labels from a
  hidden teacher model (``teacher_auc()`` is the ceiling), deterministic per seed.
- ``Batch``: ``(dense, sparse, labels, mask)``, a pytree of static shapes.
- ``Prefetcher``: prepares batches ahead on a background thread (with ``jax.device_put``).
"""

from jaxrec.data._batch import Batch, DataFileError, DataFormatError
from jaxrec.data._click_log import load_click_log
from jaxrec.data._criteo import (
    CRITEO_DENSE_KEYS,
    CRITEO_KAGGLE_CARDINALITIES,
    CRITEO_SPARSE_KEYS,
    CriteoReader,
    dense_log1p,
    dense_log_plus3,
)
from jaxrec.data._movielens import (
    MOVIELENS_100K_SPLITS,
    MOVIELENS_KEYS,
    MOVIELENS_RATING_RANGE,
    MovieLensRatings,
    MovieLensReader,
    load_movielens_ratings,
    movielens_100k_split,
    movielens_ids,
)
from jaxrec.data._movielens_side import (
    MOVIELENS_ITEM_FEATURES,
    MOVIELENS_USER_FEATURES,
    MovieLensSideFeatures,
    load_movielens_side_features,
)
from jaxrec.data._prefetch import Prefetcher
from jaxrec.data._splits import k_fold, leave_last_out, random_split, temporal_split
from jaxrec.data._synthetic import BagLengths, SyntheticClickLog, SyntheticSample

__all__ = [
    "CRITEO_DENSE_KEYS",
    "CRITEO_KAGGLE_CARDINALITIES",
    "CRITEO_SPARSE_KEYS",
    "MOVIELENS_100K_SPLITS",
    "MOVIELENS_ITEM_FEATURES",
    "MOVIELENS_KEYS",
    "MOVIELENS_RATING_RANGE",
    "MOVIELENS_USER_FEATURES",
    "BagLengths",
    "Batch",
    "CriteoReader",
    "DataFileError",
    "DataFormatError",
    "MovieLensRatings",
    "MovieLensReader",
    "MovieLensSideFeatures",
    "Prefetcher",
    "SyntheticClickLog",
    "SyntheticSample",
    "dense_log1p",
    "dense_log_plus3",
    "k_fold",
    "load_click_log",
    "leave_last_out",
    "load_movielens_ratings",
    "load_movielens_side_features",
    "movielens_100k_split",
    "movielens_ids",
    "random_split",
    "temporal_split",
]
