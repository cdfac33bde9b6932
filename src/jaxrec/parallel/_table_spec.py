"""What the sharding needs of a table config: ``TableSpec`` and ``table_specs``.

Its own module so that the plan types (_types.py) and the layouts (_layout.py) can both
build on it without importing each other.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrec.ops.tbe_layout import PoolingMode, as_pooling_mode


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """What the sharding needs of a table config (``EmbeddingBagConfig`` or alike)."""

    name: str
    rows: int
    dim: int
    features: tuple[str, ...]
    pooling: PoolingMode = PoolingMode.SUM
    dtype: str = "float32"
    dynamic: bool = False
    """A dynamic vocabulary (``EmbeddingBagConfig(dynamic=...)``): ROW_WISE over every device."""
    placement: str = "device"
    """``EmbeddingBagConfig.placement``: ``"device"``, ``"host"`` or ``"host_cached"``."""
    cache_rows: int = 0
    """host_cached: the table's cache rows (``EmbeddingBagConfig.cache_size()``)."""
    cache_policy: str = "lru"
    """host_cached: ``EmbeddingBagConfig.cache_policy``."""


def table_specs(tables) -> tuple[TableSpec, ...]:
    """TableSpecs of table configs with ``name``, ``num_embeddings``, ``embedding_dim``,
    ``feature_names`` (and optionally ``pooling``, ``dtype``, ``dynamic``, ``placement``)."""
    specs = []
    for t in tables:
        if isinstance(t, TableSpec):
            specs.append(t)
            continue
        try:
            specs.append(TableSpec(t.name, int(t.num_embeddings), int(t.embedding_dim),
                                   tuple(t.feature_names),
                                   as_pooling_mode(getattr(t, "pooling", PoolingMode.SUM)),
                                   jnp.dtype(getattr(t, "dtype", "float32")).name,
                                   getattr(t, "dynamic", None) is not None,
                                   getattr(t, "placement", "device"),
                                   t.cache_size() if getattr(t, "placement", "device") == "host_cached" else 0,
                                   getattr(t, "cache_policy", "lru")))
        except AttributeError as e:
            raise TypeError(f"tables must be EmbeddingBagConfig-like (name, num_embeddings, "
                            f"embedding_dim, feature_names), got {t!r}: {e}") from None
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"table names must be unique, got {names}")
    return tuple(specs)
