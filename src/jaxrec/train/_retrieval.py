"""``jaxrec train --task retrieval``: two towers trained on implicit feedback from ratings,
evaluated by exact top-K retrieval over every item.

Data. A rating of at least ``positive_threshold`` stars is a positive (user, item) pair;
the other ratings are dropped. A click log (``clicks:PATH``, ``jaxrec.data.load_click_log``)
is read the same way with the clicks as ratings and a threshold of 1: the clicks are the
positives, and an item only shown is still a candidate. The train / validation / test
parts are those of the ratings task (``ratings_splits``), positives only, so they are
disjoint. Ids are the table rows of the ratings task (every user and item of the file,
positive or not), so every item of the file is a candidate.

Features. ``user_id`` and ``item_id``; with ``side_features`` also the users' and movies'
fields (``jaxrec.data.load_movielens_side_features``), each its own table: the query
tower embeds ``user_*``, the candidate tower ``item_*`` (matrix factorisation sums a
side's embeddings, as LightFM does; towers concatenate them).

Training. Batches of training positives; ``softmax``: ``in_batch_softmax_loss`` with the
logQ correction, ``log q(item) = log(count(item) / positives)`` over the training
positives, and a batch's repeated items are not each other's negatives; ``bpr``:
``bpr_loss`` with the batch's candidates shifted by one row as the negatives (sampled by
popularity, as in-batch negatives are). ``weight_decay`` adds L2 on the rows each pair uses.

Evaluation (``HeldOut``). Each user with a held-out positive is a query: the user's
vector against every item's, ``top_k_retrieval`` (exact, chunked, on the device),
excluding the user's training positives (for the test set, its validation positives too).
From the top-K ids, per query: Recall@K, NDCG@K and HitRate@K as
``jaxrec.metrics.ranking_metrics`` defines them, and MRR@K, the reciprocal rank of the
first relevant item when it is in the top K, else 0 (the top K is all the evaluation
ranks). A held-out positive that is also excluded does not count (nor does a query left
without one). Ties rank by item row, lowest first, as in ``ranking_metrics``.

The popularity baseline (``info["popularity_test"]``): every user gets the items with the most
training positives, through the same evaluation (same exclusions and ties).
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrec import data
from jaxrec.models import TwoTower, bpr_loss, in_batch_softmax_loss
from jaxrec.ops import top_k_retrieval
from jaxrec.train._config import TrainConfig
from jaxrec.train._task_base import Task, collection, masked_mean, passes

_QUERIES_PER_CALL = 4096  # users retrieved per top_k_retrieval call (bounds the exclusions)


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """A held-out set of positives: per query (a user row), its relevant and excluded item
    rows, as sorted ``user * num_items + item`` codes (duplicates removed)."""

    users: np.ndarray  # int64[Q], the users with at least one relevant item left
    relevant: np.ndarray  # int64 codes
    exclude: np.ndarray  # int64 codes
    num_items: int

    @classmethod
    def build(cls, positives: np.ndarray, excluded: list[np.ndarray], num_items: int) -> HeldOut:
        """``positives`` and each of ``excluded``: int [n, 2] (user row, item row)."""
        def codes(pairs):
            return np.unique(pairs[:, 0].astype(np.int64) * num_items + pairs[:, 1])

        exclude = codes(np.concatenate(excluded)) if excluded else np.zeros(0, np.int64)
        relevant = codes(positives)
        relevant = relevant[~np.isin(relevant, exclude)]  # never credited, as ranking_metrics
        return cls(np.unique(relevant // num_items), relevant, exclude, num_items)

    def __len__(self) -> int:
        return len(self.users)


def evaluate(user_vectors, item_vectors, held_out: HeldOut, k: int) -> dict[str, float]:
    """``{"recall@k", "ndcg@k", "hit_rate@k", "mrr@k"}``, means over the queries of
    ``held_out`` (module doc); the vectors are ``[users, D]`` and ``[items, D]`` rows."""
    if len(held_out) == 0:
        raise ValueError("the held-out set has no user with a positive left to retrieve; "
                         "pass a lower --positive-threshold or more data")
    k = min(k, held_out.num_items)
    user_vectors = jnp.asarray(user_vectors)
    sums = np.zeros(4)
    ideal = np.cumsum(1.0 / np.log2(np.arange(2, k + 2)))
    for start in range(0, len(held_out), _QUERIES_PER_CALL):
        users = held_out.users[start:start + _QUERIES_PER_CALL]
        _, ids = top_k_retrieval(user_vectors[users], item_vectors, k,
                                 exclude=_padded(held_out.exclude, users, held_out.num_items))
        ids = np.asarray(ids, np.int64)
        hits = (ids >= 0) & np.isin(users[:, None] * held_out.num_items + ids, held_out.relevant)
        counts = _per_user(held_out.relevant, users, held_out.num_items)
        ranks = np.arange(1, k + 1)
        first = np.where(hits.any(1), np.argmax(hits, axis=1) + 1, np.inf)
        sums += [np.sum(hits.sum(1) / counts),
                 np.sum((hits / np.log2(ranks + 1)).sum(1) / ideal[np.minimum(counts, k) - 1]),
                 np.sum(hits.any(1)), np.sum(1.0 / first)]
    values = sums / len(held_out)
    return dict(zip((f"recall@{k}", f"ndcg@{k}", f"hit_rate@{k}", f"mrr@{k}"),
                    map(float, values)))


def _per_user(codes: np.ndarray, users: np.ndarray, num_items: int) -> np.ndarray:
    """The number of ``codes`` of each of ``users``."""
    owners = codes // num_items
    return np.searchsorted(owners, users, side="right") - np.searchsorted(owners, users)


def _padded(codes: np.ndarray, users: np.ndarray, num_items: int) -> np.ndarray:
    """``[len(users), E]`` item rows of ``codes`` per user, -1 padded; E a power of two
    (few distinct shapes, few compilations)."""
    owners = codes // num_items
    lo, hi = np.searchsorted(owners, users), np.searchsorted(owners, users, side="right")
    width = 1 << int(max(int((hi - lo).max(initial=0)), 1) - 1).bit_length()
    out = np.full((len(users), width), -1, np.int64)
    for row, (a, b) in enumerate(zip(lo, hi)):
        out[row, :b - a] = codes[a:b] % num_items
    return out.astype(np.int32)


def positive_pairs(ratings: data.MovieLensRatings, threshold: float) -> data.MovieLensRatings:
    """The ratings of at least ``threshold`` stars, in file order."""
    keep = ratings.ratings >= threshold
    return data.MovieLensRatings(*(field[keep] for field in ratings))


@dataclasses.dataclass
class RetrievalTask(Task):
    """Held-out sets are ``HeldOut`` positives; ``predict(model, every_row)`` gives every
    user's and item's vector, and ``evaluate`` retrieves the top ``top_k`` items."""

    every_row: data.Batch | None = None
    top_k: int = 10

    def evaluate(self, predict, held_out) -> dict[str, float]:
        users, items = predict(self.model, self.every_row)
        for name, x in (("user", users), ("item", items)):
            bad = int(np.sum(~np.isfinite(np.asarray(x)).all(1)))
            if bad:
                raise FloatingPointError(f"{bad} of the {name} vectors are not finite (NaN or Inf)")
        return evaluate(users, items, held_out, self.top_k)


def retrieval_task(config: TrainConfig, splits) -> RetrievalTask:
    """The ``Task`` of ``config`` (``task="retrieval"``) from the ratings ``splits``."""

    path = Path(config.data_path)
    user_ids, item_ids = data.movielens_ids(*[p for p in splits if p is not None])
    train, val, test = (None if p is None else positive_pairs(p, config.positive_threshold)
                        for p in splits)
    # What the positives are, and how to get more (a click log has no threshold to lower).
    if config.data_kind == "clicks":
        positives, lower, more = "clicks", "more clicks", "more data"
    else:
        positives = (f"ratings of at least --positive-threshold {config.positive_threshold:g} "
                     "stars")
        lower, more = "a lower --positive-threshold", "a lower --positive-threshold, or more data"
    if len(train) < config.batch_size:
        raise ValueError(
            f"{path}: {len(train)} training {positives}, fewer than one batch (--batch-size "
            f"{config.batch_size}): pass a smaller --batch-size or {lower}")
    side = None
    if config.side_features:
        side = data.load_movielens_side_features(path if path.is_dir() else path.parent)
    reader = data.MovieLensReader(train, batch_size=config.batch_size, user_ids=user_ids,
                                  item_ids=item_ids, max_rows=config.max_rows,
                                  shuffle_seed=config.seed, last_batch="drop", side_features=side)
    num_users, num_items = reader.num_users, reader.num_items
    if config.top_k > num_items:
        raise ValueError(f"--top-k {config.top_k} is more than the {num_items} items of "
                         f"{path}: pass a --top-k of at most {num_items}")

    rows = reader.rows  # (user row, item row) per rating, as the reader maps them
    train_rows = rows(train)
    val_rows = None if val is None or len(val) == 0 else rows(val)
    test_rows = rows(test) if len(test) else np.zeros((0, 2), np.int64)
    val_set = None if val is None else HeldOut.build(
        val_rows if val_rows is not None else np.zeros((0, 2), np.int64), [train_rows], num_items)
    excluded = [train_rows] + ([val_rows] if val_rows is not None else [])
    test_set = HeldOut.build(test_rows, excluded, num_items)
    for name, held in (("validation", val_set), ("test", test_set)):
        if held is not None and len(held) == 0:
            raise ValueError(f"{path}: the {name} set has no {positives} left to retrieve: "
                             f"pass {more}")

    counts = np.bincount(train_rows[:, 1], minlength=num_items)
    log_q = jnp.asarray(np.log(np.maximum(counts, 1) / counts.sum()), jnp.float32)
    keys = reader.keys  # user_id, item_id, then the side features
    sizes = [num_users, num_items] + [side.sizes[k] for k in keys[2:]]
    ebc = collection(config, keys, sizes)
    layers = () if config.model == "mf" else (64, 32)
    query = [k for k in keys if k.startswith("user_")]
    model = TwoTower(ebc, query, [k for k in keys if k not in query], layers,
                     rngs=nnx.Rngs(config.seed + 1))

    def train_batches(position):
        return itertools.islice(passes(config, reader.one_pass, str(path)), position, None)

    def loss_fn(model, batch):
        query, candidate = model.embed(batch.sparse)
        items = _item_rows(batch)
        if config.retrieval_loss == "softmax":
            loss = in_batch_softmax_loss(query, candidate, log_q=log_q[items], candidate_ids=items,
                                         mask=batch.mask, temperature=config.temperature)
        else:
            loss = bpr_loss(query, candidate, jnp.roll(candidate, 1, axis=0), mask=batch.mask)
        if not config.weight_decay:
            return loss
        norms = jnp.sum(query ** 2, axis=1) + jnp.sum(candidate ** 2, axis=1)
        return loss + config.weight_decay * masked_mean(norms, batch)

    every_row = reader.every_row()  # one batch: every user row and every item row

    def predict(model, batch):  # the towers' vectors of every user row and item row
        query, candidate = model.embed(batch.sparse)
        return query[:num_users], candidate[:num_items]

    popularity = evaluate(np.ones((num_users, 1), np.float32),
                          counts[:, None].astype(np.float32), test_set, config.top_k)
    info = {"task": "retrieval", "num_users": len(user_ids), "num_items": len(item_ids),
            "table_sizes": sizes, "features": list(keys),
            "positive_threshold": config.positive_threshold,
            "train_positives": len(train), "val_positives": 0 if val is None else len(val),
            "test_positives": len(test), "val_users": 0 if val_set is None else len(val_set),
            "test_users": len(test_set), "popularity_test": popularity}
    return RetrievalTask(model, loss_fn, predict, train_batches, val_set, test_set, len(reader),
                         info, every_row=every_row, top_k=config.top_k)


def _item_rows(batch) -> jax.Array:
    """The item row of each batch row (one id per bag; 0 in padding rows)."""
    bags = batch.sparse["item_id"]
    values, offsets = bags.values(), bags.offsets()
    return jnp.where(bags.lengths() > 0, values[jnp.minimum(offsets[:-1], values.shape[0] - 1)], 0)
