"""What every task of ``jaxrec train`` is made of: the ``Task`` record, its table
collection, passes over a file and the masked mean of a loss (``_tasks.py`` builds the
click and ratings tasks, ``_retrieval.py`` the retrieval task)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrec import data, metrics, optim
from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig, TTConfig
from jaxrec.train import _vocab
from jaxrec.train._config import TABLE_OPTIMIZERS, TrainConfig
from jaxrec.train._processes import gather


@dataclasses.dataclass
class Task:
    model: nnx.Module
    loss_fn: Callable  # (model, batch) -> scalar
    predict: Callable  # (model, batch) -> [B] probabilities or ratings
    train_batches: Callable[[int], Iterator[data.Batch]]  # from a position (batches consumed)
    val_batches: list[data.Batch] | None  # None: no validation set (ratings, val_fraction 0)
    test_batches: list[data.Batch]
    steps_per_epoch: int | None
    info: dict

    def evaluate(self, predict, batches: list[data.Batch]) -> dict[str, float]:
        """The task's metrics of ``predict`` on ``batches`` (the masked rows only; with
        several processes, of every process's ``batches``)."""
        labels, scores, masks = [], [], []
        for batch in batches:
            scores.append(np.asarray(predict(self.model, batch)))
            labels.append(np.asarray(batch.labels))
            masks.append(np.asarray(batch.mask))
        # Every process's rows (several processes): the metrics are the whole set's.
        y, s, w = gather(*(np.concatenate(x) for x in (labels, scores, masks)))
        bad = ~np.isfinite(s) & (w > 0)
        if bad.any():  # a finite model whose values overflow in the forward pass
            raise FloatingPointError(f"{int(bad.sum())} of the held-out predictions are not "
                                     "finite (NaN or Inf)")
        if self.info["task"] == "ctr":
            return {"auc": metrics.auc(y, s, w), "log_loss": metrics.log_loss(y, s, w)}
        return {"rmse": metrics.rmse(y, s, w), "mae": metrics.mae(y, s, w)}


def collection(config: TrainConfig, keys, sizes, extra_columns: int = 0) -> EmbeddingBagCollection:
    """One table per key, of ``sizes`` rows (``--vocab dynamic``: a dynamic vocabulary of
    ``dynamic_slots(rows)``), TT-compressed from ``tt_min_rows`` rows with ``--tt-ranks``,
    in host memory with ``--placement host`` or ``host_cached`` (``placed``)."""
    optimizer = TABLE_OPTIMIZERS[config.table_optimizer]
    tt = tt_config(config)
    dim = config.embedding_dim + extra_columns
    tables = [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=table_rows(config, n), embedding_dim=dim,
                                 feature_names=[k], tt=tt if tt and n >= config.tt_min_rows else None,
                                 dynamic=_vocab.dynamic_vocab(config, n))
              for k, n in zip(keys, sizes)]
    tables = [placed(config, t) for t in tables]
    return EmbeddingBagCollection(
        tables, optimizer=None if optimizer is None else optimizer(
            learning_rate=config.table_learning_rate),
        rngs=nnx.Rngs(config.seed), backend=config.backend)


def placed(config: TrainConfig, table: EmbeddingBagConfig) -> EmbeddingBagConfig:
    """``table`` with ``--placement``'s placement where it is dense and large enough (one id
    a sample): ``host`` from two batches of ids of rows; ``host_cached`` where its cache
    would hold less than the table and at least two batches of ids (a batch's distinct ids
    must find cache rows). Else as it is, on the device."""
    if config.placement == "device" or table.tt is not None or table.dynamic is not None:
        return table
    if config.placement == "host":
        return dataclasses.replace(table, placement="host") if table.num_embeddings >= 2 * config.batch_size else table
    cached = dataclasses.replace(table, placement="host_cached", cache_load_factor=config.cache_load_factor)
    return cached if 2 * config.batch_size <= cached.cache_size() < table.num_embeddings else table


def table_rows(config: TrainConfig, rows: int) -> int:
    """The rows of the run's table for a table of ``rows`` (a dynamic table's slots)."""
    return _vocab.dynamic_slots(rows)[0] if config.vocab == "dynamic" else rows


def tt_config(config: TrainConfig) -> TTConfig | None:
    """TT tables' config: FBTT's fused SGD or Adagrad, whichever is closer to the tables'."""
    if not config.tt_ranks:
        return None
    fused = None
    if config.table_optimizer == "sgd":
        fused = optim.SGD(learning_rate=config.table_learning_rate)
    elif config.table_optimizer != "plain":
        fused = optim.Adagrad(learning_rate=config.table_learning_rate)
    return TTConfig(tt_ranks=config.tt_ranks, optimizer=fused)


def passes(config: TrainConfig, one_pass: Callable[[int], Iterator], source: str) -> Iterator:
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


def masked_mean(losses, batch):
    return jnp.sum(losses * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)
