"""Fixtures for the jagged-type tests: eager/jit runners and host views of the layouts.

Test modules import them by name (``from sparse_testing import run, ...``). This is not a
``conftest.py``: a second module named ``conftest`` would shadow ``tests/conftest.py``
for modules that do ``from conftest import ...``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

GARBAGE_VALUES = (999, -7)
GARBAGE_WEIGHTS = (-7.0, 1e6)


@pytest.fixture(params=["eager", "jit"])
def run(request):
    """``run(f, *args)``: ``f(*args)`` eagerly, then (second param) under ``jax.jit``."""
    if request.param == "eager":
        return lambda f, *args: f(*args)
    return lambda f, *args: jax.jit(f)(*args)


def _garbage_like(total, capacity, pattern, dtype):
    pad = np.resize(np.asarray(pattern), capacity - total)
    return pad.astype(dtype)


@pytest.fixture
def padded():
    """``padded(data, capacity, dtype)``: a jax array = data + garbage (999, -7, ...) padding."""

    def make(data, capacity, dtype=jnp.int32):
        data = np.asarray(data, dtype)
        pattern = GARBAGE_WEIGHTS if np.issubdtype(np.dtype(dtype), np.floating) else GARBAGE_VALUES
        tail = _garbage_like(len(data), capacity, pattern, dtype)
        return jnp.asarray(np.concatenate([data, tail]))

    return make


def _bags(flat, lengths):
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
    return [flat[offsets[i] : offsets[i + 1]].tolist() for i in range(len(lengths))]


@pytest.fixture
def kjt_bags():
    """Host view ``[(key, [bag, ...]), ...]`` of a KJT; asserts its padding is 0 unless told not."""

    def view(kjt, check_padding=True, weights=False):
        lengths = np.asarray(kjt.lengths())
        values = np.asarray(kjt.values())
        total = int(lengths.sum())
        assert lengths.shape == (len(kjt.keys()) * kjt.stride(),)
        if check_padding:
            np.testing.assert_array_equal(values[total:], 0)
            if kjt.weights_or_none() is not None:
                np.testing.assert_array_equal(np.asarray(kjt.weights())[total:], 0)
        flat = np.asarray(kjt.weights()) if weights else values
        s = kjt.stride()
        return [(k, _bags(flat, lengths)[i * s : (i + 1) * s]) for i, k in enumerate(kjt.keys())]

    return view


@pytest.fixture
def jt_bags():
    """Host view ``[bag, ...]`` of a JaggedTensor; asserts its padding is 0 unless told not to."""

    def view(jt, check_padding=True, weights=False):
        lengths = np.asarray(jt.lengths())
        flat = np.asarray(jt.weights() if weights else jt.values())
        if check_padding:
            np.testing.assert_array_equal(flat[int(lengths.sum()) :], 0)
        return _bags(flat, lengths)

    return view
