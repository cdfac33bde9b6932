"""``sort_by_row``: the CPU handler's radix sort against XLA's sort of the same keys
(``sort_by_row_reference``, what the GPU runs), on random batches with bad ids, empty
bags and positions outside every bag."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds_testing import random_case

from jaxrec import _ffi
from jaxrec.ops import TableLayout
from jaxrec.ops.row_sort import sort_by_row, sort_by_row_reference
from jaxrec.ops.tbe_reference import clamp_offsets


@pytest.fixture(autouse=True)
def on_the_cpu():
    """The handler is the CPU's (the GPU sorts with XLA), so these tests run there on any machine."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def assert_same_sort(layout, indices, offsets):
    indices, offsets = jnp.asarray(indices), jnp.asarray(offsets)
    got = jax.jit(lambda i, o: sort_by_row(layout, i, o, backend="kernel"))(indices, offsets)
    want = jax.jit(lambda i, o: sort_by_row_reference(layout, i, o))(indices, offsets)
    for name, g, w in zip(("keys", "positions", "bags"), got, want):
        assert g.dtype == indices.dtype, name
        np.testing.assert_array_equal(g, w, err_msg=name)


def large_case(rng, dtype, rows):
    """Enough positions for several chunks of a radix pass, padding before the first bag
    and after the last, empty bags, about 5% bad ids, and many duplicates."""
    batch_size = 3001
    lengths = rng.integers(0, 60, size=len(rows) * batch_size) * (rng.random(len(rows) * batch_size) < 0.9)
    offsets = 7 + np.concatenate([[0], np.cumsum(lengths)])
    indices = np.concatenate([rng.integers(0, min(rows[k // batch_size], 5000), size=n)
                              for k, n in enumerate(lengths)] + [np.zeros(0, int)])
    indices = np.concatenate([np.full(7, -1), indices, np.full(11, 10**6)])
    bad = rng.random(indices.size) < 0.05
    indices[bad] = rng.choice([-3, 2**30, int(max(rows))], size=int(bad.sum()))
    return indices.astype(dtype), offsets.astype(dtype)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_handler_equals_the_xla_sort(dtype, x64):
    rng = np.random.default_rng(3)
    for _ in range(12):
        rows, indices, offsets = random_case(rng, dtype)
        layout = TableLayout.from_embedding_specs([(int(r), 4) for r in rows])
        assert_same_sort(layout, indices, np.asarray(clamp_offsets(jnp.asarray(offsets), indices.size)))
    # One radix pass (16 rows), two, and three (5M rows: 23 bits).
    for rows in ([16, 3], [70_000, 9, 1234], [5_000_000, 3, 70]):
        layout = TableLayout.from_embedding_specs([(r, 4) for r in rows])
        assert_same_sort(layout, *large_case(rng, dtype, rows))
    # Small ids of one large table and no sentinel: the highest pass sees one digit and is skipped.
    layout = TableLayout.from_embedding_specs([(5_000_000, 4)])
    indices = rng.integers(0, 3000, size=200_000).astype(dtype)
    assert_same_sort(layout, indices, np.arange(0, 200_001, 40).astype(dtype))


def test_shared_tables_and_empty_batches():
    layout = TableLayout.from_embedding_specs([(50, 4), (9, 4)], feature_table_map=[1, 0, 1])
    rng = np.random.default_rng(5)
    offsets = np.array([0, 3, 3, 5, 9, 9, 12], np.int32)
    assert_same_sort(layout, rng.integers(-2, 55, size=14).astype(np.int32), offsets)
    assert_same_sort(layout, np.zeros(0, np.int32), np.zeros(1, np.int32))  # B = 0, N = 0
    assert_same_sort(layout, rng.integers(0, 9, size=4).astype(np.int32), np.zeros(1, np.int32))  # ids outside bags


def test_decreasing_offsets_are_refused():
    layout = TableLayout.from_embedding_specs([(10, 4)])
    with pytest.raises(Exception, match=r"jaxrec_sort_by_row: offsets must be non-decreasing; offsets\[2\]"):
        jax.block_until_ready(sort_by_row(layout, jnp.zeros(6, jnp.int32), jnp.array([0, 4, 2, 6], jnp.int32),
                                          backend="kernel"))


def test_keys_past_int32_are_refused():
    layout = TableLayout.from_embedding_specs([(2**30, 4), (2**30, 4)])
    with pytest.raises(ValueError, match="more than int32 row keys can number: pass int64 indices"):
        sort_by_row(layout, jnp.zeros(4, jnp.int32), jnp.array([0, 2, 4], jnp.int32))


def test_the_handler_names_a_bad_operand():
    """Past the wrapper: an operand of another dtype, or T values missing, is refused by name."""
    assert _ffi.has_kernel("cpu")  # registers the CPU handlers
    indices = jnp.zeros(4, jnp.int32)
    result = jax.ShapeDtypeStruct((4,), jnp.int32)
    call = jax.ffi.ffi_call("jaxrec_sort_by_row", (result, result, result))
    rows, first = jnp.array([10], jnp.int32), jnp.array([0], jnp.int32)
    with pytest.raises(Exception, match="must have the indices' dtype int32, got float32"):
        jax.block_until_ready(call(indices, jnp.array([0.0, 4.0], jnp.float32), rows, first))
    with pytest.raises(Exception, match="must hold T >= 1 values each, got 1 and 2"):
        jax.block_until_ready(call(indices, jnp.array([0, 4], jnp.int32), rows, jnp.array([0, 0], jnp.int32)))
    got = call(indices, jnp.array([0, 4], jnp.int32), rows, first)  # the control
    np.testing.assert_array_equal(got[1], np.arange(4))
