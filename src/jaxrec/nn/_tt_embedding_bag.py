"""``TTEmbeddingBag``: FBTT's tensor-train embedding bag as a Flax NNX module.

::

    emb = TTEmbeddingBag(11_000_000, 64, tt_ranks=[32, 32],            # p, q factorised:
                         optimizer=jaxrec.optim.SGD(learning_rate=0.1),  # (200, 220, 250),
                         rngs=nnx.Rngs(0))                               # (4, 4, 4)
    out = emb(indices, offsets)          # [B, 64], as torch.nn.EmbeddingBag(mode="sum")
    emb.compression_ratio                # 734: 3.8 MB of cores instead of 2.8 GB

Two modes, as the collections have:

* **plain** (``optimizer=None``): the cores are ``nnx.Param`` s (``core_params``);
  ``jax.grad`` gives their dense gradients and optax trains them (FBTT's ``sparse=False``).
* **fused** (``optimizer=SGD(...)`` or ``Adagrad(...)``, FBTT's ``sparse=True``): a
  ``FusedTables`` variable holding ``jaxrec.fused.TTEmbeddingTables``; the backward
  updates the cores in place. Train with ``jaxrec.nn.make_train_step``.

In both modes ``emb.cores`` reads the cores (a tuple of arrays) and ``emb.set_cores(cores)``
writes them; ``cores=`` in the constructor starts from given cores (e.g. a decomposition
of a trained table) instead of random ones. The arrays are copied: a train step donates
the module's buffers, never the caller's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrec.fused import TTEmbeddingTables, tt_fused_lookup
from jaxrec.nn._fused_variable import FusedTables
from jaxrec.ops import BoundsCheckMode, PoolingMode, TTLayout, init_tt_cores, tt_embedding_bag
from jaxrec.ops.tbe_layout import as_pooling_mode
from jaxrec.ops.tt_reference import tt_full_weight
from jaxrec.optim import OptimizerConfig


class TTEmbeddingBag(nnx.Module):
    """Pooled rows of a TT-compressed table (FBTT's ``TTEmbeddingBag``).

    Args:
      num_embeddings, embedding_dim: the table's shape.
      tt_ranks: the T - 1 inner ranks (2 to 4 cores).
      tt_p_shapes, tt_q_shapes: the factorisations of the rows and of the columns; ``None``
        picks the most even ones (``jaxrec.ops.suggested_tt_shapes``).
      pooling: "sum" or "mean".
      weight_dist: "approx-normal" (default), "approx-uniform", "normal" or "uniform"
        (``jaxrec.ops.tt_init``).
      optimizer: ``None`` (plain) or ``jaxrec.optim.SGD`` / ``Adagrad`` (fused).
      rngs: ``rngs.params()`` initialises the cores.
      cores: the starting cores (T arrays of the layout's shapes) instead of random ones.
      bounds_check_mode, backend: as ``jaxrec.ops.tt_embedding_bag``.
      name: the fused tables' name, unique among the fused tables of one model.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tt_ranks: Sequence[int],
                 tt_p_shapes: Sequence[int] | None = None,
                 tt_q_shapes: Sequence[int] | None = None,
                 pooling: PoolingMode | str = PoolingMode.SUM, weight_dist: str = "approx-normal",
                 optimizer: OptimizerConfig | None = None, rngs: nnx.Rngs,
                 bounds_check_mode: BoundsCheckMode | str = BoundsCheckMode.WARNING,
                 backend: str = "auto", name: str = "tt",
                 cores: Sequence[jax.Array] | None = None):
        self.layout = TTLayout.create(num_embeddings, embedding_dim, tt_ranks, tt_p_shapes,
                                      tt_q_shapes)
        self.pooling = as_pooling_mode(pooling)
        self.optimizer = optimizer
        self.bounds_check_mode = bounds_check_mode
        self.backend = backend
        key = rngs.params()  # drawn either way: the model's other keys do not depend on cores=
        cores = self._copied(init_tt_cores(key, self.layout, weight_dist) if cores is None else cores)
        if optimizer is None:
            self.core_params = nnx.List([nnx.Param(c) for c in cores])
        else:
            self.table = FusedTables(TTEmbeddingTables.create(self.layout, optimizer, cores=cores,
                                                              name=name))

    @property
    def fused(self) -> bool:
        return self.optimizer is not None

    @property
    def compression_ratio(self) -> float:
        """Floats of the dense table over floats of the cores."""
        return self.layout.compression_ratio

    def __call__(self, indices: jax.Array, offsets: jax.Array,
                 per_sample_weights: jax.Array | None = None, *, num_features: int = 1) -> jax.Array:
        """``float32[B, num_features * D]``; ``offsets`` has ``num_features * B + 1`` entries."""
        kwargs = dict(pooling=self.pooling, per_sample_weights=per_sample_weights,
                      num_features=num_features, bounds_check_mode=self.bounds_check_mode,
                      backend=self.backend)
        if self.fused:
            return tt_fused_lookup(self.table.get_value(), indices, offsets, **kwargs)
        return tt_embedding_bag(self.cores, indices, offsets, layout=self.layout, **kwargs)

    @property
    def cores(self) -> tuple[jax.Array, ...]:
        """The T cores, in either mode (the fused tables' current cores)."""
        if self.fused:
            return self.table.get_value().cores
        return tuple(c.get_value() for c in self.core_params)

    def set_cores(self, cores: Sequence[jax.Array]) -> None:
        """Sets the T cores (copies, checked against the layout's shapes), in either mode.
        The fused optimizer's state and step are kept."""
        cores = self._copied(cores)
        if self.fused:
            self.table.set_value(dataclasses.replace(self.table.get_value(), cores=cores))
        else:
            for var, core in zip(self.core_params, cores, strict=True):
                var.set_value(core)

    def _copied(self, cores) -> tuple[jax.Array, ...]:
        return self.layout.validate_cores(jnp.array(c, copy=True) for c in cores)

    def full_weight(self) -> jax.Array:
        """The dense ``[num_embeddings, D]`` table: tests, export."""
        if self.fused:
            return self.table.get_value().full_weight()
        return tt_full_weight(self.cores, layout=self.layout)

    materialize = full_weight
