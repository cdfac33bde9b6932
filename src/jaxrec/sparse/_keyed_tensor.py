"""KeyedTensor: dense per-key blocks side by side (e.g. pooled embeddings), as a pytree."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_pytree_node_class
class KeyedTensor:
    """Per-key dense blocks concatenated along ``key_dim`` (TorchRec semantics, default 1).

    ::

      #         "f0" (dim 2)   "f1" (dim 3)     <-- keys, length_per_key = [2, 3]
      # b=0     [a00 a01       b00 b01 b02]
      # b=1     [a10 a11       b10 b11 b12]
      # values: [B=2, 5]; offset_per_key = [0, 2, 5]

    ``keys``, ``length_per_key`` and ``key_dim`` are static (pytree aux data); ``values`` is
    the only array child. Keys are unique.
    """

    def __init__(
        self,
        keys: Sequence[str],
        length_per_key: Sequence[int],
        values: Any,
        key_dim: int = 1,
    ):
        if isinstance(keys, str):
            raise TypeError(f"keys must be a sequence of str, got the single str {keys!r}.")
        keys = tuple(keys)
        if not all(isinstance(k, str) for k in keys):
            raise TypeError(f"keys must all be str, got {keys!r}.")
        if len(set(keys)) != len(keys):
            dup = sorted({k for k in keys if keys.count(k) > 1})
            raise ValueError(f"keys must be unique, got duplicates {dup} in {list(keys)}.")
        if isinstance(length_per_key, jax.Array):
            raise TypeError("length_per_key must be a static list of ints (the per-key dims).")
        lpk = tuple(int(x) for x in length_per_key)
        if len(lpk) != len(keys) or any(x < 0 for x in lpk):
            raise ValueError(
                f"length_per_key must have one non-negative dim per key ({len(keys)} keys), got "
                f"{list(length_per_key)}."
            )
        values = jnp.asarray(values)
        if (
            isinstance(key_dim, bool)
            or not isinstance(key_dim, int)
            or not 0 <= key_dim < values.ndim
        ):
            raise ValueError(
                f"key_dim must be an int in [0, {values.ndim}) for values of shape {values.shape}, "
                f"got {key_dim!r}."
            )
        if values.shape[key_dim] != sum(lpk):
            raise ValueError(
                f"values.shape[{key_dim}]={values.shape[key_dim]} but sum(length_per_key)="
                f"{sum(lpk)} ({dict(zip(keys, lpk))}); the blocks must fill the key dim exactly."
            )
        self._keys, self._length_per_key, self._key_dim, self._values = keys, lpk, key_dim, values

    @classmethod
    def _make(cls, keys, length_per_key, key_dim, values) -> KeyedTensor:
        kt = object.__new__(cls)
        kt._keys, kt._length_per_key, kt._key_dim, kt._values = (
            keys,
            length_per_key,
            key_dim,
            values,
        )
        return kt

    def tree_flatten(self):
        return (self._values,), (self._keys, self._length_per_key, self._key_dim)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls._make(*aux, *children)

    @staticmethod
    def from_tensor_list(
        keys: Sequence[str], tensors: Sequence[Any], key_dim: int = 1
    ) -> KeyedTensor:
        """``values = concatenate(tensors, axis=key_dim)``; one key per tensor."""
        tensors = [jnp.asarray(t) for t in tensors]
        if len(tensors) != len(keys):
            raise ValueError(f"pass one tensor per key: {len(keys)} keys, {len(tensors)} tensors.")
        if not tensors:
            raise ValueError("from_tensor_list needs at least one tensor.")
        lpk = [t.shape[key_dim] for t in tensors]
        return KeyedTensor(keys, lpk, jnp.concatenate(tensors, axis=key_dim), key_dim=key_dim)

    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self) -> jax.Array:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def length_per_key(self) -> list[int]:
        return list(self._length_per_key)

    def offset_per_key(self) -> list[int]:
        return [0] + np.cumsum(self._length_per_key, dtype=np.int64).tolist()

    def _block(self, i: int) -> jax.Array:
        start = sum(self._length_per_key[:i])
        return jax.lax.slice_in_dim(
            self._values, start, start + self._length_per_key[i], axis=self._key_dim
        )

    def __getitem__(self, key: str) -> jax.Array:
        if key not in self._keys:
            raise KeyError(f"key {key!r} is not in this KeyedTensor; its keys are {self.keys()}.")
        return self._block(self._keys.index(key))

    def to_dict(self) -> dict[str, jax.Array]:
        return {k: self._block(i) for i, k in enumerate(self._keys)}

    @staticmethod
    def regroup(
        keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]
    ) -> list[jax.Array]:
        """One array per group: the blocks of its keys, in group order, along ``key_dim``.

        ::

          # kt0: keys [f0 (2), f1 (3)]; kt1: keys [f2 (1)]
          # groups [[f2, f0], [f1]]  ->  [concat(f2, f0): [B, 3], f1: [B, 3]]

        Keys may come from any of ``keyed_tensors``; a key present in two of them is an error
        (TorchRec leaves that case unspecified).
        """
        keyed_tensors = list(keyed_tensors)
        if not keyed_tensors:
            raise ValueError("regroup needs at least one KeyedTensor, got [].")
        key_dims = {kt.key_dim() for kt in keyed_tensors}
        if len(key_dims) != 1:
            raise ValueError(f"all KeyedTensors must share key_dim, got {sorted(key_dims)}.")
        key_dim = key_dims.pop()
        where: dict[str, tuple[int, int]] = {}
        for t, kt in enumerate(keyed_tensors):
            for i, k in enumerate(kt._keys):
                if k in where:
                    raise ValueError(
                        f"key {k!r} is in keyed_tensors[{where[k][0]}] and keyed_tensors[{t}]; keys must "
                        "be unique across the KeyedTensors to regroup."
                    )
                where[k] = (t, i)
        out = []
        for g, group in enumerate(groups):
            if isinstance(group, str) or not group:
                raise ValueError(f"groups[{g}] must be a non-empty list of keys, got {group!r}.")
            blocks = []
            for k in group:
                if k not in where:
                    raise ValueError(
                        f"groups[{g}] names key {k!r}, which no KeyedTensor has; keys: {sorted(where)}."
                    )
                t, i = where[k]
                blocks.append(keyed_tensors[t]._block(i))
            out.append(blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=key_dim))
        return out

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: Sequence[KeyedTensor],
        groups: Sequence[Sequence[str]],
        keys: Sequence[str],
    ) -> dict[str, jax.Array]:
        """``dict(zip(keys, regroup(keyed_tensors, groups)))``; one name per group."""
        if len(keys) != len(groups):
            raise ValueError(f"pass one key per group: {len(keys)} keys, {len(groups)} groups.")
        return dict(zip(keys, KeyedTensor.regroup(keyed_tensors, groups)))

    def __repr__(self) -> str:
        return (
            f"KeyedTensor(keys={self.keys()}, length_per_key={self.length_per_key()}, "
            f"key_dim={self._key_dim}, values={self._values.dtype}{list(self._values.shape)})"
        )
