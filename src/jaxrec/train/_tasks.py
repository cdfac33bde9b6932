"""What a run trains: the data (train stream from any position, held-out batches), the model
and its loss, for click data (DLRM, DLRM_DCN) and ratings (matrix factorisation, two towers)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrec import data, metrics, optim
from jaxrec.models import DLRM, DLRM_DCN, TwoTower
from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig, TTConfig
from jaxrec.train._config import TABLE_OPTIMIZERS, TrainConfig

_EVAL_START = 1_000_000_000  # synthetic batches from here on are never trained on


@dataclasses.dataclass
class Task:
    model: nnx.Module
    loss_fn: Callable  # (model, batch) -> scalar
    predict: Callable  # (model, batch) -> [B] probabilities or ratings
    train_batches: Callable[[int], Iterator[data.Batch]]  # from a position (batches consumed)
    eval_batches: list[data.Batch]
    steps_per_epoch: int | None
    info: dict

    def evaluate(self, predict) -> dict[str, float]:
        labels, scores, masks = [], [], []
        for batch in self.eval_batches:
            scores.append(np.asarray(predict(self.model, batch)))
            labels.append(np.asarray(batch.labels))
            masks.append(np.asarray(batch.mask))
        y, s, w = (np.concatenate(x) for x in (labels, scores, masks))
        bad = ~np.isfinite(s) & (w > 0)
        if bad.any():  # a finite model whose values overflow in the forward pass
            raise FloatingPointError(f"{int(bad.sum())} of the held-out predictions are not "
                                     "finite (NaN or Inf)")
        if self.info["task"] == "ctr":
            return {"auc": metrics.auc(y, s, w), "log_loss": metrics.log_loss(y, s, w)}
        return {"rmse": metrics.rmse(y, s, w), "mae": metrics.mae(y, s, w)}


PRIMARY_METRIC = {"ctr": ("auc", max), "ratings": ("rmse", min)}
"""Per task, the held-out metric that ranks evaluations, and which end is best."""


def best_evaluation(task: str, evaluations: list[dict]) -> dict:
    """The evaluation (``{"step", metric: value, ...}``) best by the task's primary metric;
    the earliest among equals; ``{}`` before any."""
    name, pick = PRIMARY_METRIC[task]
    scored = [e for e in evaluations if e.get(name) is not None]
    if not scored:
        return {}
    best = pick(e[name] for e in scored)
    return next(e for e in scored if e[name] == best)


def build_task(config: TrainConfig) -> Task:
    if config.data_kind == "movielens":
        return _ratings_task(config)
    return _ctr_task(config)


def _collection(config: TrainConfig, keys, sizes, extra_columns: int = 0) -> EmbeddingBagCollection:
    optimizer = TABLE_OPTIMIZERS[config.table_optimizer]
    tt = _tt_config(config)
    dim = config.embedding_dim + extra_columns
    tables = [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=n, embedding_dim=dim,
                                 feature_names=[k], tt=tt if tt and n >= config.tt_min_rows else None)
              for k, n in zip(keys, sizes)]
    return EmbeddingBagCollection(
        tables, optimizer=None if optimizer is None else optimizer(
            learning_rate=config.table_learning_rate),
        rngs=nnx.Rngs(config.seed), backend=config.backend)


def _tt_config(config: TrainConfig) -> TTConfig | None:
    """TT tables' config: FBTT's fused SGD or Adagrad, whichever is closer to the tables'."""
    if not config.tt_ranks:
        return None
    fused = None
    if config.table_optimizer == "sgd":
        fused = optim.SGD(learning_rate=config.table_learning_rate)
    elif config.table_optimizer != "plain":
        fused = optim.Adagrad(learning_rate=config.table_learning_rate)
    return TTConfig(tt_ranks=config.tt_ranks, optimizer=fused)


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


def _passes(config: TrainConfig, one_pass: Callable[[int], Iterator], source: str) -> Iterator:
    """Passes over a file, chained: endless when the run is counted in steps, else
    ``epochs``; ``one_pass(number)`` from 0. A pass that yields nothing is an error:
    chaining endless empty passes would spin at 100% CPU forever."""
    for number in itertools.count(1) if config.steps else range(1, config.epochs + 1):
        empty = True
        for batch in one_pass(number - 1):
            empty = False
            yield batch
        if empty:
            raise ValueError(f"{source}: pass {number} over the data gave no training batch; "
                             "was the file changed or truncated during the run?")


