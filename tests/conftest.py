"""Test set-up shared by every test module.

* Eight virtual CPU devices (sharding tests need a mesh), XLA's backend optimizations
  and its MLIR fusion emitters off on machines without a GPU (compile time), and strict
  dtype promotion.
* ``@pytest.mark.gpu`` tests run only where JAX sees a CUDA GPU and jaxrec's CUDA
  library was built; elsewhere they are skipped, with the reason.
* One persistent compilation cache for the session, shared by the pytest-xdist workers:
  the tests build the same small programs again and again (every train run, resumed
  runs too, makes its own jitted step), and a repeat compile becomes a load.
* The modules of tests that take seconds each run first (``_SLOW_FIRST``), so that the
  two workers finish together (the suite on 2 cores: 285 s against 292-295).
"""

import glob
import os

# Without a GPU, the tests compile thousands of small CPU programs, and compiling is most
# of their time. XLA's backend optimizations cost more than they save at these sizes (O0:
# a minute and a half of the suite on 2 cores), and the CPU's MLIR fusion emitters take
# twice the compile time of the older LLVM IR emitters (a train step: 0.19 s against
# 0.085 s). With a GPU, the tests compile as users' programs do.
_FLAGS = "--xla_force_host_platform_device_count=8"
if not glob.glob("/dev/nvidia[0-9]*"):
    _FLAGS += " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("XLA_FLAGS", _FLAGS)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: popen-gwN/..
    jax.config.update("jax_compilation_cache_dir", str(shared / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def cuda_available() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


# Modules whose tests take seconds each (processes, notebooks, the CLI's runs) run first: a
# long test that starts late leaves one pytest-xdist worker running it alone at the end.
_SLOW_FIRST = ("test_notebooks.py", "test_multiprocess.py", "_cli.py", "test_serving_command.py",
               "test_train_job.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.split("::")[0].endswith(_SLOW_FIRST))  # stable
    if cuda_available():
        import jaxrec

        if jaxrec.build_info()["cuda"]:
            return
        reason = "jaxrec was built without its CUDA library (see jaxrec.build_info())"
    else:
        reason = "no CUDA GPU visible to JAX"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def x64():
    """64-bit JAX types during the test (int64 ids)."""
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", old)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def platform(request):
    """Runs a test once with the CPU handlers and once (marked gpu) with the CUDA ones."""
    with jax.default_device(jax.devices(request.param)[0]):
        yield request.param
