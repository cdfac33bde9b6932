"""``jaxrec._ffi.dispatch``: the branches it traces and the one a platform lowers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrec import _ffi
from jaxrec.ops import bounds_check_indices


def traced_by(platforms=None):
    """The branches that tracing one dispatch calls, within lowering_platforms(platforms)."""
    calls = []

    def branch(name):
        return lambda x: (calls.append(name), x + 1)[1]

    kernels = {"cpu": branch("cpu kernel"), "cuda": branch("cuda kernel")}
    f = lambda x: _ffi.dispatch(kernels, branch("reference"), x)
    if platforms is None:
        jax.make_jaxpr(f)(jnp.ones(3))
    else:
        with _ffi.lowering_platforms(platforms):
            jax.make_jaxpr(f)(jnp.ones(3))
    return calls


def test_kernels_with_handlers_are_traced_and_the_reference_only_where_a_backend_lacks_them():
    backends = set(jax.extend.backend.backends())
    assert "cpu" in backends
    expected = {f"{p} kernel" for p in ("cpu", "cuda") if _ffi.has_kernel(p)}
    if any(p in backends and not _ffi.has_kernel(p) for p in ("cpu", "cuda")):
        expected.add("reference")
    assert sorted(traced_by()) == sorted(expected)


def test_named_lowering_platforms_are_traced_and_the_reference_covers_the_others():
    assert sorted(traced_by(["cpu"])) == ["cpu kernel"]
    traced = traced_by(["cpu", "cuda", "tpu"])  # 'tpu': no handler, the reference
    cuda = "cuda kernel" if _ffi.has_kernel("cuda") else "reference"
    assert sorted(traced) == sorted({"cpu kernel", cuda, "reference"})
    assert traced_by(["tpu"]) == ["reference"]


def test_the_kernel_backend_refuses_platforms_without_handlers():
    with _ffi.lowering_platforms(["tpu"]), pytest.raises(RuntimeError, match=r"backend='kernel'.*\['tpu'\]"):
        _ffi.dispatch(lambda x: x, lambda x: x, jnp.ones(3), backend="kernel")


def test_an_export_to_cuda_needs_no_gpu_where_the_cuda_handlers_are_built():
    if not _ffi.has_kernel("cuda"):
        pytest.skip("jaxrec was built without its CUDA library (jaxrec.build_info())")
    check = jax.jit(lambda i, o: bounds_check_indices([4], i, o).indices)
    allowed = [jax.export.DisabledSafetyCheck.custom_call(t) for t in _ffi.custom_call_targets()]
    indices, offsets = jnp.array([1, 9, 2], jnp.int32), jnp.array([0, 3], jnp.int32)
    exported = jax.export.export(check, platforms=("cpu", "cuda"), disabled_checks=allowed)(indices, offsets)
    assert exported.platforms == ("cpu", "cuda") and "jaxrec_bounds_check_indices" in exported.mlir_module()


@pytest.mark.gpu
def test_a_gpu_computation_lowers_the_cuda_handler():
    # The backend's name must be the platform_dependent key 'cuda'; under another name the
    # GPU would lower the jnp reference, with the same results but none of the speed.
    check = jax.jit(lambda i, o: bounds_check_indices([4], i, o).indices)
    indices, offsets = jnp.array([1, 9, 2], jnp.int32), jnp.array([0, 3], jnp.int32)
    assert "jaxrec_bounds_check_indices" in check.lower(indices, offsets).as_text()
    np.testing.assert_array_equal(check(indices, offsets), [1, 0, 2])
