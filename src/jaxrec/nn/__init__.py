"""Flax NNX modules over jaxrec's functional layers (TorchRec's vocabulary).

- ``EmbeddingBagConfig`` / ``EmbeddingConfig``: a table, its features, its initialiser.
- ``EmbeddingBagCollection``: ``KeyedJaggedTensor -> KeyedTensor`` of pooled embeddings.
- ``EmbeddingCollection``: ``KeyedJaggedTensor -> {feature: JaggedTensor}`` (one row per id).
  Both hold their tables as ``nnx.Param`` (plain: optax trains them) or as ``FusedTables``
  (fused: the optimizer runs inside the backward, in place).
- ``make_train_step``: one jitted, donating step for any model, unsharded or sharded
  (``jaxrec.parallel.shard``), with Flax's ``nnx.Optimizer(model, tx, wrt=nnx.Param)``
  training the parameters and the fused tables training themselves;
  ``set_learning_rate(model, rate)`` sets the fused tables' rate.
- ``TableCollection``: what every collection offers (weights and optimizer state in and
  out, the portable form); sharded collections and new table kinds implement it.
- ``TTEmbeddingBag``: FBTT's tensor-train compressed embedding bag; inside a collection,
  a table becomes TT with ``EmbeddingBagConfig(tt=TTConfig(...))``.
- ``DynamicVocab``: ``EmbeddingBagConfig(dynamic=DynamicVocab())`` takes raw ids, each
  given its own row by a hash table (docs/dynamic_vocab.md); ``jaxrec.nn.dynamic`` holds
  the tables' index and lookups, which ``jaxrec.parallel`` shares.
- ``MLP``, ``LowRankCrossNet``: the dense building blocks of DLRM and DCN.

Linen users: wrap a module with ``flax.nnx.bridge.to_linen`` (docs/nn.md).
"""

from jaxrec.nn._collection import TableCollection
from jaxrec.nn._configs import DynamicVocab, EmbeddingBagConfig, EmbeddingConfig, TTConfig
from jaxrec.nn._embedding_bag_collection import EmbeddingBagCollection
from jaxrec.nn._embedding_collection import EmbeddingCollection
from jaxrec.nn._fused_variable import FusedTables
from jaxrec.nn._layers import MLP, LowRankCrossNet
from jaxrec.nn._train import TrainStep, make_train_step, set_learning_rate
from jaxrec.nn._tt_embedding_bag import TTEmbeddingBag

__all__ = [
    "MLP",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "FusedTables",
    "LowRankCrossNet",
    "TTConfig",
    "DynamicVocab",
    "TableCollection",
    "TTEmbeddingBag",
    "TrainStep",
    "make_train_step",
    "set_learning_rate",
]
