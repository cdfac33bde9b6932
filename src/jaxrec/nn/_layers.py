"""Dense building blocks of DLRM and DCN, with TorchRec's names and semantics."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx


class MLP(nnx.Module):
    """``Linear -> activation`` for each size in ``layer_sizes`` (TorchRec's ``MLP``: the
    activation follows every layer, the last one included). ``dtype``: the computation's
    (e.g. ``jnp.bfloat16`` for mixed precision; parameters stay float32), as in flax."""

    def __init__(self, in_size: int, layer_sizes: Sequence[int], *, bias: bool = True,
                 activation: Callable[[jax.Array], jax.Array] = jax.nn.relu, dtype=None,
                 rngs: nnx.Rngs):
        sizes = [in_size, *layer_sizes]
        self.layers = nnx.List([nnx.Linear(a, b, use_bias=bias, dtype=dtype, rngs=rngs)
                                for a, b in zip(sizes[:-1], sizes[1:])])
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = self.activation(layer(x))
        return x


class LowRankCrossNet(nnx.Module):
    """DCN-v2's cross network with low-rank weights (TorchRec's ``LowRankCrossNet``)::

        x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l,   V_l: in -> rank,  W_l: rank -> in

    ``dtype``: the computation's, as ``MLP``'s.
    """

    def __init__(self, in_features: int, num_layers: int, low_rank: int = 1, *, dtype=None,
                 rngs: nnx.Rngs):
        if num_layers < 1 or low_rank < 1:
            raise ValueError(f"LowRankCrossNet needs num_layers >= 1 and low_rank >= 1, got "
                             f"num_layers={num_layers}, low_rank={low_rank}")
        self.down = nnx.List([nnx.Linear(in_features, low_rank, use_bias=False, dtype=dtype, rngs=rngs)
                              for _ in range(num_layers)])
        self.up = nnx.List([nnx.Linear(low_rank, in_features, dtype=dtype, rngs=rngs)
                            for _ in range(num_layers)])

    def __call__(self, x0: jax.Array) -> jax.Array:
        x = x0
        for down, up in zip(self.down, self.up):
            x = x0 * up(down(x)) + x
        return x


def pairwise_dot_interaction(dense: jax.Array, sparse: jax.Array) -> jax.Array:
    """DLRM's interaction: ``dense`` [B, D] and ``sparse`` [B, F, D] -> [B, D + F(F+1)/2]:
    the dense input, then the dot products of every pair (i < j) among the F + 1 vectors."""
    combined = jnp.concatenate([dense[:, None, :], sparse], axis=1)
    gram = jnp.einsum("bid,bjd->bij", combined, combined)
    i, j = jnp.triu_indices(combined.shape[1], k=1)
    return jnp.concatenate([dense, gram[:, i, j]], axis=1)
