"""What a run trains: the data (train stream from any position, validation and test batches),
the model and its loss, for click data (DLRM, DLRM_DCN), ratings (matrix factorisation,
two towers) and retrieval from ratings (two towers; ``_retrieval.py``).

The three sets are disjoint. Ratings: the test split (ML-100K's ``u1.test``, or a seeded
10% of a ratings file), then ``val_fraction`` of the remaining ratings, drawn by seed
(``ratings_splits``). Click data: ``eval_batches`` test batches, then as many validation
batches (synthetic: batches from far-off positions; Criteo: the first batches of the
stream, which training skips). With several processes (``_processes.py``) each process
holds its share of every batch and set.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrec import data
from jaxrec.models import DLRM, DLRM_DCN, TwoTower
from jaxrec.nn import EmbeddingBagCollection
from jaxrec.train import _processes
from jaxrec.train._config import TrainConfig
from jaxrec.train._processes import data_shard
from jaxrec.train._retrieval import retrieval_task
from jaxrec.train._task_base import Task, collection, masked_mean, passes, table_rows

_TEST_START = 1_000_000_000  # synthetic batches from here on are never trained on
_VAL_START = 2_000_000_000


PRIMARY_METRIC = {"ctr": ("auc", max), "ratings": ("rmse", min), "retrieval": ("recall@", max)}
"""Per task, the held-out metric that ranks evaluations (a name ending in ``@``: the one
metric of that name with any K, e.g. ``recall@10``), and which end is best."""


def best_evaluation(task: str, evaluations: list[dict]) -> dict:
    """The evaluation (``{"step", metric: value, ...}``) best by the task's primary metric;
    the earliest among equals; ``{}`` before any."""
    name, pick = PRIMARY_METRIC[task]
    scored = [(e, v) for e in evaluations if (v := _primary(name, e)) is not None]
    if not scored:
        return {}
    best = pick(v for _, v in scored)
    return next(e for e, v in scored if v == best)


def _primary(name: str, evaluation: dict) -> float | None:
    if not name.endswith("@"):
        return evaluation.get(name)
    return next((v for k, v in evaluation.items() if k.startswith(name)), None)


def evaluations_since_best(task: str, evaluations: list[dict]) -> int:
    """How many evaluations came after the best one (all of them before any is scored):
    early stopping's count, read from the curve so that a resumed run continues it."""
    best = best_evaluation(task, evaluations)
    return sum(1 for e in evaluations if not best or e["step"] > best["step"])


def build_task(config: TrainConfig) -> Task:
    if config.task == "retrieval":
        return retrieval_task(config, ratings_splits(config))
    if config.data_kind == "movielens":
        return _ratings_task(config)
    return _ctr_task(config)


def table_memory(ebc: EmbeddingBagCollection) -> dict[str, int]:
    """Floats of the tables as trained (TT cores for TT tables) and as dense matrices."""
    dense = sum(t.num_embeddings * t.embedding_dim for t in ebc.table_configs)
    stored = sum(t.tt_layout().num_parameters if t.tt else t.num_embeddings * t.embedding_dim
                 for t in ebc.table_configs)
    tt_dense = sum(t.num_embeddings * t.embedding_dim for t in ebc.table_configs if t.tt)
    tt_stored = sum(t.tt_layout().num_parameters for t in ebc.table_configs if t.tt)
    return {"dense_floats": dense, "stored_floats": stored, "tt_tables": sum(
        1 for t in ebc.table_configs if t.tt), "tt_tables_dense_floats": tt_dense,
        "tt_tables_stored_floats": tt_stored}


