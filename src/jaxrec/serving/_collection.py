"""``quantize``: a trained model's embedding tables as row-wise int8 / int4 (or fp16) tables.

::

    served, report = quantize(model, {"t_C1": "int4", "*": "int8"})
    logits = served(batch.dense, batch.sparse)          # the same interface, no training
    report.bytes_before, report.bytes_after             # float32 tables vs quantized

Every unsharded ``EmbeddingBagCollection`` of the model becomes a
``QuantizedEmbeddingBagCollection`` (TorchRec's ``quantize_embeddings`` of a trained
module): same features, pooling and output ``KeyedTensor``; its tables are read-only
rows of ``jaxrec.ops.quantized_rows`` (int8, int4), float16 ("fp16") or float32 ("fp32",
kept as it is). Precisions per table name, ``"*"`` for the rest.

The lookup is ``jaxrec.ops.quantized_lookup``: one launch per pooling mode for all the
collection's features, every table at its own precision, the rows dequantized as they
are read. An id outside its table reads row 0 (the collections' WARNING correction).
There is no gradient: a quantized table is for serving (``jax.grad`` through its lookup
raises a ``ValueError``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrec.nn import EmbeddingBagCollection
from jaxrec.ops import PoolingMode
from jaxrec.ops.quantized_lookup import PRECISION_BITS, quantized_lookup
from jaxrec.ops.quantized_rows import quantize_rows
from jaxrec.ops.tbe_kjt import features_in_order, require_features
from jaxrec.sparse import KeyedJaggedTensor, KeyedTensor

PRECISIONS = tuple(PRECISION_BITS)


class QuantizedTable(nnx.Variable):
    """A quantized table's rows (not a parameter: nothing trains it)."""


@dataclasses.dataclass(frozen=True)
class QuantizationReport:
    """What ``quantize`` did: per table, its precision and bytes before and after."""

    precisions: dict[str, str]
    bytes_before: int
    bytes_after: int
    tables: dict[str, tuple[int, int]]  # name -> (bytes before, bytes after)

    @property
    def ratio(self) -> float:
        return self.bytes_before / max(self.bytes_after, 1)


class QuantizedEmbeddingBagCollection(nnx.Module):
    """``EmbeddingBagCollection``'s lookup over quantized tables (module doc)."""

    def __init__(self, ebc: EmbeddingBagCollection, precisions: Mapping[str, str]):
        if getattr(ebc, "mesh", None) is not None:
            raise ValueError("quantize a sharded collection's portable state: load it into an "
                             "unsharded EmbeddingBagCollection first (jaxrec.parallel.load_portable_state)")
        self.configs = tuple(ebc.embedding_bag_configs())
        self.feature_names = tuple(f for t in self.configs for f in t.feature_names)
        weights = ebc.split_embedding_weights()
        self.precisions = {t.name: precisions[t.name] for t in self.configs}
        self.tables = nnx.data({t.name: QuantizedTable(jnp.asarray(_rows(t.name, weights[t.name],
                                                                         self.precisions[t.name])))
                                for t in self.configs})

    def __call__(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if features.inverse_indices_or_none() is not None:
            raise ValueError("a quantized collection takes a plain KJT; expand a variable-batch "
                             "KJT (inverse_indices) first")
        require_features(features, self.feature_names, type(self).__name__)
        columns = {}
        for pooling in dict.fromkeys(PoolingMode(t.pooling) for t in self.configs):
            group = [t for t in self.configs if PoolingMode(t.pooling) == pooling]
            names = [f for t in group for f in t.feature_names]
            kjt = features_in_order(features, names)
            values = kjt.values()
            pooled = quantized_lookup(
                [self.tables[t.name][...] for t in group], [self.precisions[t.name] for t in group],
                [j for j, t in enumerate(group) for _ in t.feature_names], values,
                kjt.offsets().astype(values.dtype), pooling=pooling, per_sample_weights=kjt.weights_or_none())
            if names == list(self.feature_names):
                return KeyedTensor(names, [t.embedding_dim for t in group for _ in t.feature_names], pooled)
            start = 0
            for t in group:
                for f in t.feature_names:
                    columns[f] = pooled[:, start:start + t.embedding_dim]
                    start += t.embedding_dim
        dims = [t.embedding_dim for t in self.configs for _ in t.feature_names]
        return KeyedTensor(list(self.feature_names), dims,
                           jnp.concatenate([columns[f] for f in self.feature_names], axis=1))


def _rows(name: str, weights, precision: str) -> np.ndarray:
    """Table ``name``'s rows at ``precision``: float32 or float16 rows, or quantized ones."""
    w = np.asarray(weights, np.float32)
    if precision == "fp32":
        return w
    if precision == "fp16":
        limit = float(np.finfo(np.float16).max)
        if not np.all(np.abs(w) <= limit):
            raise ValueError(f"table {name!r} holds values beyond float16's range ({limit:g}) or NaN: keep "
                             "it in fp32")
        return w.astype(np.float16)
    return quantize_rows(w, precision)


def quantize(model: nnx.Module, precisions: Mapping[str, str] | str = "int8"
             ) -> tuple[nnx.Module, QuantizationReport]:
    """``(served, report)``: a copy of ``model`` whose ``EmbeddingBagCollection`` s are
    quantized (module doc); ``precisions``: one for every table, or ``{table name: ...,
    "*": default}``. ``model`` itself is left as it is."""
    if isinstance(precisions, str):
        precisions = {"*": precisions}
    served = nnx.clone(model)
    found = [(path, m) for path, m in nnx.iter_modules(served) if isinstance(m, EmbeddingBagCollection)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no EmbeddingBagCollection to quantize")
    names = {t.name for _, m in found for t in m.embedding_bag_configs()}
    dynamic = sorted(t.name for _, m in found for t in m.embedding_bag_configs() if t.dynamic is not None)
    if dynamic:  # the served table would lose its id -> row index
        raise NotImplementedError(f"tables {dynamic} are dynamic vocabularies, which serving does not "
                                  "support yet (docs/dynamic_vocab.md)")
    unknown = sorted(set(precisions) - names - {"*"})
    if unknown:
        raise ValueError(f"precisions name tables {unknown} that the model lacks; its tables: {sorted(names)}")
    chosen = {n: precisions.get(n, precisions.get("*", "fp32")) for n in names}
    bad = {n: p for n, p in chosen.items() if p not in PRECISIONS}
    if bad:
        raise ValueError(f"precisions must be among {PRECISIONS}, got {bad}")
    tables, before, after = {}, 0, 0
    for path, ebc in found:
        quantized = QuantizedEmbeddingBagCollection(ebc, chosen)
        for t in quantized.configs:
            b = t.num_embeddings * t.embedding_dim * 4
            a = int(np.prod(quantized.tables[t.name].shape)) * quantized.tables[t.name].dtype.itemsize
            tables[t.name] = (b, a)
            before, after = before + b, after + a
        if not path:
            return quantized, QuantizationReport(chosen, before, after, tables)
        parent = served
        for key in path[:-1]:
            parent = parent[key] if isinstance(parent, (list, dict)) else getattr(parent, key)
        setattr(parent, path[-1], quantized)
    return served, QuantizationReport(chosen, before, after, tables)
