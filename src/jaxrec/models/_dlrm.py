"""DLRM and DLRM-DCNv2 (TorchRec's ``DLRM`` / ``DLRM_DCN``)::

    dense [B, 13] --DenseArch (MLP)--> [B, D] ----------+
                                                         +--> InteractionArch --> OverArch --> logit [B, 1]
    sparse KJT --EmbeddingBagCollection--> [B, F, D] ---+

DLRM's interaction is the dense vector plus the pairwise dot products of all F + 1
vectors; DLRM_DCN's is a low-rank cross network over their concatenation [B, (F + 1) D].
Every table of the collection must have the dense arch's output dim D.

``dtype=jnp.bfloat16`` runs the MLPs, the interaction and the cross network in bfloat16
(mixed precision: parameters, their gradients and optax stay float32; the pooled
embeddings are cast to it; the logits come back float32), flax's ``dtype`` convention.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrec.nn import MLP, EmbeddingBagCollection, LowRankCrossNet
from jaxrec.nn._layers import pairwise_dot_interaction
from jaxrec.sparse import KeyedJaggedTensor


class OverArch(nnx.Module):
    """``MLP(layer_sizes[:-1])`` then a final ``Linear`` without activation (the logits)."""

    def __init__(self, in_features: int, layer_sizes: Sequence[int], *, dtype=None, rngs: nnx.Rngs):
        if len(layer_sizes) < 1:
            raise ValueError("over_arch_layer_sizes needs at least one size (the output's)")
        self.mlp = MLP(in_features, layer_sizes[:-1], dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(([in_features] + list(layer_sizes))[-2], layer_sizes[-1], dtype=dtype,
                              rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.mlp(x))


def _sparse_dim(ebc: EmbeddingBagCollection, dense_dim: int) -> int:
    dims = sorted({t.embedding_dim for t in ebc.embedding_bag_configs()})
    if dims != [dense_dim]:
        raise ValueError(f"every table needs embedding_dim == dense_arch_layer_sizes[-1] == "
                         f"{dense_dim}, got dims {dims}")
    return dense_dim


class DLRM(nnx.Module):
    """DLRM: bottom MLP, pairwise dot interaction, top MLP. ``model(dense, sparse) -> [B, 1]``.

    Args:
      embedding_bag_collection: the sparse arch (plain or fused tables).
      dense_in_features: dense features per sample (13 for Criteo).
      dense_arch_layer_sizes: bottom MLP; the last size is the embedding dim D.
      over_arch_layer_sizes: top MLP; the last size is the number of logits (1).
      dtype: the dense part's computation dtype (module doc); None: float32.
    """

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection, dense_in_features: int,
                 dense_arch_layer_sizes: Sequence[int], over_arch_layer_sizes: Sequence[int], *,
                 dtype=None, rngs: nnx.Rngs):
        dim = _sparse_dim(embedding_bag_collection, dense_arch_layer_sizes[-1])
        num_features = len(embedding_bag_collection.feature_names)
        self.sparse_arch = embedding_bag_collection
        self.dense_arch = MLP(dense_in_features, dense_arch_layer_sizes, dtype=dtype, rngs=rngs)
        self.over_arch = OverArch(dim + num_features * (num_features + 1) // 2,
                                  over_arch_layer_sizes, dtype=dtype, rngs=rngs)

    def interact(self, dense: jax.Array, sparse: jax.Array) -> jax.Array:
        return pairwise_dot_interaction(dense, sparse)

    def __call__(self, dense_features: jax.Array, sparse_features: KeyedJaggedTensor) -> jax.Array:
        dense = self.dense_arch(dense_features)
        pooled = self.sparse_arch(sparse_features).values().astype(dense.dtype)
        sparse = pooled.reshape(pooled.shape[0], -1, dense.shape[1])
        return self.over_arch(self.interact(dense, sparse)).astype(jnp.float32)


class DLRM_DCN(DLRM):  # noqa: N801 (TorchRec's name)
    """DLRM with DCN-v2's low-rank cross network as the interaction (TorchRec's ``DLRM_DCN``).

    Extra args: ``dcn_num_layers`` and ``dcn_low_rank_dim`` of the ``LowRankCrossNet``.
    """

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection, dense_in_features: int,
                 dense_arch_layer_sizes: Sequence[int], over_arch_layer_sizes: Sequence[int], *,
                 dcn_num_layers: int = 3, dcn_low_rank_dim: int = 512, dtype=None, rngs: nnx.Rngs):
        dim = _sparse_dim(embedding_bag_collection, dense_arch_layer_sizes[-1])
        width = dim * (len(embedding_bag_collection.feature_names) + 1)
        self.sparse_arch = embedding_bag_collection
        self.dense_arch = MLP(dense_in_features, dense_arch_layer_sizes, dtype=dtype, rngs=rngs)
        self.crossnet = LowRankCrossNet(width, dcn_num_layers, dcn_low_rank_dim, dtype=dtype, rngs=rngs)
        self.over_arch = OverArch(width, over_arch_layer_sizes, dtype=dtype, rngs=rngs)

    def interact(self, dense: jax.Array, sparse: jax.Array) -> jax.Array:
        flat = jnp.concatenate([dense, sparse.reshape(sparse.shape[0], -1)], axis=1)
        return self.crossnet(flat)
