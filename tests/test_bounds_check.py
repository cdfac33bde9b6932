"""bounds_check_indices: CPU handler, CUDA handler and jnp reference against an
independent NumPy model written as FBGEMM's sequential CPU loop."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds_testing import PADDING, fbgemm_model, random_case

from jaxrec import _ffi
from jaxrec.ops import BoundsCheckMode, bounds_check_indices


@pytest.mark.parametrize("mode", [BoundsCheckMode.WARNING, BoundsCheckMode.IGNORE])
@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_corrections_match_fbgemm_model(platform, backend, mode):
    rng = np.random.default_rng(0)
    check = jax.jit(bounds_check_indices, static_argnums=(0, 3), static_argnames="backend")
    for _ in range(24):  # each case has its own shapes: a compile per case
        rows, indices, offsets = random_case(rng)
        want_indices, want_offsets, want_count = fbgemm_model(rows, indices, offsets, mode)
        got = check(tuple(rows.tolist()), indices, offsets, mode, backend=backend)
        np.testing.assert_array_equal(got.indices, want_indices)
        np.testing.assert_array_equal(got.offsets, want_offsets)
        assert int(got.num_corrected) == want_count


def test_int64_ids(platform, x64):
    rng = np.random.default_rng(1)
    for _ in range(10):
        rows, indices, offsets = random_case(rng, dtype=np.int64)
        rows = rows * 10**10  # row counts past int32
        indices[indices == 10**6] = 10**11
        want = fbgemm_model(rows, indices, offsets, BoundsCheckMode.WARNING)
        for backend in ("kernel", "reference"):
            got = bounds_check_indices(rows, indices, offsets, "warning", backend=backend)
            assert got.indices.dtype == jnp.int64
            np.testing.assert_array_equal(got.indices, want[0])
            np.testing.assert_array_equal(got.offsets, want[1])
            assert int(got.num_corrected) == want[2]


@pytest.mark.parametrize(
    "indices, offsets, expected",
    [
        # feature 1, bag 1 holds id 9 of a 4-row table
        ([3, 7, 2, 9, 0, PADDING], [0, 2, 2, 3, 5],
         "feature 'b' of table 'tb', bag 1: indices[3]=9 is out of range for a table of 4 rows."),
        # bag 1 of feature 0 ends before it starts; the later bad id is not reported
        ([3, 7, 2, 9, 0, PADDING], [0, 2, 1, 3, 5],
         "feature 'a' of table 'ta', bag 1: offsets[1]=2, offsets[2]=1 is not a range inside "
         "indices of size 6."),
        # the last offset runs past the capacity
        ([3, 7, 2, 1, 0, PADDING], [0, 2, 2, 3, 7],
         "feature 'b' of table 'tb', bag 1: offsets[3]=3, offsets[4]=7 is not a range inside "
         "indices of size 6."),
        # negative ids are out of range too (FBGEMM's pruned -1 does not exist here)
        ([3, -1, 2, 1, 0, PADDING], [0, 2, 2, 3, 5],
         "feature 'a' of table 'ta', bag 0: indices[1]=-1 is out of range for a table of 10 rows."),
    ],
)
@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_fatal_names_feature_table_bag_and_value(platform, backend, indices, offsets, expected):
    indices, offsets = np.array(indices, np.int32), np.array(offsets, np.int32)
    names = dict(feature_names=["a", "b"], table_names=["ta", "tb"])
    check = jax.jit(lambda i, o: bounds_check_indices([10, 4], i, o, "FATAL", backend=backend, **names))
    with pytest.raises(Exception, match=re.escape("bounds_check_indices (FATAL): " + expected)):
        jax.block_until_ready(check(indices, offsets))


def test_fatal_passes_valid_input_unchanged(platform):
    rng = np.random.default_rng(2)
    for _ in range(10):
        rows, indices, offsets = random_case(rng, corrupt=False)
        for backend in ("kernel", "reference"):
            got = bounds_check_indices(rows, indices, offsets, BoundsCheckMode.FATAL, backend=backend)
            np.testing.assert_array_equal(got.indices, indices)
            np.testing.assert_array_equal(got.offsets, offsets)


def test_none_mode_returns_inputs():
    indices, offsets = jnp.array([5, -3], jnp.int32), jnp.array([4, 1], jnp.int32)
    got = bounds_check_indices([1], indices, offsets, BoundsCheckMode.NONE)
    assert got.indices is indices and got.offsets is offsets and int(got.num_corrected) == 0


def test_donated_indices_are_corrected_in_place():
    check = jax.jit(lambda i, o: bounds_check_indices([4], i, o, backend="kernel"), donate_argnums=0)
    indices, offsets = jnp.array([1, 9, 2], jnp.int32), jnp.array([0, 3], jnp.int32)
    hlo = check.lower(indices, offsets).compile().as_text()
    assert re.search(r"input_output_alias=\{ \{0\}: \(0, \{\}", hlo), hlo[:2000]
    np.testing.assert_array_equal(check(indices, offsets).indices, [1, 0, 2])


def test_vmap_over_batches_of_requests():
    rng = np.random.default_rng(3)
    indices = rng.integers(-2, 6, size=(3, 8)).astype(np.int32)
    offsets = np.array([0, 2, 5, 8], np.int32)
    got = jax.vmap(lambda i: bounds_check_indices([5, 5, 5], i, offsets, backend="kernel"))(indices)
    for r in range(3):
        want = fbgemm_model(np.array([5, 5, 5]), indices[r], offsets, BoundsCheckMode.WARNING)
        np.testing.assert_array_equal(got.indices[r], want[0])
        assert int(got.num_corrected[r]) == want[2]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(offsets=np.arange(4, dtype=np.int32)), ValueError, "offsets has 4 entries, which is not T * B + 1"),
        (dict(mode="LOUD"), ValueError, "bounds_check_mode must be one of FATAL (0), WARNING (1)"),
        (dict(indices=np.zeros(3, np.float32)), TypeError, "indices must be a 1-D int32 or int64 array"),
        (dict(feature_names=["only_one"]), ValueError, "feature_names has 1 entries but rows_per_table has 2"),
        (dict(rows=[5, -1]), ValueError, "rows_per_table must be a 1-D list of row counts >= 0"),
        (dict(backend="gpu"), ValueError, "backend must be 'auto', 'kernel' or 'reference'"),
    ],
)
def test_bad_arguments_get_clear_errors(kwargs, error, message):
    args = dict(rows=[5, 5], indices=np.array([1, 2, 3], np.int32),
                offsets=np.array([0, 1, 2, 3, 3], np.int32), mode="WARNING")
    args.update(kwargs)
    rows, indices, offsets, mode = (args.pop(k) for k in ("rows", "indices", "offsets", "mode"))
    with pytest.raises(error, match=re.escape(message)):
        bounds_check_indices(rows, indices, offsets, mode, **args)


def test_ffi_version_mismatch_tells_how_to_fix():
    _ffi.check_ffi_compatibility((0, 1), (0, 3))  # older headers: fine
    with pytest.raises(RuntimeError, match="Rebuild jaxrec against the jaxlib you run"):
        _ffi.check_ffi_compatibility((0, 4), (0, 3))


def test_build_info_reports_the_cpu_library():
    info = _ffi.build_info()
    assert info["cpu"] is True, info
    assert info["ffi_api_version"] <= info["runtime_ffi_api_version"]
    assert _ffi.has_kernel("cpu")
