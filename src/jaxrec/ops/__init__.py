"""Functional ops: each is validation + an XLA FFI call + a pure-jnp reference, except
``top_k_retrieval``, whose kernels are XLA's own matmul and top-k."""

from jaxrec.ops.bounds_check import (
    BoundsCheckMode,
    BoundsCheckResult,
    bounds_check_indices,
    bounds_check_indices_reference,
)
from jaxrec.ops.retrieval import top_k_retrieval
from jaxrec.ops.tbe import embedding_bag_lookup
from jaxrec.ops.tbe_kjt import embedding_bag_lookup_kjt
from jaxrec.ops.tbe_layout import PoolingMode, TableLayout, init_weights
from jaxrec.ops.tbe_reference import embedding_bag_reference
from jaxrec.ops.tbe_sparse_grad import SparseRowGrad, embedding_bag_sparse_grad
from jaxrec.ops.tt_embedding import tt_embedding_bag
from jaxrec.ops.tt_init import WEIGHT_DISTS, init_tt_cores
from jaxrec.ops.tt_layout import TTLayout, suggested_tt_shapes
from jaxrec.ops.tt_reference import tt_embedding_bag_reference, tt_full_weight, tt_rows

__all__ = [
    "BoundsCheckMode",
    "BoundsCheckResult",
    "bounds_check_indices",
    "bounds_check_indices_reference",
    "PoolingMode",
    "SparseRowGrad",
    "TTLayout",
    "TableLayout",
    "WEIGHT_DISTS",
    "embedding_bag_lookup",
    "embedding_bag_lookup_kjt",
    "embedding_bag_reference",
    "embedding_bag_sparse_grad",
    "init_tt_cores",
    "init_weights",
    "suggested_tt_shapes",
    "top_k_retrieval",
    "tt_embedding_bag",
    "tt_embedding_bag_reference",
    "tt_full_weight",
    "tt_rows",
]
