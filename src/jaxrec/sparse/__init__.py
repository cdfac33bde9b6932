"""TorchRec's jagged data types for JAX: pytrees with static shapes.

- ``JaggedTensor``: variable-length bags of one feature.
- ``KeyedJaggedTensor``: variable-length bags of several keys, key-major.
- ``KeyedTensor``: dense per-key blocks side by side (pooled embeddings).

Host-side constructors pad ``values`` to ``capacity_bucket(n)`` (next power of two,
minimum 8) unless ``capacity=`` is given, so that recompiles are rare.
"""

from jaxrec.sparse._capacity import MIN_CAPACITY, capacity_bucket
from jaxrec.sparse._jagged_tensor import JaggedTensor
from jaxrec.sparse._keyed_jagged_tensor import KeyedJaggedTensor
from jaxrec.sparse._keyed_tensor import KeyedTensor

__all__ = [
    "MIN_CAPACITY",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "capacity_bucket",
]