def _masked_mean(losses, batch):
    return jnp.sum(losses * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


def _ctr_task(config: TrainConfig) -> Task:
    d, rngs = config.embedding_dim, nnx.Rngs(config.seed + 1)
    info = {"task": "ctr"}
    if config.data_kind == "synthetic":
        log = data.SyntheticClickLog(max_rows=config.max_rows, seed=config.seed)
        keys, sizes, num_dense = log.keys, log.table_sizes, log.num_dense
        info["teacher_auc"] = log.teacher_auc()

        def train_batches(position):
            return log.batches(config.batch_size, None, start=position)

        held_out = list(log.batches(config.batch_size, config.eval_batches, start=_EVAL_START))
        steps_per_epoch = None
    else:
        paths = _criteo_files(Path(config.data_path))
        sizes = tuple(min(n, config.max_rows) for n in data.CRITEO_KAGGLE_CARDINALITIES)
        reader = data.CriteoReader(paths, batch_size=config.batch_size,
                                   num_embeddings_per_feature=list(sizes))
        keys, num_dense = reader.keys, len(data.CRITEO_DENSE_KEYS)
        held_out = _held_out_criteo(reader, config)
        steps_per_epoch = None

        def one_pass(_):  # each pass skips the held-out batches
            return itertools.islice(iter(reader), config.eval_batches, None)

        def train_batches(position):
            return itertools.islice(_passes(config, one_pass, config.data_path), position, None)

        info["files"] = [str(p) for p in paths]
    ebc = _collection(config, keys, sizes)
    if config.model == "dlrm":
        model = DLRM(ebc, num_dense, [64, d], [64, 32, 1], rngs=rngs)
    else:
        model = DLRM_DCN(ebc, num_dense, [64, d], [64, 32, 1], dcn_num_layers=2,
                         dcn_low_rank_dim=16, rngs=rngs)

    def loss_fn(model, batch):
        logits = model(batch.dense, batch.sparse)[:, 0]
        return _masked_mean(optax.sigmoid_binary_cross_entropy(logits, batch.labels), batch)

    def predict(model, batch):
        return jax.nn.sigmoid(model(batch.dense, batch.sparse)[:, 0])

    info.update(keys=list(keys), table_sizes=list(sizes), table_memory=table_memory(ebc))
    return Task(model, loss_fn, predict, train_batches, held_out, steps_per_epoch, info)


def _criteo_files(path: Path) -> list[Path]:
    """A TSV file, or the files of a folder in name order (an empty folder is an error)."""
    if not path.is_dir():
        return [path]
    paths = sorted(p for p in path.iterdir() if p.is_file())
    if not paths:
        raise ValueError(f"criteo:{path} is a folder without files; pass a Criteo TSV file or "
                         "a folder of them (day_0, day_1, ...)")
    return paths


def _held_out_criteo(reader: data.CriteoReader, config: TrainConfig) -> list[data.Batch]:
    """The first ``eval_batches`` batches of the stream, held out (training reads the rest,
    so this works without knowing the stream's length). A file too small to leave at least
    one training row is an error saying how many rows it has and needs."""
    stream = iter(reader)
    try:
        held_out = list(itertools.islice(stream, config.eval_batches))
        trains = next(stream, None) is not None  # one batch more than held out
    finally:
        stream.close()
    if not trains:
        rows = sum(int(np.asarray(b.mask).sum()) for b in held_out)
        needed = config.eval_batches * config.batch_size
        raise ValueError(
            f"criteo:{config.data_path} holds {rows} rows; a run needs more than {needed} "
            f"(--eval-batches {config.eval_batches} x --batch-size {config.batch_size} held out "
            "for evaluation, then at least one row to train on): pass a smaller --batch-size "
            "or --eval-batches, or more data")
    return held_out


def _ratings_task(config: TrainConfig) -> Task:
    path = Path(config.data_path)
    if path.is_dir():
        train_path, test_path = data.movielens_100k_split(path, "u1")
        train, test = data.load_movielens_ratings(train_path), data.load_movielens_ratings(test_path)
    else:
        ratings = data.load_movielens_ratings(path)
        if len(ratings) < 10:
            raise ValueError(f"{path} holds {len(ratings)} ratings; a run needs at least 10 "
                             "(90% train, 10% test)")
        order = np.random.default_rng(config.seed).permutation(len(ratings))
        cut = len(ratings) - max(len(ratings) // 10, 1)
        train, test = (data.MovieLensRatings(*(f[idx] for f in ratings))
                       for idx in (order[:cut], order[cut:]))
    # Dense rows from the raw ids of both splits (a user keeps one row in each), at most
    # --max-rows per table (indices beyond it fold, as Criteo's hashed ids do).
    user_ids, item_ids = data.movielens_ids(train, test)
    common = dict(batch_size=config.batch_size, user_ids=user_ids, item_ids=item_ids,
                  max_rows=config.max_rows)
    reader = data.MovieLensReader(train, shuffle_seed=config.seed, last_batch="drop", **common)
    held_out = list(data.MovieLensReader(test, **common))
    keys, sizes = data.MOVIELENS_KEYS, (reader.num_users, reader.num_items)
    biased = config.model == "mf"  # biased MF: a bias column beside the factors
    ebc = _collection(config, keys, sizes, extra_columns=int(biased))
    layers = () if biased else (64, 32)
    model = TwoTower(ebc, [keys[0]], [keys[1]], layers, bias=float(train.ratings.mean()),
                     biased=biased, rngs=nnx.Rngs(config.seed + 1))

    def train_batches(position):
        return itertools.islice(_passes(config, reader.one_pass, str(path)), position, None)

    def loss_fn(model, batch):
        # L2 on the embeddings each rating uses (mf: its user's and item's rows), once per
        # rating: a row is pulled towards 0 as often as it is trained, as in SGD matrix
        # factorisation, so that rare users and items are not left to overfit.
        query, candidate = model.embed(batch.sparse)
        error = (model.score(query, candidate) - batch.labels) ** 2
        norms = jnp.sum(query ** 2, axis=1) + jnp.sum(candidate ** 2, axis=1)
        return _masked_mean(error + config.weight_decay * norms, batch)

    def predict(model, batch):  # a rating is on the star scale: clipping only helps RMSE
        return jnp.clip(model(batch.sparse), *data.MOVIELENS_RATING_RANGE)

    info = {"task": "ratings", "num_users": len(user_ids), "num_items": len(item_ids),
            "table_sizes": list(sizes), "train_ratings": len(train), "test_ratings": len(test)}
    return Task(model, loss_fn, predict, train_batches, held_out, len(reader), info)
