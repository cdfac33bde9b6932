"""tests/parallel run on the 8 virtual CPU devices (tests/conftest.py), on any machine: the
meshes take jax.devices("cpu") and every test computes on the CPU. The GPU equality check
is benchmarks/sharded_dlrm_gpu.py."""

import jax
import pytest


@pytest.fixture(autouse=True)
def on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield
