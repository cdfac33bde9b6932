"""KeyedJaggedTensor: jagged ids for several keys (features), as a pytree with static shapes."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec.sparse import _capacity, _gather
from jaxrec.sparse._jagged_tensor import JaggedTensor


def _check_keys(keys: Any) -> tuple[str, ...]:
    if isinstance(keys, str):
        raise TypeError(
            f"keys must be a sequence of str, got the single str {keys!r}; pass [{keys!r}]."
        )
    keys = tuple(keys)
    for k in keys:
        if not isinstance(k, str):
            raise TypeError(f"keys must be str, got {k!r} of type {type(k).__name__}.")
    return keys


def _static_ints(name: str, xs: Any) -> list[int]:
    if isinstance(xs, jax.Array):
        raise TypeError(
            f"{name} must be a static list of Python ints (it fixes the output shape), got a "
            "jax.Array; pass e.g. [2, 0, 1]."
        )
    out = []
    for x in xs:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"{name} must hold Python ints, got {x!r}.")
        out.append(int(x))
    return out


@jax.tree_util.register_pytree_node_class
class KeyedJaggedTensor:
    """Jagged ids of several keys, key-major as in TorchRec.

    ::

      #              0       1        2  <-- batch
      # "Feature0"   [V0,V1] None    [V2]
      # "Feature1"   [V3]    [V4]    [V5,V6,V7]
      # keys = ["Feature0", "Feature1"]; stride = 3
      # lengths = [2, 0, 1, 1, 1, 3]; offsets = [0, 2, 2, 3, 4, 5, 8]
      # values  = [V0, V1, V2, V3, V4, V5, V6, V7]  (+ padding up to the capacity)
      # length_per_key = [3, 5]; offset_per_key = [0, 3, 8]

    Arrays (pytree children): ``values: int[capacity]`` (int32, or int64 if given with
    ``jax_enable_x64``), ``lengths: int32[num_keys * stride]``, optional
    ``weights: float[capacity]``. Static (pytree aux data): ``keys`` and ``stride``.
    Values past ``offsets[-1]`` are padding and never influence a result; outputs of the
    methods below fill their padding with 0.

    Capacity: host data (lists, NumPy) is padded to ``capacity`` or, when it is None, to
    ``capacity_bucket(len(values))`` (next power of two, minimum 8) so that recompiles are
    rare; ``jax.Array`` values keep their size. Keys may repeat (``permute`` with repeated
    indices makes such KJTs); lookups by key then see the last occurrence, as in TorchRec.

    Variable batch size per key (TorchRec's VBE): ``stride_per_key_per_rank`` gives each
    key's number of bags (one list per key; its ranks' counts add up), ``lengths`` holds
    ``sum(stride_per_key())`` entries key by key, and ``inverse_indices = (keys,
    int[num_keys, B])`` maps each of the B samples of the full batch to its key's bag::

      # "user" (one bag per distinct user)  [U0] [U1]            stride 2
      # "item" (one bag per impression)     [I0] [I1] [I2] [I3]  stride 4
      # stride_per_key_per_rank = [[2], [4]]; lengths = [1, 1, 1, 1, 1, 1]
      # inverse_indices = (["user", "item"], [[0, 0, 1, 1], [0, 1, 2, 3]])

    ``EmbeddingBagCollection`` pools each key's bags once and expands its output to the B
    samples by ``inverse_indices`` (the user's row is looked up once, its gradient summed
    over the user's samples). ``stride()`` is then the largest key's stride.
    """

    def __init__(
        self,
        keys: Sequence[str],
        values: Any,
        weights: Any = None,
        lengths: Any = None,
        offsets: Any = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
        inverse_indices: tuple[Sequence[str], Any] | None = None,
        *,
        capacity: int | None = None,
    ):
        keys = _check_keys(keys)
        values, weights, lengths = _capacity.prepare_jagged(
            values, weights, lengths, offsets, capacity, integer_values=True
        )
        n, num_keys = lengths.shape[0], len(keys)
        if stride_per_key_per_rank is not None:
            ranks, inverse = _check_variable_strides(
                keys, n, stride, stride_per_key_per_rank, inverse_indices
            )
            self._keys, self._ranks, self._inverse = keys, ranks, inverse
            self._stride = max((sum(r) for r in ranks), default=0)
            self._values, self._lengths, self._weights = values, lengths, weights
            return
        if inverse_indices is not None:
            raise ValueError(
                "inverse_indices map a variable batch (VBE) back to the full one: pass "
                "stride_per_key_per_rank with them."
            )
        if stride is None:
            if num_keys == 0:
                if n:
                    raise ValueError(f"keys is empty but lengths has {n} entries; pass keys=[...].")
                stride = 0
            elif n % num_keys:
                raise ValueError(
                    f"lengths has {n} entries, not a multiple of len(keys)={num_keys}; lengths is "
                    "key-major: num_keys * stride entries (all bags of key 0, then key 1, ...)."
                )
            else:
                stride = n // num_keys
        else:
            stride = _static_ints("stride", [stride])[0]
            if stride < 0 or n != num_keys * stride:
                raise ValueError(
                    f"lengths has {n} entries but len(keys) * stride = {num_keys} * {stride} = "
                    f"{num_keys * stride}; pass lengths with one entry per (key, batch) pair."
                )
        self._keys, self._stride, self._ranks, self._inverse = keys, stride, None, None
        self._values, self._lengths, self._weights = values, lengths, weights

    @classmethod
    def _make(cls, keys, stride, values, lengths, weights, ranks=None, inverse=None) -> KeyedJaggedTensor:
        """Builds from already valid arrays (no checks, no host syncs). ``ranks``: the
        stride_per_key_per_rank of a variable batch (a tuple of tuples), else None;
        ``inverse``: its inverse indices, ``int[num_keys, B]``."""
        kjt = object.__new__(cls)
        kjt._keys, kjt._stride, kjt._ranks = tuple(keys), int(stride), ranks
        kjt._values, kjt._lengths, kjt._weights, kjt._inverse = values, lengths, weights, inverse
        return kjt

    # -- pytree ---------------------------------------------------------------------------
    def tree_flatten(self):
        return (self._values, self._lengths, self._weights, self._inverse), (self._keys, self._stride, self._ranks)

    @classmethod
    def tree_unflatten(cls, aux, children):
        keys, stride, ranks = aux
        values, lengths, weights, inverse = children
        return cls._make(keys, stride, values, lengths, weights, ranks, inverse)

    # -- constructors ---------------------------------------------------------------------
    @staticmethod
    def from_lengths_sync(
        keys: Sequence[str],
        values: Any,
        lengths: Any,
        weights: Any = None,
        stride: int | None = None,
        *,
        capacity: int | None = None,
    ) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            keys, values, weights=weights, lengths=lengths, stride=stride, capacity=capacity
        )

    @staticmethod
    def from_offsets_sync(
        keys: Sequence[str],
        values: Any,
        offsets: Any,
        weights: Any = None,
        stride: int | None = None,
        *,
        capacity: int | None = None,
    ) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            keys, values, weights=weights, offsets=offsets, stride=stride, capacity=capacity
        )

    @staticmethod
    def empty(
        is_weighted: bool = False,
        values_dtype: Any = jnp.int32,
        weights_dtype: Any = jnp.float32,
        *,
        capacity: int = 0,
    ) -> KeyedJaggedTensor:
        """A KJT with no keys (stride 0) and ``capacity`` zero values."""
        capacity = _capacity.check_capacity_arg(capacity)
        weights = jnp.zeros((capacity,), weights_dtype) if is_weighted else None
        return KeyedJaggedTensor._make(
            (), 0, jnp.zeros((capacity,), values_dtype), jnp.zeros((0,), jnp.int32), weights
        )

    @staticmethod
    def from_jt_dict(jt_dict: Mapping[str, JaggedTensor]) -> KeyedJaggedTensor:
        """Keys in dict order; every JaggedTensor must have the same number of bags (stride).

        Capacity = sum of the JaggedTensors' capacities.
        """
        if not jt_dict:
            raise ValueError("from_jt_dict needs at least one key; use KeyedJaggedTensor.empty().")
        keys = _check_keys(jt_dict.keys())
        jts = list(jt_dict.values())
        for k, jt in zip(keys, jts):
            if not isinstance(jt, JaggedTensor):
                raise TypeError(f"jt_dict[{k!r}] must be a JaggedTensor, got {type(jt).__name__}.")
            if jt.values().ndim != 1 or not np.issubdtype(jt.values().dtype, np.integer):
                raise TypeError(
                    f"jt_dict[{k!r}] must hold 1-D integer ids, got {jt.values().dtype}"
                    f"{list(jt.values().shape)}."
                )
        strides = [jt.lengths().shape[0] for jt in jts]
        if len(set(strides)) != 1:
            raise ValueError(
                f"all JaggedTensors need the same number of bags (the stride), got "
                f"{dict(zip(keys, strides))}."
            )
        weighted = [jt.weights_or_none() is not None for jt in jts]
        if len(set(weighted)) != 1:
            raise ValueError(
                f"all JaggedTensors must be weighted, or none (weighted: {dict(zip(keys, weighted))})."
            )
        return _concat_parts(keys, strides[0], jts, None)

    # -- accessors ------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self) -> jax.Array:
        return self._values

    def lengths(self) -> jax.Array:
        return self._lengths

    def lengths_or_none(self) -> jax.Array:
        return self._lengths

    def offsets(self) -> jax.Array:
        """``int32[num_keys * stride + 1]``: exclusive cumulative sum of ``lengths``."""
        return _gather.exclusive_cumsum(self._lengths)

    def offsets_or_none(self) -> jax.Array:
        return self.offsets()

    def weights(self) -> jax.Array:
        if self._weights is None:
            raise ValueError(
                "this KeyedJaggedTensor has no weights; use weights_or_none(), or build it with "
                "weights=."
            )
        return self._weights

    def weights_or_none(self) -> jax.Array | None:
        return self._weights

    def stride(self) -> int:
        """Bags per key; with a variable batch (VBE), the largest key's."""
        return self._stride

    def stride_per_key(self) -> list[int]:
        return list(_strides(self))

    def stride_per_key_per_rank(self) -> list[list[int]]:
        if self._ranks is None:
            return [[self._stride] for _ in self._keys]
        return [list(r) for r in self._ranks]

    def variable_stride_per_key(self) -> bool:
        return self._ranks is not None

    def inverse_indices(self) -> tuple[list[str], jax.Array]:
        """``(keys, int[num_keys, B])``: each sample's bag of each key (VBE only)."""
        if self._inverse is None:
            raise ValueError(
                "this KeyedJaggedTensor has no inverse_indices (only a variable-batch KJT, "
                "built with stride_per_key_per_rank and inverse_indices, has them)."
            )
        return list(self._keys), self._inverse

    def inverse_indices_or_none(self) -> tuple[list[str], jax.Array] | None:
        return None if self._inverse is None else (list(self._keys), self._inverse)

    @property
    def capacity(self) -> int:
        """Static size of ``values`` (ids plus padding)."""
        return self._values.shape[0]

    def index_per_key(self) -> dict[str, int]:
        return {k: i for i, k in enumerate(self._keys)}  # last occurrence wins, as in TorchRec

    def length_per_key(self) -> jax.Array:
        """``int32[num_keys]``: ids per key (a traceable array; TorchRec returns a list)."""
        return _length_per_key(self)

    def offset_per_key(self) -> jax.Array:
        """``int32[num_keys + 1]``: where each key's ids start in ``values``."""
        return _offset_per_key(self)

    def sync(self) -> KeyedJaggedTensor:
        return self

    def unsync(self) -> KeyedJaggedTensor:
        return self

    # -- per key --------------------------------------------------------------------------
    def __getitem__(self, key: str) -> JaggedTensor:
        """The bags of one key as a JaggedTensor with this KJT's capacity (ids moved to the front)."""
        index = self.index_per_key()
        if key not in index:
            raise KeyError(
                f"key {key!r} is not in this KeyedJaggedTensor; its keys are {self.keys()}."
            )
        return _jagged_at(self, index[key])

    def to_dict(self) -> dict[str, JaggedTensor]:
        """``{key: JaggedTensor}`` in key order, each with this KJT's capacity."""
        jts = _to_dict(self)  # a jitted call returns its dict sorted by key: restore key order
        return {k: jts[k] for k in self.index_per_key()}

    # -- re-layouts -----------------------------------------------------------------------
    def permute(
        self, indices: Sequence[int], *, capacity: int | None = None
    ) -> KeyedJaggedTensor:
        """Keys ``[keys[i] for i in indices]`` with their bags (repeats duplicate a key).

        ::

          # keys = [f0, f1, f2], indices = [2, 0, 2]  ->  keys = [f2, f0, f2]
          # lengths = [l_f2..., l_f0..., l_f2...]; values = [v_f2..., v_f0..., v_f2...]

        Output capacity (static): this capacity times the largest number of times one index
        repeats (so without repeats it is unchanged; ``[2, 0, 2]`` doubles it) — enough for
        any lengths. Pass ``capacity=`` to choose it yourself; it is checked when the lengths
        are concrete, and under ``jit`` ids past it would be dropped.
        """
        indices = tuple(_static_ints("indices", indices))
        num_keys = len(self._keys)
        for i in indices:
            if not 0 <= i < num_keys:
                raise ValueError(
                    f"indices must be in [0, {num_keys}) (one per key of {self.keys()}), got {i}."
                )
        if capacity is None:
            repeats = int(np.bincount(indices).max()) if indices else 1
            capacity = self.capacity * max(repeats, 1)
        capacity = _capacity.check_capacity_arg(capacity)
        host_lpk = _host_length_per_key(self)
        if host_lpk is not None:
            _check_fits(int(host_lpk[list(indices)].sum()), capacity)
        return _permute(self, indices, capacity)

    def split(self, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
        """Consecutive groups of ``segments[j]`` keys, one KJT each (stride kept).

        ::

          # keys = [f0, f1, f2], segments = [1, 0, 2]
          # -> [KJT([f0]), KJT([]), KJT([f1, f2])]

        A segment of 0 gives a KJT with no keys and capacity 0; the others keep this
        capacity (a segment covering every key is a copy with its padding zeroed, where
        TorchRec returns the KJT itself). As in TorchRec, keys past ``sum(segments)`` are
        dropped.
        """
        segments = tuple(_static_ints("segments", segments))
        num_keys = len(self._keys)
        if any(s < 0 for s in segments) or sum(segments) > num_keys:
            raise ValueError(
                f"segments must be >= 0 and sum to at most len(keys)={num_keys}, got {list(segments)}."
            )
        return _split(self, segments)

    @staticmethod
    def concat(
        kjt_list: Sequence[KeyedJaggedTensor], *, capacity: int | None = None
    ) -> KeyedJaggedTensor:
        """Keys, lengths and values of each KJT one after the other (same stride for all).

        ::

          # [KJT([f0, f1]), KJT([g0])] -> KJT([f0, f1, g0]); lengths and ids in that order

        Output capacity = sum of the capacities unless ``capacity=`` is passed (checked when
        the lengths are concrete). KJTs with no keys (e.g. empty ``split`` segments) are
        allowed whatever their stride.
        """
        kjt_list = list(kjt_list)
        if not kjt_list:
            raise ValueError("concat needs at least one KeyedJaggedTensor, got [].")
        for i, kjt in enumerate(kjt_list):
            if not isinstance(kjt, KeyedJaggedTensor):
                raise TypeError(
                    f"kjt_list[{i}] must be a KeyedJaggedTensor, got {type(kjt).__name__}."
                )
        weighted = [k._weights is not None for k in kjt_list]
        if len(set(weighted)) != 1:
            raise ValueError(
                f"cannot concat weighted with unweighted KJTs (weighted: {weighted}); add weights "
                "(e.g. ones) to the unweighted ones."
            )
        dtypes = {str(k._values.dtype) for k in kjt_list}
        if len(dtypes) != 1:
            raise TypeError(
                f"all KJTs must have one values dtype, got {sorted(dtypes)}; cast first."
            )
        keyed = [k for k in kjt_list if k._keys]
        variable = {k.variable_stride_per_key() for k in keyed}
        if len(variable) > 1:
            raise ValueError(
                "cannot concat variable-batch (VBE) KJTs with KJTs of one stride: give the "
                "latter stride_per_key_per_rank and inverse_indices too."
            )
        if variable == {True}:
            batches = {None if k._inverse is None else k._inverse.shape[1] for k in keyed}
            if len(batches) > 1:
                raise ValueError(
                    f"variable-batch KJTs must all have inverse_indices over one batch, got batches "
                    f"{[None if k._inverse is None else k._inverse.shape[1] for k in keyed]}."
                )
            kjt_list, stride = keyed, 0  # the keyless parts hold no ids; _concat takes the strides
        else:
            strides = {k._stride for k in keyed}
            if len(strides) > 1:
                raise ValueError(
                    f"all KJTs must have the same stride, got {[k._stride for k in kjt_list]}."
                )
            stride = strides.pop() if strides else kjt_list[0]._stride
        keys = sum((k._keys for k in kjt_list), ())
        return _concat_parts(keys, stride, kjt_list, capacity)

    def __repr__(self) -> str:
        stride = f"stride={self._stride}" if self._ranks is None else f"stride_per_key={self.stride_per_key()}"
        leaves = (self._values, self._lengths, self._weights)
        if any(_capacity.is_traced(x) for x in leaves) or not all(
            isinstance(x, (jax.Array, np.ndarray)) for x in leaves if x is not None
        ):
            w = self._weights
            w = "None" if w is None else f"{w.dtype}{list(w.shape)}"
            return (
                f"KeyedJaggedTensor(keys={self.keys()}, {stride}, "
                f"values={self._values.dtype}{list(self._values.shape)}, "
                f"lengths={self._lengths.dtype}{list(self._lengths.shape)}, weights={w})"
            )
        if not self._keys:
            return f"KeyedJaggedTensor({stride})"
        offsets = np.concatenate([[0], np.cumsum(np.asarray(self._lengths))]).astype(int)
        bounds = _bounds(self)

        def bags(flat, i):
            flat = np.asarray(flat)
            return [flat[offsets[k] : offsets[k + 1]].tolist() for k in range(bounds[i], bounds[i + 1])]

        lines = []
        for i, key in enumerate(self._keys):
            if self._weights is None:
                lines.append(f"    {key!r}: {bags(self._values, i)}")
            else:
                v, w = bags(self._values, i), bags(self._weights, i)
                lines.append(f"    {key!r}: {{'values': {v}, 'weights': {w}}}")
        return (
            f"KeyedJaggedTensor({stride}, capacity={self.capacity}, {{\n"
            + ",\n".join(lines)
            + "\n})"
        )


def _check_variable_strides(keys, num_lengths, stride, stride_per_key_per_rank, inverse_indices):
    """``(ranks, inverse)`` of a variable-batch KJT, checked: ranks a tuple of int tuples."""
    if isinstance(stride_per_key_per_rank, jax.Array) or len(stride_per_key_per_rank) != len(keys):
        raise ValueError(
            f"stride_per_key_per_rank must be a list of one list of ints per key ({len(keys)} keys), "
            f"got {stride_per_key_per_rank!r}."
        )
    ranks = tuple(tuple(_static_ints("stride_per_key_per_rank", r)) for r in stride_per_key_per_rank)
    if any(b < 0 for r in ranks for b in r):
        raise ValueError(f"stride_per_key_per_rank must be >= 0, got {[list(r) for r in ranks]}.")
    strides = [sum(r) for r in ranks]
    if sum(strides) != num_lengths:
        raise ValueError(
            f"lengths has {num_lengths} entries but stride_per_key_per_rank gives "
            f"{dict(zip(keys, strides))} bags, {sum(strides)} in all; lengths holds each key's bags in turn."
        )
    if stride is not None and stride != max(strides, default=0):
        raise ValueError(
            f"stride={stride} but a variable-batch KJT's stride is its largest key's, "
            f"{max(strides, default=0)}; leave stride=None."
        )
    if inverse_indices is None:
        return ranks, None
    inverse_keys, inverse = inverse_indices
    if _check_keys(inverse_keys) != tuple(keys):
        raise ValueError(
            f"inverse_indices must name the KJT's keys {list(keys)} in order, got {list(inverse_keys)}."
        )
    inverse = jnp.asarray(inverse)
    if inverse.ndim != 2 or inverse.shape[0] != len(keys) or not jnp.issubdtype(inverse.dtype, jnp.integer):
        raise ValueError(
            f"inverse_indices must be an integer array [num_keys={len(keys)}, batch], got "
            f"{inverse.dtype}{list(inverse.shape)}."
        )
    inverse = inverse.astype(jnp.int32)
    host = _capacity.concrete_or_none(inverse)
    if host is not None:
        for k, (key, b) in enumerate(zip(keys, strides)):
            bad = (host[k] < 0) | (host[k] >= b)
            if bad.any():
                sample = int(np.argmax(bad))
                raise ValueError(
                    f"inverse_indices[{k}] (key {key!r}) maps sample {sample} to bag "
                    f"{int(host[k, sample])}, outside the key's {b} bags [0, {b})."
                )
    return ranks, inverse


def _strides(kjt: KeyedJaggedTensor) -> tuple[int, ...]:
    """Bags of each key."""
    if kjt._ranks is None:
        return (kjt._stride,) * len(kjt._keys)
    return tuple(sum(r) for r in kjt._ranks)


def _bounds(kjt: KeyedJaggedTensor) -> np.ndarray:
    """Where each key's bags start in ``lengths`` (static), and the end: ``[num_keys + 1]``."""
    return np.concatenate([[0], np.cumsum(_strides(kjt), dtype=np.int64)]).astype(int)


def _key_lengths(kjt: KeyedJaggedTensor, i: int) -> jax.Array:
    b = _bounds(kjt)
    return kjt._lengths[b[i] : b[i + 1]]


def _check_fits(needed: int, capacity: int) -> None:
    if needed > capacity:
        raise ValueError(
            f"the result has {needed} ids but capacity={capacity}; pass capacity>={needed} (or "
            "capacity=None for a safe bound)."
        )


def _host_length_per_key(kjt: KeyedJaggedTensor) -> np.ndarray | None:
    host = _capacity.concrete_or_none(kjt._lengths)
    if host is None:
        return None
    return np.diff(np.concatenate([[0], np.cumsum(host, dtype=np.int64)])[_bounds(kjt)])


def _concat_parts(keys, stride, parts, capacity) -> KeyedJaggedTensor:
    """Concatenates the ids of JaggedTensors / KJTs (``parts``) into one KJT."""
    caps = [p.values().shape[0] for p in parts]
    capacity = _capacity.check_capacity_arg(sum(caps) if capacity is None else capacity)
    hosts = [_capacity.concrete_or_none(p.lengths()) for p in parts]
    if all(h is not None for h in hosts):
        _check_fits(sum(int(h.sum(dtype=np.int64)) for h in hosts), capacity)
    return _concat(list(parts), tuple(keys), stride, capacity)


# Jitted bodies: eager calls compile once per static signature instead of op by op.


@jax.jit
def _length_per_key(kjt: KeyedJaggedTensor) -> jax.Array:
    if kjt._ranks is None:
        return kjt._lengths.reshape(len(kjt._keys), kjt._stride).sum(axis=1, dtype=jnp.int32)
    return jnp.diff(_gather.exclusive_cumsum(kjt._lengths)[_bounds(kjt)])


@jax.jit
def _offset_per_key(kjt: KeyedJaggedTensor) -> jax.Array:
    return _gather.exclusive_cumsum(_length_per_key(kjt))


def _segment(kjt: KeyedJaggedTensor, start: int, end: int, capacity: int):
    """Values/weights of keys ``start:end`` (contiguous), moved to the front."""
    opk = _offset_per_key(kjt)
    return _gather.gather_segments(
        (kjt._values, kjt._weights),
        opk[start : start + 1],
        (opk[end] - opk[start]).reshape(1),
        capacity,
    )


@functools.partial(jax.jit, static_argnums=1)
def _jagged_at(kjt: KeyedJaggedTensor, i: int) -> JaggedTensor:
    values, weights = _segment(kjt, i, i + 1, kjt.capacity)
    return JaggedTensor._make(values, _key_lengths(kjt, i), weights)


@jax.jit
def _to_dict(kjt: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
    return {k: _jagged_at(kjt, i) for k, i in kjt.index_per_key().items()}


@functools.partial(jax.jit, static_argnums=(1, 2))
def _permute(kjt: KeyedJaggedTensor, indices: tuple[int, ...], capacity: int) -> KeyedJaggedTensor:
    lpk, opk = _length_per_key(kjt), _offset_per_key(kjt)
    idx = np.asarray(indices, np.int32)
    values, weights = _gather.gather_segments(
        (kjt._values, kjt._weights), opk[:-1][idx], lpk[idx], capacity
    )
    keys = [kjt._keys[i] for i in indices]
    if kjt._ranks is None:
        lengths = kjt._lengths.reshape(len(kjt._keys), kjt._stride)[idx].reshape(-1)
        return KeyedJaggedTensor._make(keys, kjt._stride, values, lengths, weights)
    lengths = jnp.concatenate([_key_lengths(kjt, i) for i in indices] + [kjt._lengths[:0]])
    ranks = tuple(kjt._ranks[i] for i in indices)
    inverse = None if kjt._inverse is None else kjt._inverse[idx]
    stride = max((sum(r) for r in ranks), default=0)
    return KeyedJaggedTensor._make(keys, stride, values, lengths, weights, ranks, inverse)


@functools.partial(jax.jit, static_argnums=1)
def _split(kjt: KeyedJaggedTensor, segments: tuple[int, ...]) -> list[KeyedJaggedTensor]:
    out, start, bounds = [], 0, _bounds(kjt)
    for seg in segments:
        end = start + seg
        if seg == 0:
            values = jnp.zeros((0,), kjt._values.dtype)
            weights = None if kjt._weights is None else jnp.zeros((0,), kjt._weights.dtype)
        else:
            values, weights = _segment(kjt, start, end, kjt.capacity)
        lengths = kjt._lengths[bounds[start] : bounds[end]]
        if kjt._ranks is None:
            out.append(KeyedJaggedTensor._make(kjt._keys[start:end], kjt._stride, values, lengths, weights))
        else:
            ranks = kjt._ranks[start:end]
            inverse = None if kjt._inverse is None else kjt._inverse[start:end]
            out.append(KeyedJaggedTensor._make(kjt._keys[start:end], max((sum(r) for r in ranks), default=0),
                                               values, lengths, weights, ranks, inverse))
        start = end
    return out


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _concat(parts, keys, stride, capacity) -> KeyedJaggedTensor:
    values = [p.values() for p in parts]
    weights = None if parts[0].weights_or_none() is None else [p.weights() for p in parts]
    caps = [v.shape[0] for v in values]
    starts = jnp.asarray(np.cumsum([0] + caps[:-1]), jnp.int32)
    totals = jnp.stack([p.lengths().sum(dtype=jnp.int32) for p in parts])
    flat_v = jnp.concatenate(values)
    flat_w = None if weights is None else jnp.concatenate(weights)
    out_v, out_w = _gather.gather_segments((flat_v, flat_w), starts, totals, capacity)
    lengths = jnp.concatenate([p.lengths() for p in parts])
    if not any(getattr(p, "_ranks", None) is not None for p in parts):
        return KeyedJaggedTensor._make(keys, stride, out_v, lengths, out_w)
    ranks = sum((tuple(p._ranks) for p in parts), ())
    inverses = [p._inverse for p in parts if p._keys]
    inverse = None if any(x is None for x in inverses) else jnp.concatenate(inverses)
    return KeyedJaggedTensor._make(keys, max((sum(r) for r in ranks), default=0), out_v, lengths, out_w,
                                   ranks, inverse)
