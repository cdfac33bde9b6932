"""The main job's tests build the same small models again and again (every run, resumed
runs too, makes its own jitted step): a persistent compilation cache for the session turns
each repeat compile into a load, identical programs and results, seconds faster each."""

import jax
import pytest


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache(tmp_path_factory):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
