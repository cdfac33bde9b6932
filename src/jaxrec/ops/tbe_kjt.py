"""The TorchRec front door of the TBE lookup: a KeyedJaggedTensor in, TorchRec's outputs out.

A KJT's values, lengths and weights are already FBGEMM's layout (key-major bags),
so this is ``embedding_bag_lookup`` with the KJT's pieces::

    #              0       1        2  <-- batch
    # "user"       [V0,V1] None    [V2]       layout feature 0
    # "item"       [V3]    [V4]    [V5,V6,V7]  layout feature 1
    # offsets = [0, 2, 2, 3, 4, 5, 8]  ->  KeyedTensor(keys=["user", "item"], [3, D0 + D1])
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
    values = features.values()
    out = embedding_bag_lookup(
        weights, values, features.offsets().astype(values.dtype), layout=layout, pooling=pooling,
        per_sample_weights=features.weights_or_none(), output_dtype=output_dtype,
        bounds_check_mode=bounds_check_mode, backend=backend)
    if as_pooling_mode(pooling) != PoolingMode.NONE:
        return KeyedTensor(keys, list(layout.feature_dims), out)
    return split_sequence_embeddings(out, features)


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
