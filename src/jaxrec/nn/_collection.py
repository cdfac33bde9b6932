"""``TableCollection``: what every collection of embedding tables offers, sharded or not.

The train step, the checkpoints and the sharding code meet collections only through
this base: ``EmbeddingBagCollection`` and ``EmbeddingCollection`` (``jaxrec.nn``) and
``ShardedEmbeddingBagCollection`` (``jaxrec.parallel``) implement it, and new table kinds
(host-memory, dynamic vocabularies) join by implementing it too. A subclass provides
``table_configs``, ``optimizer``, ``portable_tables`` and ``load_portable_tables``; the
rest has a working default built on those two, which a subclass may replace by a faster
one (the unsharded collections do).

``mesh`` and ``axis_name`` say where the tables live: ``None`` for tables on one device
(replicated over a mesh when the model is), else the mesh whose ``axis_name`` axis the
tables are sharded over. ``jaxrec.nn.make_train_step`` reads them to decide whether the
step runs under ``shard_map``.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
from flax import nnx


class TableCollection(nnx.Module):
    """Base of the embedding table collections (module doc)."""

    mesh: jax.sharding.Mesh | None = None
    axis_name: str | None = None

    @property
    def fused(self) -> bool:
        """Whether the tables train themselves (a fused optimizer) rather than by optax."""
        return self.optimizer is not None

    def portable_tables(self) -> dict[str, dict[str, jax.Array]]:
        """``{table name: {"weights": [rows, dim], <state name>: array, "step": scalar}}``:
        each table whole, with its fused optimizer's state and step (plain tables: weights
        only). The form any collection of these tables can load, on any mesh."""
        raise NotImplementedError

    def load_portable_tables(self, portable: Mapping[str, Mapping[str, jax.Array]]) -> None:
        """Sets every table (and its fused optimizer state) from ``portable_tables``' form."""
        raise NotImplementedError

    def split_embedding_weights(self) -> dict[str, jax.Array]:
        """``{table name: [num_embeddings, embedding_dim]}`` (FBGEMM's name)."""
        return {name: t["weights"] for name, t in self.portable_tables().items()}

    def split_optimizer_states(self) -> dict[str, dict[str, jax.Array]]:
        """``{table name: {state name: [rows, dim] or [rows]}}`` of the fused optimizer."""
        self._require_fused("optimizer state")
        return {name: {k: v for k, v in t.items() if k not in ("weights", "step")}
                for name, t in self.portable_tables().items()}

    def set_embedding_weights(self, weights: Mapping[str, jax.Array]) -> None:
        """Sets tables from ``{table name: [num_embeddings, embedding_dim]}``: the inverse of
        ``split_embedding_weights`` (load a trained FBGEMM/TorchRec table). Tables not named
        keep their weights; the optimizer state is left as it is."""
        portable = self.portable_tables()
        self._check_names(weights, "weights", set(portable))
        for name, value in weights.items():
            portable[name] = {**portable[name], "weights": self._checked(name, value)}
        self.load_portable_tables(portable)

    def set_optimizer_states(self, states: Mapping[str, Mapping[str, jax.Array]], *,
                             step=None) -> None:
        """Sets the fused optimizer's state from ``{table name: {state name: array}}``: the
        inverse of ``split_optimizer_states``. ``step``: the updates already applied
        (unchanged when None)."""
        self._require_fused("optimizer state")
        portable = self.portable_tables()
        self._check_names(states, "optimizer states", set(portable))
        for name, state in states.items():
            portable[name] = {**portable[name], **state, **({} if step is None else {"step": step})}
        self.load_portable_tables(portable)

    def _require_fused(self, what: str) -> None:
        if not self.fused:
            raise ValueError(f"{type(self).__name__} {self.name!r} has plain tables: their "
                             f"{what} is the optax optimizer's")

    def _check_names(self, given: Mapping, what: str, names: set[str]) -> None:
        unknown = sorted(set(given) - names)
        if unknown:
            raise ValueError(f"{type(self).__name__} {self.name!r} has no table {unknown} to set "
                             f"{what} of; its tables are {sorted(names)}")

    def _checked(self, name: str, value) -> jax.Array:
        value = jax.numpy.asarray(value)
        table = next(t for t in self.table_configs if t.name == name)
        shape = (table.num_embeddings, table.embedding_dim)
        if tuple(value.shape) != shape:
            raise ValueError(f"table {name!r} has shape {shape} (num_embeddings, embedding_dim), "
                             f"got an array of shape {tuple(value.shape)}")
        return value
