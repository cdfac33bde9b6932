"""The int8 and int4 lookups of benchmarks/serving_lookup_gpu.py, three calls each, for
Nsight Compute to count the DRAM bytes they actually read and write:

    ncu --kernel-name regex:QuantizedLookup --launch-skip 4 --launch-count 2 \\
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \\
        python benchmarks/serving_lookup_profile.py

(the fifth launch is int8's third call, the sixth int4's).
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import serving_lookup_gpu as bench  # noqa: E402

from jaxrec.ops.quantized_lookup import quantized_lookup  # noqa: E402

T, E, B, L = bench.T, bench.E, bench.B, bench.L
keys = jax.random.split(jax.random.key(1), 2 * T)
int8 = [bench.quantized_table(keys[t], "int8") for t in range(T)]
int4 = [bench.quantized_table(keys[T + t], "int4") for t in range(T)]
ids = jnp.asarray(np.random.default_rng(0).integers(0, E, (T * B * L,)).astype(np.int32))
offsets = jnp.arange(0, T * B * L + 1, L, dtype=jnp.int32)
lookup8 = jax.jit(lambda ts, o, i: quantized_lookup(ts, ["int8"] * T, list(range(T)), i, o))
lookup4 = jax.jit(lambda ts, o, i: quantized_lookup(ts, ["int4"] * T, list(range(T)), i, o))
for _ in range(3):
    jax.block_until_ready(lookup8(int8, offsets, ids))
    jax.block_until_ready(lookup4(int4, offsets, ids))
