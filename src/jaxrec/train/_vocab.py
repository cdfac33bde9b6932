"""``jaxrec train --vocab``: how click data's categorical values become rows.

* ``modulo`` (default): each value is hashed modulo its table's rows (Criteo:
  ``int(hex, 16) % min(cardinality, max_rows)``); unrelated values share rows.
* ``dynamic``: each value is its own raw id (Criteo: ``int(hex, 16)``, an int64 id), and
  the 26 tables are dynamic vocabularies (``jaxrec.nn.DynamicVocab``, LRU eviction) of
  about the rows the modulo tables have (``dynamic_slots``): the same memory for the rows,
  plus the hash index. Training (``model.train()``) inserts new ids; evaluation
  (``model.eval()``) only looks them up, an unknown id pooling to zeros, and counts them.

Int64 ids need ``jax_enable_x64``, which ``ids_width`` turns on for the run (and back off
after it) before anything is created; the model still computes in float32, since every
parameter and input has an explicit float32 dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import numpy as np
from flax import nnx

from jaxrec.nn import DynamicVocab, EmbeddingBagCollection
from jaxrec.train._config import TrainConfig

BUCKET = 128  # HierarchicalKV's bucket: slots an id may take in its bucket
EVICTION = "lru"


def dynamic_slots(rows: int) -> tuple[int, int]:
    """``(slots, bucket_size)`` of the dynamic table that replaces a table of ``rows``:
    the rows rounded down to whole buckets of ``BUCKET`` (at most 127 fewer), or one bucket
    of ``BUCKET`` slots below it (a few KB more), so that every table has one bucket size
    and the 26 share one lookup group (``jaxrec.nn.dynamic``: a group per bucket size)."""
    return max(BUCKET, rows - rows % BUCKET), BUCKET


def dynamic_vocab(config: TrainConfig, rows: int) -> DynamicVocab | None:
    """The ``EmbeddingBagConfig.dynamic`` of a table of ``rows`` in this run (None: modulo)."""
    if config.vocab != "dynamic":
        return None
    return DynamicVocab(eviction=EVICTION, bucket_size=dynamic_slots(rows)[1])


@contextlib.contextmanager
def ids_width(config: TrainConfig) -> Iterator[None]:
    """64-bit JAX types for the run when its ids are raw (``--vocab dynamic``: int64 ids),
    restored after it, so that a process that calls ``train`` keeps its own setting."""
    before = jax.config.jax_enable_x64
    if config.vocab == "dynamic" and not before:
        jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        if jax.config.jax_enable_x64 != before:
            jax.config.update("jax_enable_x64", before)


def _collections(model: nnx.Module) -> list[EmbeddingBagCollection]:
    return [m for _, m in nnx.iter_modules(model)
            if isinstance(m, EmbeddingBagCollection) and any(g.dynamic for g in m.groups)]


def unknown_lookups(model: nnx.Module) -> int:
    """Ids that evaluations have looked up and the dynamic tables did not hold, so far."""
    return sum(int(s["unknown_lookups"]) for ebc in _collections(model)
               for s in ebc.dynamic_statistics().values())


def statistics(model: nnx.Module) -> dict | None:
    """The dynamic tables' statistics for metrics.json (None without dynamic tables):
    ``tables`` (per table: ``size``, ``slots``, ``load_factor``, ``inserted``, ``evicted``,
    ``failed_inserts``, ``unknown_lookups``, counted since the model was created, a resumed
    run's from its checkpoint on) and their ``total``, with ``index_bytes`` (the hash
    indices' memory, beside the rows')."""
    tables, index_bytes = {}, 0
    for ebc in _collections(model):
        slots = {t.name: t.num_embeddings for t in ebc.table_configs}
        for name, stats in ebc.dynamic_statistics().items():
            host = {k: v.item() for k, v in jax.device_get(stats).items()}
            tables[name] = {"slots": slots[name], **host}
        index_bytes += sum(leaf.nbytes for index in ebc.indices for leaf in jax.tree.leaves(index.get_value()))
    if not tables:
        return None
    summed = ("size", "slots", "inserted", "evicted", "failed_inserts", "unknown_lookups")
    total = {k: sum(t[k] for t in tables.values()) for k in summed}
    total["load_factor"] = total["size"] / total["slots"]
    return {"eviction": EVICTION, "total": {**total, "index_bytes": index_bytes}, "tables": tables}


def unknown_ids(batches, unknown: int) -> dict[str, int | float]:
    """``{ids, unknown_ids, unknown_share}``: ``unknown`` of the ids of ``batches`` (padding
    rows hold none) were unknown to the dynamic tables."""
    ids = sum(int(np.asarray(b.sparse.lengths()).sum()) for b in batches)
    return {"ids": ids, "unknown_ids": unknown, "unknown_share": unknown / max(ids, 1)}


def summary(stats: dict) -> str:
    """One line for the end of a run: the tables' fill and churn, and the test's unknown ids."""
    total = stats["total"]
    line = (f"dynamic tables ({len(stats['tables'])}, {stats['eviction']} eviction): "
            f"{total['size']:,} ids held in {total['slots']:,} slots (load {total['load_factor']:.3f}), "
            f"{total['inserted']:,} inserted, {total['evicted']:,} evicted, "
            f"{total['failed_inserts']:,} failed inserts")
    test = stats.get("test")
    if test:
        line += (f"; test: {test['unknown_ids']:,} of {test['ids']:,} ids unknown "
                 f"({test['unknown_share']:.1%}, looked up as zeros)")
    return line
