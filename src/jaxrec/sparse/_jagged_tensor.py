"""JaggedTensor: one jagged dimension, as a pytree with static shapes (TorchRec semantics)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec.sparse import _capacity, _gather


def _concrete_lengths(lengths: jax.Array, what: str, fix: str) -> np.ndarray:
    host = _capacity.concrete_or_none(lengths)
    if host is None:
        raise ValueError(
            f"{what} needs concrete lengths, but they are traced (inside jit/vmap/grad); {fix}"
        )
    return host


@jax.tree_util.register_pytree_node_class
class JaggedTensor:
    """A batch of variable-length bags: ``values`` cut into ``N`` bags by ``lengths``.

    ::

      #          0        1     2            <-- bag
      #          [V0,V1]  None  [V2,V3,V4]
      # lengths = [2, 0, 3]; offsets = [0, 2, 2, 5]
      # values  = [V0, V1, V2, V3, V4, pad, pad, pad]   capacity 8 (static)

    ``values`` has a static capacity (its size along axis 0) and may have trailing dims
    (e.g. ``[capacity, D]`` sequence embeddings); entries past ``offsets[-1]`` are padding
    and never influence a result. ``lengths`` is ``int32[N]``. ``weights``, when present,
    is ``[capacity]`` floating point, aligned with ``values``.

    Host data (lists, NumPy) is padded to ``capacity`` or, when it is None, to
    ``capacity_bucket(len(values))`` (next power of two, minimum 8); ``jax.Array`` values
    keep their size. Pass ``lengths`` or ``offsets`` (``offsets[0] == 0``).
    """

    def __init__(
        self,
        values: Any,
        weights: Any = None,
        lengths: Any = None,
        offsets: Any = None,
        *,
        capacity: int | None = None,
    ):
        values, weights, lengths = _capacity.prepare_jagged(
            values, weights, lengths, offsets, capacity, integer_values=False
        )
        self._values, self._weights, self._lengths = values, weights, lengths

    @classmethod
    def _make(cls, values, lengths, weights) -> JaggedTensor:
        """Builds from already valid arrays (no checks, no host syncs)."""
        jt = object.__new__(cls)
        jt._values, jt._lengths, jt._weights = values, lengths, weights
        return jt

    # -- pytree ---------------------------------------------------------------------------
    def tree_flatten(self):
        return (self._values, self._lengths, self._weights), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        return cls._make(*children)

    # -- constructors -----------------------------------------------------------------------
    @staticmethod
    def empty(
        is_weighted: bool = False,
        values_dtype: Any = jnp.float32,
        weights_dtype: Any = jnp.float32,
        *,
        capacity: int = 0,
    ) -> JaggedTensor:
        """A JaggedTensor with no bags (``lengths`` of size 0) and ``capacity`` zero values."""
        capacity = _capacity.check_capacity_arg(capacity)
        weights = jnp.zeros((capacity,), weights_dtype) if is_weighted else None
        return JaggedTensor._make(
            jnp.zeros((capacity,), values_dtype), jnp.zeros((0,), jnp.int32), weights
        )

    @staticmethod
    def from_dense(
        values: Sequence[Any],
        weights: Sequence[Any] | None = None,
        *,
        capacity: int | None = None,
    ) -> JaggedTensor:
        """One bag per array of ``values`` (TorchRec's ``from_dense``).

        ::

          values = [[1.0], [], [7.0, 8.0]]   ->   lengths = [1, 0, 2], values = [1, 7, 8, pad...]

        Host or concrete arrays are padded to a capacity bucket; traced arrays are
        concatenated as they are (capacity = total size).
        """
        if len(values) == 0:
            raise ValueError("from_dense needs at least one bag in values, got [].")
        if weights is not None and len(weights) != len(values):
            raise ValueError(
                f"weights has {len(weights)} bags but values has {len(values)}; pass one weight "
                "array per values array."
            )
        lengths = np.asarray([np.shape(v)[0] for v in values], np.int32)
        if any(_capacity.is_traced(v) for v in values) or (
            weights is not None and any(_capacity.is_traced(w) for w in weights)
        ):
            flat = jnp.concatenate([jnp.asarray(v) for v in values])
            flat_w = None if weights is None else jnp.concatenate([jnp.asarray(w) for w in weights])
        else:
            flat = np.concatenate([np.asarray(v) for v in values])
            flat_w = None if weights is None else np.concatenate([np.asarray(w) for w in weights])
        return JaggedTensor(flat, weights=flat_w, lengths=lengths, capacity=capacity)

    @staticmethod
    def from_dense_lengths(
        values: jax.Array, lengths: jax.Array, weights: jax.Array | None = None
    ) -> JaggedTensor:
        """Bag ``i`` = ``values[i, :lengths[i]]``; traceable, capacity = ``B * N``.

        ::

          values = [[1, 2, 3],        lengths = [2, 0, 3]
                    [4, 5, 6],   ->   values  = [1, 2, 7, 8, 9, 0, 0, 0, 0]
                    [7, 8, 9]]
        """
        values = jnp.asarray(values)
        if values.ndim < 2:
            raise ValueError(f"values must be [B, N, ...], got shape {values.shape}.")
        b, n = values.shape[:2]
        lengths = jnp.asarray(lengths)
        if lengths.shape != (b,):
            raise ValueError(
                f"lengths must have shape ({b},) (one per row of values), got {lengths.shape}."
            )
        _capacity.check_lengths("lengths", lengths, b * n)
        host = _capacity.concrete_or_none(lengths)
        if host is not None and host.size and host.max() > n:
            raise ValueError(f"lengths must be <= values.shape[1]={n}, got max {int(host.max())}.")
        if weights is not None:
            weights = jnp.asarray(weights)
            if weights.shape != (b, n):
                raise ValueError(
                    f"weights must have shape ({b}, {n}) like values, got {weights.shape}."
                )
            weights = weights.reshape(b * n)
        lengths = jnp.minimum(lengths.astype(jnp.int32), n)
        starts = jnp.arange(b, dtype=jnp.int32) * n
        flat = values.reshape((b * n,) + values.shape[2:])
        flat, weights = _gather.gather_segments((flat, weights), starts, lengths, b * n)
        return JaggedTensor._make(flat, lengths, weights)

    # -- accessors --------------------------------------------------------------------------
    def values(self) -> jax.Array:
        return self._values

    def lengths(self) -> jax.Array:
        return self._lengths

    def lengths_or_none(self) -> jax.Array:
        return self._lengths

    def offsets(self) -> jax.Array:
        """``int32[N + 1]``: ``[0, l0, l0 + l1, ...]``."""
        return _gather.exclusive_cumsum(self._lengths)

    def offsets_or_none(self) -> jax.Array:
        return self.offsets()

    def weights(self) -> jax.Array:
        if self._weights is None:
            raise ValueError(
                "this JaggedTensor has no weights; use weights_or_none(), or build it with weights=."
            )
        return self._weights

    def weights_or_none(self) -> jax.Array | None:
        return self._weights

    @property
    def capacity(self) -> int:
        """Static size of ``values`` along axis 0 (ids plus padding)."""
        return self._values.shape[0]

    # -- dense views ------------------------------------------------------------------------
    def _split_bags(self, x: jax.Array, what: str) -> list[jax.Array]:
        lengths = _concrete_lengths(
            self._lengths, what, "use to_padded_dense(desired_length=...) under jit."
        )
        if _capacity.is_traced(x):
            raise ValueError(
                f"{what} needs concrete values, but they are traced (inside jit/vmap/grad); use "
                "to_padded_dense(desired_length=...) under jit."
            )
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        return [x[int(offsets[i]) : int(offsets[i + 1])] for i in range(len(lengths))]

    def to_dense(self) -> list[jax.Array]:
        """A list of ``N`` arrays, one per bag (variable sizes: not allowed under ``jit``)."""
        return self._split_bags(self._values, "to_dense()")

    def to_dense_weights(self) -> list[jax.Array] | None:
        if self._weights is None:
            return None
        return self._split_bags(self._weights, "to_dense_weights()")

    def _desired_length(self, desired_length: int | None, what: str) -> int:
        if desired_length is None:
            lengths = _concrete_lengths(
                self._lengths,
                f"{what} without desired_length",
                "pass a static desired_length=... (the padded bag size).",
            )
            return int(lengths.max()) if lengths.size else 0
        if isinstance(desired_length, bool) or not isinstance(desired_length, (int, np.integer)):
            raise ValueError(f"desired_length must be a static Python int, got {desired_length!r}.")
        if desired_length < 0:
            raise ValueError(f"desired_length must be >= 0, got desired_length={desired_length}.")
        return int(desired_length)

    def to_padded_dense(self, desired_length: int | None = None, padding_value=0) -> jax.Array:
        """``[N, desired_length, ...]``: bags cut to ``desired_length`` or padded.

        ::

          # lengths = [2, 0, 3], values = [1, 2, 3, 4, 5], desired_length=2, padding_value=-1
          # -> [[1, 2], [-1, -1], [3, 4]]

        ``desired_length=None`` means the longest bag; that needs concrete lengths, so under
        ``jit`` pass a static ``desired_length``.
        """
        d = self._desired_length(desired_length, "to_padded_dense()")
        return _gather.padded_dense(self._values, self.offsets(), d, padding_value)

    def to_padded_dense_weights(
        self, desired_length: int | None = None, padding_value=0.0
    ) -> jax.Array | None:
        """Like ``to_padded_dense`` for the weights; None when there are none."""
        if self._weights is None:
            return None
        d = self._desired_length(desired_length, "to_padded_dense_weights()")
        return _gather.padded_dense(self._weights, self.offsets(), d, padding_value)

    def __repr__(self) -> str:
        leaves = (self._values, self._lengths, self._weights)
        if any(_capacity.is_traced(x) for x in leaves if x is not None) or not all(
            isinstance(x, (jax.Array, np.ndarray)) for x in leaves if x is not None
        ):
            w = self._weights
            w = "None" if w is None else f"{w.dtype}{list(w.shape)}"
            return (
                f"JaggedTensor(values={self._values.dtype}{list(self._values.shape)}, "
                f"lengths={self._lengths.dtype}{list(self._lengths.shape)}, weights={w})"
            )
        bags = [np.asarray(b).tolist() for b in self.to_dense()]
        if self._weights is None:
            return f"JaggedTensor({bags}, capacity={self.capacity})"
        wbags = [np.asarray(b).tolist() for b in self.to_dense_weights()]
        return f"JaggedTensor({bags}, weights={wbags}, capacity={self.capacity})"
