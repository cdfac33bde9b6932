"""``quantize``: a trained model's embedding tables as row-wise int8 / int4 tables.

::

    served, report = quantize(model, {"t_C1": "int4", "*": "int8"})
    logits = served(batch.dense, batch.sparse)          # the same interface, no training
    report.bytes_before, report.bytes_after             # float32 tables vs quantized

Every unsharded ``EmbeddingBagCollection`` of the model becomes a
``QuantizedEmbeddingBagCollection`` (TorchRec's ``quantize_embeddings`` of a trained
module): same features, pooling and output ``KeyedTensor``; its tables are read-only
``uint8`` rows (``jaxrec.serving._quantize``). Precisions per table name, ``"*"`` for the
rest; ``"fp32"`` keeps a table as it is (as float32 rows).

The lookup gathers each bag's rows, dequantizes only those, and pools them (SUM or MEAN,
per-sample weights applied), in jnp: the reference for the kernels to come. An id outside
its table reads row 0 (the collections' WARNING correction). There is no gradient: a
quantized table is for serving (``jax.grad`` through its lookup raises a ``ValueError``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrec.nn import EmbeddingBagCollection
from jaxrec.ops import PoolingMode
from jaxrec.ops.tbe_reference import bag_of_position, position_scale
from jaxrec.serving._quantize import BITS, dequantize_rows, quantize_rows
from jaxrec.sparse import KeyedJaggedTensor, KeyedTensor

PRECISIONS = ("fp32", *BITS)


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
        tables = {}
        for t in self.configs:
            w = np.asarray(weights[t.name], np.float32)
            rows = w if self.precisions[t.name] == "fp32" else quantize_rows(w, self.precisions[t.name])
            tables[t.name] = QuantizedTable(jnp.asarray(rows))
        self.tables = nnx.data(tables)

    def __call__(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if features.inverse_indices_or_none() is not None:
            raise ValueError("a quantized collection takes a plain KJT; expand a variable-batch "
                             "KJT (inverse_indices) first")
        blocks = []
        for t in self.configs:
            table, precision = self.tables[t.name][...], self.precisions[t.name]
            for f in t.feature_names:
                blocks.append(_pooled(features[f], table, precision, t.num_embeddings,
                                      PoolingMode(t.pooling), features.stride()))
        dims = [t.embedding_dim for t in self.configs for _ in t.feature_names]
        return KeyedTensor(list(self.feature_names), dims, jnp.concatenate(blocks, axis=1))


def _pooled(bags, table, precision: str, rows: int, pooling: PoolingMode, batch: int) -> jax.Array:
    """``[batch, dim]`` float32: each bag's rows dequantized and pooled."""
    ids, offsets = bags.values(), bags.offsets()
    bag = bag_of_position(offsets, ids.shape[0])  # the KJT's static capacity pads the values
    scale = position_scale(offsets, bags.weights_or_none(), bag, pooling)  # 0 outside bags
    ids = jnp.where((ids >= 0) & (ids < rows), ids, 0)
    gathered = jnp.take(table, ids, axis=0)
    vectors = gathered if precision == "fp32" else dequantize_rows(gathered, precision)
    segment = jnp.where((bag >= 0) & (bag < batch), bag, batch)
    pooled = jax.ops.segment_sum(_no_gradient(vectors * scale[:, None]), segment, num_segments=batch + 1)
    return pooled[:batch]


@jax.custom_vjp
def _no_gradient(x):
    return x


def _no_gradient_fwd(x):
    return x, None


def _no_gradient_bwd(_, g):
    raise ValueError("a quantized embedding table has no gradient: it is for serving. Train the "
                     "float model (EmbeddingBagCollection) and quantize it again")


_no_gradient.defvjp(_no_gradient_fwd, _no_gradient_bwd)


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
