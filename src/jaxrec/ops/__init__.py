"""Functional ops: each is validation + an XLA FFI call + a pure-jnp reference."""

from jaxrec.ops.bounds_check import (
    BoundsCheckMode,
    BoundsCheckResult,
    bounds_check_indices,
    bounds_check_indices_reference,
)

__all__ = [
    "BoundsCheckMode",
    "BoundsCheckResult",
    "bounds_check_indices",
    "bounds_check_indices_reference",
]