def _ctr_task(config: TrainConfig) -> Task:
    d, rngs = config.embedding_dim, nnx.Rngs(config.seed + 1)
    info = {"task": "ctr"}
    if config.data_kind == "synthetic":
        log = data.SyntheticClickLog(max_rows=config.max_rows, seed=config.seed)
        keys, sizes, num_dense = log.keys, log.table_sizes, log.num_dense
        info["teacher_auc"] = log.teacher_auc()

        def train_batches(position):
            return log.batches(config.batch_size, None, start=position, shard=data_shard())

        test = list(log.batches(config.batch_size, config.eval_batches, start=_TEST_START,
                                shard=data_shard()))
        val = list(log.batches(config.batch_size, config.eval_batches, start=_VAL_START,
                               shard=data_shard()))
        steps_per_epoch = None
    else:
        paths = _criteo_files(Path(config.data_path))
        sizes = tuple(min(n, config.max_rows) for n in data.CRITEO_KAGGLE_CARDINALITIES)
        share = data_shard()
        # dynamic tables take the values themselves (int64 ids), modulo tables their hashes
        ids = dict(ids="raw") if config.vocab == "dynamic" else dict(
            num_embeddings_per_feature=list(sizes))
        reader = data.CriteoReader(paths, batch_size=config.batch_size // share[1], shard=share, **ids)
        keys, num_dense = reader.keys, len(data.CRITEO_DENSE_KEYS)
        test, val = _held_out_criteo(reader, config)
        steps_per_epoch = None

        def one_pass(_):  # each pass skips the held-out batches
            return itertools.islice(iter(reader), 2 * config.eval_batches, None)

        if share[1] > 1 and config.epochs:  # every process's pass as long as the longest
            one_pass = _processes.equal_passes(one_pass, reader, 2 * config.eval_batches)

        def train_batches(position):
            return itertools.islice(passes(config, one_pass, config.data_path), position, None)

        info["files"] = [str(p) for p in paths]
    ebc = collection(config, keys, sizes)
    if config.model == "dlrm":
        model = DLRM(ebc, num_dense, [64, d], [64, 32, 1], rngs=rngs)
    else:
        model = DLRM_DCN(ebc, num_dense, [64, d], [64, 32, 1], dcn_num_layers=2,
                         dcn_low_rank_dim=16, rngs=rngs)

    def loss_fn(model, batch):
        logits = model(batch.dense, batch.sparse)[:, 0]
        return masked_mean(optax.sigmoid_binary_cross_entropy(logits, batch.labels), batch)

    def predict(model, batch):
        return jax.nn.sigmoid(model(batch.dense, batch.sparse)[:, 0])

    info.update(keys=list(keys), table_sizes=[table_rows(config, n) for n in sizes],
                table_memory=table_memory(ebc))
    return Task(model, loss_fn, predict, train_batches, val, test, steps_per_epoch, info)


def _criteo_files(path: Path) -> list[Path]:
    """A TSV file, or the files of a folder in name order (an empty folder is an error)."""
    if not path.is_dir():
        return [path]
    paths = sorted(p for p in path.iterdir() if p.is_file())
    if not paths:
        raise ValueError(f"criteo:{path} is a folder without files; pass a Criteo TSV file or "
                         "a folder of them (day_0, day_1, ...)")
    return paths


def _held_out_criteo(reader: data.CriteoReader,
                     config: TrainConfig) -> tuple[list[data.Batch], list[data.Batch]]:
    """``(test, validation)``: the first ``eval_batches`` batches of the stream, then the
    next ``eval_batches``, held out (training reads the rest, so this works without knowing
    the stream's length). A file too small to leave at least one training row is an error
    saying how many rows it has and needs."""
    stream = iter(reader)
    try:
        held_out = list(itertools.islice(stream, 2 * config.eval_batches))
        trains = next(stream, None) is not None  # one batch more than held out
    finally:
        stream.close()
    if not trains:
        rows = sum(int(np.asarray(b.mask).sum()) for b in held_out)
        k, n = reader.shard
        needed = 2 * config.eval_batches * reader.batch_size
        where = f"criteo:{config.data_path}" + (f" (process {k}'s share of {n})" if n > 1 else "")
        per_process = f" / {n} processes" if n > 1 else ""
        raise ValueError(
            f"{where} holds {rows} rows; a run needs more than {needed} (2 x --eval-batches "
            f"{config.eval_batches} x --batch-size {config.batch_size}{per_process} held out for "
            "testing and validation, then at least one row to train on): pass a smaller "
            "--batch-size or --eval-batches, or more data")
    return held_out[:config.eval_batches], held_out[config.eval_batches:]


def ratings_splits(config: TrainConfig) -> tuple[data.MovieLensRatings, data.MovieLensRatings
                                                  | None, data.MovieLensRatings]:
    """``(train, validation, test)`` of a ``movielens:PATH`` or ``clicks:PATH`` run (a click
    log's clicks in place of the ratings), disjoint, together every line once; validation is
    None when ``val_fraction`` is 0.

    The test split does not depend on ``val_fraction``: ML-100K's ``u1.test``, or, for a
    ratings file, a permutation by ``seed`` whose last 10% are the test split. Validation is
    ``val_fraction`` of the rest (rounded, at least one rating), drawn by a second
    permutation by ``seed``; every part keeps file order.
    """
    path = Path(config.data_path)
    load = data.load_click_log if config.data_kind == "clicks" else data.load_movielens_ratings
    if path.is_dir() and config.data_kind == "movielens":
        train_path, test_path = data.movielens_100k_split(path, "u1")
        train, test = data.load_movielens_ratings(train_path), data.load_movielens_ratings(test_path)
    else:
        ratings = load(path)
        if len(ratings) < 10:
            raise ValueError(f"{path} holds {len(ratings)} ratings; a run needs at least 10 "
                             "(90% train, 10% test)")
        order = np.random.default_rng(config.seed).permutation(len(ratings))
        cut = len(ratings) - max(len(ratings) // 10, 1)
        train, test = (_take(ratings, idx) for idx in (order[:cut], order[cut:]))
    if not config.val_fraction:
        return train, None, test
    n = len(train)
    size = max(round(config.val_fraction * n), 1)
    if size >= n:
        raise ValueError(f"{path}: --val-fraction {config.val_fraction} of its {n} training "
                         "ratings leaves none to train on; pass a smaller --val-fraction, or 0")
    order = np.random.default_rng([config.seed, 1]).permutation(n)
    return _take(train, order[size:]), _take(train, order[:size]), test


def _take(ratings: data.MovieLensRatings, rows: np.ndarray) -> data.MovieLensRatings:
    rows = np.sort(rows)  # file order
    return data.MovieLensRatings(*(field[rows] for field in ratings))


def _ratings_task(config: TrainConfig) -> Task:
    path = Path(config.data_path)
    train, val, test = ratings_splits(config)
    # Dense rows from the raw ids of all splits (a user keeps one row in each), at most
    # --max-rows per table (indices beyond it fold, as Criteo's hashed ids do).
    parts = [p for p in (train, val, test) if p is not None]
    user_ids, item_ids = data.movielens_ids(*parts)
    common = dict(batch_size=config.batch_size, user_ids=user_ids, item_ids=item_ids,
                  max_rows=config.max_rows)
    reader = data.MovieLensReader(train, shuffle_seed=config.seed, last_batch="drop", **common)
    test_batches = list(data.MovieLensReader(test, **common))
    val_batches = None if val is None else list(data.MovieLensReader(val, **common))
    keys, sizes = data.MOVIELENS_KEYS, (reader.num_users, reader.num_items)
    biased = config.model == "mf"  # biased MF: a bias column beside the factors
    ebc = collection(config, keys, sizes, extra_columns=int(biased))
    layers = () if biased else (64, 32)
    model = TwoTower(ebc, [keys[0]], [keys[1]], layers, bias=float(train.ratings.mean()),
                     biased=biased, rngs=nnx.Rngs(config.seed + 1))

    def train_batches(position):
        return itertools.islice(passes(config, reader.one_pass, str(path)), position, None)

    def loss_fn(model, batch):
        # L2 on the embeddings each rating uses (mf: its user's and item's rows), once per
        # rating: a row is pulled towards 0 as often as it is trained, as in SGD matrix
        # factorisation, so that rare users and items are not left to overfit.
        query, candidate = model.embed(batch.sparse)
        error = (model.score(query, candidate) - batch.labels) ** 2
        norms = jnp.sum(query ** 2, axis=1) + jnp.sum(candidate ** 2, axis=1)
        return masked_mean(error + config.weight_decay * norms, batch)

    def predict(model, batch):  # a rating is on the star scale: clipping only helps RMSE
        return jnp.clip(model(batch.sparse), *data.MOVIELENS_RATING_RANGE)

    info = {"task": "ratings", "num_users": len(user_ids), "num_items": len(item_ids),
            "table_sizes": list(sizes), "train_ratings": len(train),
            "val_ratings": 0 if val is None else len(val), "test_ratings": len(test)}
    return Task(model, loss_fn, predict, train_batches, val_batches, test_batches, len(reader),
                info)
