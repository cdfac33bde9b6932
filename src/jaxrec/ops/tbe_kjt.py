"""The TorchRec front door of the TBE lookup: a KeyedJaggedTensor in, TorchRec's outputs out.

A KJT's values, lengths and weights are already FBGEMM's layout (key-major bags),
so this is ``embedding_bag_lookup`` with the KJT's pieces::

    #              0       1        2  <-- batch
    # "user"       [V0,V1] None    [V2]       layout feature 0
    # "item"       [V3]    [V4]    [V5,V6,V7]  layout feature 1
    # offsets = [0, 2, 2, 3, 4, 5, 8]  ->  KeyedTensor(keys=["user", "item"], [3, D0 + D1])

A variable-batch KJT (TorchRec's VBE: ``stride_per_key_per_rank`` and ``inverse_indices``)
is looked up with each key's bags padded by empty ones to the largest key's stride
(:func:`bag_offsets`: empty bags read no row), and the pooled ``[stride, D]`` output is
expanded to the full batch by the inverse indices (:func:`expand_variable_batch`): a key
with fewer bags than samples (a user's features, once per user) is looked up once per
bag, and its gradient is the sum over the samples that share the bag.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec.ops.bounds_check import BoundsCheckMode
from jaxrec.ops.tbe import embedding_bag_lookup
from jaxrec.ops.tbe_layout import PoolingMode, TableLayout, as_pooling_mode
from jaxrec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor


def embedding_bag_lookup_kjt(
    weights: jax.Array,
    features: KeyedJaggedTensor,
    *,
    layout: TableLayout,
    pooling: PoolingMode | int = PoolingMode.SUM,
    output_dtype=jnp.float32,
    bounds_check_mode: BoundsCheckMode | int | str = BoundsCheckMode.WARNING,
    backend: str = "auto",
) -> KeyedTensor | dict[str, JaggedTensor]:
    """Pooled embeddings as a ``KeyedTensor`` (SUM, MEAN), or per-key ``JaggedTensor``s of
    ``[capacity, dim]`` rows (NONE, TorchRec's ``EmbeddingCollection`` output).

    The KJT's keys are the layout's features, in order; its weights, if any, are the
    per-sample weights.
    """
    keys = list(features.keys())
    if len(keys) != layout.num_features:
        raise ValueError(f"the KeyedJaggedTensor has {len(keys)} keys {keys} but the layout has "
                         f"{layout.num_features} features; give one key per feature, in the "
                         "layout's feature order (permute() the KJT if needed)")
    check_variable_batch(features, pooling, "embedding_bag_lookup_kjt")
    out = embedding_bag_lookup(
        weights, features.values(), bag_offsets(features), layout=layout, pooling=pooling,
        per_sample_weights=features.weights_or_none(), output_dtype=output_dtype,
        bounds_check_mode=bounds_check_mode, backend=backend)
    if as_pooling_mode(pooling) != PoolingMode.NONE:
        out = expand_variable_batch(out, features, layout.feature_dims)
        return KeyedTensor(keys, list(layout.feature_dims), out)
    return split_sequence_embeddings(out, features)


def require_features(features: KeyedJaggedTensor, names, owner: str) -> None:
    """Raises a ValueError naming ``owner`` and the features of ``names`` the KJT lacks."""
    keys = list(features.keys())
    missing = [f for f in names if f not in keys]
    if missing:
        raise ValueError(f"the KeyedJaggedTensor lacks the features {missing} of {owner}; its keys are "
                         f"{keys}. Each table's feature_names must be keys of the input")


def features_in_order(features: KeyedJaggedTensor, names) -> KeyedJaggedTensor:
    """The KJT of ``names`` in that order (``features`` itself when it already is); it must
    hold them (``require_features``)."""
    keys = list(features.keys())
    order = [keys.index(f) for f in names]
    return features if order == list(range(len(keys))) else features.permute(order)


def check_variable_batch(features: KeyedJaggedTensor, pooling, who: str) -> None:
    """A variable-batch KJT needs pooling and its inverse indices (the full batch's samples)."""
    if not features.variable_stride_per_key():
        return
    if as_pooling_mode(pooling) == PoolingMode.NONE:
        raise ValueError(f"{who}: a variable-batch (VBE) KeyedJaggedTensor needs pooled tables (SUM or "
                         "MEAN); per-id embeddings (pooling NONE) take a KJT of one stride")
    if features.inverse_indices_or_none() is None:
        raise ValueError(f"{who}: a variable-batch (VBE) KeyedJaggedTensor needs inverse_indices to "
                         "expand each key's bags to the full batch; build it with inverse_indices=(keys, "
                         "int[num_keys, batch])")


def bag_offsets(features: KeyedJaggedTensor) -> jax.Array:
    """The lookup's offsets ``[T * stride + 1]`` (the values' dtype): the KJT's own, or for a
    variable batch each key's bags followed by empty ones up to the largest key's stride."""
    values = features.values()
    if not features.variable_stride_per_key():
        return features.offsets().astype(values.dtype)
    strides, stride = features.stride_per_key(), features.stride()
    starts = np.concatenate([[0], np.cumsum(strides)[:-1]]).astype(np.int64)
    slot = np.arange(stride)
    source = np.where(slot[None, :] < np.asarray(strides)[:, None], starts[:, None] + slot[None, :], -1)
    lengths = features.lengths()
    padded = jnp.where(source >= 0, lengths[np.maximum(source, 0)], 0) if lengths.size else jnp.zeros(source.shape)
    ends = jnp.cumsum(padded.reshape(-1).astype(values.dtype))
    return jnp.concatenate([jnp.zeros((1,), values.dtype), ends])


def expand_variable_batch(pooled: jax.Array, features: KeyedJaggedTensor, dims) -> jax.Array:
    """``[B, sum(dims)]``: each key's columns of the pooled ``[stride, sum(dims)]`` rows taken
    at its inverse indices (a KJT of one stride: ``pooled`` unchanged)."""
    if not features.variable_stride_per_key():
        return pooled
    _, inverse = features.inverse_indices()
    columns = np.concatenate([[0], np.cumsum(dims)]).astype(int)
    return jnp.concatenate([pooled[:, columns[k]:columns[k + 1]][inverse[k]] for k in range(len(dims))], axis=1)


def split_sequence_embeddings(out: jax.Array, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
    """The NONE-pooled ``[capacity, dim]`` rows of ``features`` as one ``JaggedTensor`` per key.

    Each key's rows move to the front of a capacity-sized block, zeros after its last id.
    """
    keys = list(features.keys())
    capacity = out.shape[0]
    padded = jnp.concatenate([out, jnp.zeros_like(out)])
    lengths = features.lengths().reshape(len(keys), features.stride())
    starts, counts = features.offset_per_key()[:-1], features.length_per_key()
    result = {}
    for k, key in enumerate(keys):
        rows = jax.lax.dynamic_slice_in_dim(padded, starts[k], capacity)
        rows = jnp.where((jnp.arange(capacity) < counts[k])[:, None], rows, 0)
        result[key] = JaggedTensor(rows, lengths=lengths[k])
    return result
