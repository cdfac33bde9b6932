"""A two-tower model (matrix factorisation when the towers are empty) for ratings or retrieval::

    query features  --EBC--> [B, Dq] --query MLP-->     q [B, H] --+
                                                                     +--> <q, c> + bias --> [B]
    candidate feats --EBC--> [B, Dc] --candidate MLP--> c [B, H] --+

With ``layer_sizes=()`` the towers are the identity and the score is the dot product of
the pooled embeddings, i.e. matrix factorisation: a side with several features (an id and
side features) is the sum of their embeddings, as in LightFM, so every feature needs the
same width. With towers, a side's embeddings are concatenated into its MLP. The towers'
last layer has no activation, so scores can be negative.

``biased=True`` is biased matrix factorisation (Koren's SVD baseline + factors): the last
column of each side's pooled embedding is that user's or item's bias, and the score is
``global + b_u + b_i + <p_u, q_i>`` over the other columns. The biases live in the same
rows as the factors, so one lookup per side trains both and the fused optimizer (with its
weight decay) treats them alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrec.models._dlrm import OverArch
from jaxrec.nn import EmbeddingBagCollection
from jaxrec.sparse import KeyedJaggedTensor


class TwoTower(nnx.Module):
    """``model(sparse) -> [B]`` scores from one ``EmbeddingBagCollection``.

    Args:
      embedding_bag_collection: tables of both towers.
      query_features, candidate_features: the feature names of each tower.
      layer_sizes: each tower's MLP (the last size is the shared output width); ``()`` for
        matrix factorisation.
      bias: the initial value of a learned global offset (e.g. the mean rating).
      biased: the last embedding column of each side is a per-user / per-item bias (module
        doc); needs ``layer_sizes=()``.
    """

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection,
                 query_features: Sequence[str], candidate_features: Sequence[str],
                 layer_sizes: Sequence[int] = (), *, bias: float = 0.0, biased: bool = False,
                 rngs: nnx.Rngs):
        dims = {f: t.embedding_dim for t in embedding_bag_collection.embedding_bag_configs()
                for f in t.feature_names}
        unknown = [f for f in [*query_features, *candidate_features] if f not in dims]
        if unknown or not query_features or not candidate_features:
            raise ValueError(f"query_features and candidate_features must be non-empty lists of "
                             f"the collection's features {list(dims)}; unknown: {unknown}")
        self.sparse_arch = embedding_bag_collection
        self.query_features = tuple(query_features)
        self.candidate_features = tuple(candidate_features)
        widths = [sum(dims[f] for f in fs) for fs in (self.query_features, self.candidate_features)]
        if layer_sizes:
            self.query_tower = OverArch(widths[0], layer_sizes, rngs=rngs)
            self.candidate_tower = OverArch(widths[1], layer_sizes, rngs=rngs)
        elif len({dims[f] for f in [*self.query_features, *self.candidate_features]}) != 1:
            raise ValueError("without towers (layer_sizes=()) every feature's embedding needs one "
                             "width (a side is their sum), got "
                             f"{ {f: dims[f] for f in [*self.query_features, *self.candidate_features]} }")
        else:
            self.query_tower = self.candidate_tower = None
            widths = [dims[self.query_features[0]]] * 2
        if biased and (layer_sizes or widths[0] < 2):
            raise ValueError("biased=True needs layer_sizes=() (matrix factorisation) and "
                             f"embeddings of at least 2 columns (factors + bias), got layer_sizes="
                             f"{tuple(layer_sizes)} and width {widths[0]}")
        self.biased = biased
        self.bias = nnx.Param(jnp.asarray(bias, jnp.float32))

    def __call__(self, sparse_features: KeyedJaggedTensor) -> jax.Array:
        return self.score(*self.embed(sparse_features))

    def score(self, query: jax.Array, candidate: jax.Array) -> jax.Array:
        """The predicted rating ``[B]`` from ``embed``'s outputs (for a loss that also
        regularises them: a fused table may be looked up once per step)."""
        if self.biased:  # factors | bias on each side
            return (jnp.sum(query[:, :-1] * candidate[:, :-1], axis=1) + query[:, -1]
                    + candidate[:, -1] + self.bias[...])
        return jnp.sum(query * candidate, axis=1) + self.bias[...]

    def embed(self, sparse_features: KeyedJaggedTensor) -> tuple[jax.Array, jax.Array]:
        """The towers' outputs ``(query [B, H], candidate [B, H])``: for retrieval losses
        over the batch (``in_batch_softmax_loss``) and for indexing the candidates
        (``jaxrec.ops.top_k_retrieval``)."""
        pooled = self.sparse_arch(sparse_features)
        if self.query_tower is None:  # matrix factorisation: a side is the sum of its features
            return (sum(pooled[f] for f in self.query_features),
                    sum(pooled[f] for f in self.candidate_features))
        query = jnp.concatenate([pooled[f] for f in self.query_features], axis=1)
        candidate = jnp.concatenate([pooled[f] for f in self.candidate_features], axis=1)
        return self.query_tower(query), self.candidate_tower(candidate)
