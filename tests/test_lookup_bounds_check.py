"""The lookup's own bounds check (in the CUDA forward kernel as it reads the ids; the
standalone op first on the CPU) against ``bounds_check_indices`` followed by an
unchecked lookup, on random corrupted input: the same output, gradients, WARNING count
and FATAL message."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds_testing import random_case

from jaxrec.ops import BoundsCheckMode, PoolingMode, TableLayout, bounds_check_indices, embedding_bag_lookup
from jaxrec.ops.tbe import lookup_and_count, prepare_lookup


def layout_for(rng, rows, pooling):
    dims = [8] * len(rows) if pooling == PoolingMode.NONE else rng.choice([3, 4, 8, 12, 36], size=len(rows))
    return TableLayout(rows=tuple(int(r) for r in rows), dims=tuple(int(d) for d in dims),
                       feature_table_map=tuple(range(len(rows))))


def checked_lookup(weights, indices, offsets, psw, *, layout, pooling, mode):
    """``(output, num_corrected)`` of the lookup with its own check."""
    config, indices, offsets, psw = prepare_lookup(
        weights, indices, offsets, layout=layout, pooling=pooling, per_sample_weights=psw,
        output_dtype=jnp.float32, bounds_check_mode=mode, backend="auto", feature_names=None,
        table_names=None)
    return lookup_and_count(config)(weights, psw, indices, offsets)


def standalone_then_lookup(weights, indices, offsets, psw, *, layout, pooling, mode):
    """The standalone op's correction, then a lookup that checks nothing (the jnp reference)."""
    fixed = bounds_check_indices(layout.feature_rows, indices, offsets, mode, backend="reference")
    out = embedding_bag_lookup(weights, fixed.indices, fixed.offsets, layout=layout, pooling=pooling,
                               per_sample_weights=psw, bounds_check_mode="NONE", backend="reference")
    return out, fixed.num_corrected


def long_decreasing_case(rng):
    """More bags than the CUDA correction's tile (1024), with offsets that decrease."""
    rows = np.array([40, 7, 300])
    batch_size = 700
    lengths = rng.integers(0, 4, size=3 * batch_size)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    indices = rng.integers(-5, 60, size=int(offsets[-1]) + 3).astype(np.int32)
    offsets[[5, 1100, 1900]] = [offsets[5] + 40, offsets[1100] - 30, -2]
    return rows, indices, offsets


def jitted_with_gradients(lookup, kwargs):
    """``lookup``'s output, count and the gradients of the output for a cotangent, in one
    compiled function (one compile per case instead of an eager forward and two pullbacks)."""
    def run(weights, psw, indices, offsets, cotangent):
        out, pullback, count = jax.vjp(lambda w, p: lookup(w, indices, offsets, p, **kwargs), weights, psw,
                                       has_aux=True)
        return out, count, pullback(cotangent)
    return jax.jit(run)


# IGNORE corrects as WARNING does and only does not count: one pooling is enough for it.
# Each case compiles twice; the CPU, where the lookup runs the standalone op first, needs
# fewer cases than the CUDA forward, whose own check is what is tested.
@pytest.mark.parametrize("mode, pooling", [
    (BoundsCheckMode.WARNING, PoolingMode.SUM), (BoundsCheckMode.WARNING, PoolingMode.MEAN),
    (BoundsCheckMode.WARNING, PoolingMode.NONE), (BoundsCheckMode.IGNORE, PoolingMode.SUM)])
def test_lookup_corrects_and_counts_as_the_standalone_op(platform, mode, pooling):
    rng = np.random.default_rng(10 * int(mode) + int(pooling))
    cases = [random_case(rng) for _ in range(6 if platform == "cuda" else 2)] + [long_decreasing_case(rng)]
    for rows, indices, offsets in cases:
        layout = layout_for(rng, rows, pooling)
        weights = jnp.asarray(rng.normal(size=layout.num_weights), jnp.float32)
        psw = None if pooling == PoolingMode.NONE else jnp.asarray(rng.normal(size=indices.shape), jnp.float32)
        kwargs = dict(layout=layout, pooling=pooling, mode=mode)
        want = jax.eval_shape(functools.partial(standalone_then_lookup, **kwargs), weights, indices, offsets, psw)[0]
        cotangent = jnp.asarray(rng.normal(size=want.shape), jnp.float32)
        want, want_count, want_grads = jitted_with_gradients(standalone_then_lookup, kwargs)(
            weights, psw, indices, offsets, cotangent)
        got, got_count, got_grads = jitted_with_gradients(checked_lookup, kwargs)(
            weights, psw, indices, offsets, cotangent)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert int(got_count) == (int(want_count) if mode == BoundsCheckMode.WARNING else 0)
        # The gradients read the ids and offsets as the forward corrected them.
        for got_grad, want_grad in zip(got_grads, want_grads):  # sums in another order: a looser tolerance
            if want_grad is not None:
                np.testing.assert_allclose(got_grad, want_grad, rtol=1e-4, atol=1e-4)


def standalone_fatal_message(layout, indices, offsets):
    """The standalone op's FATAL message (its CPU handler: it raises where it runs, where a
    failing callback on the GPU is only logged), or None for valid input."""
    try:
        with jax.default_device(jax.devices("cpu")[0]):
            jax.block_until_ready(bounds_check_indices(
                layout.feature_rows, indices, offsets, "FATAL", backend="kernel",
                table_names=[str(t) for t in layout.feature_table_map]))
        return None
    except Exception as error:
        message = re.search(r"bounds_check_indices \(FATAL\).*", str(error)).group(0)
        return re.sub(r" \[executable_name='[^']*'\].*", "", message)  # the runtime's, not the check's


def test_fatal_raises_the_standalone_ops_message(platform):
    rng = np.random.default_rng(7)
    found, cases = 0, 16 if platform == "cuda" else 5  # the CPU lookup runs the standalone op
    for _ in range(cases):
        rows, indices, offsets = random_case(rng)
        layout = layout_for(rng, rows, PoolingMode.SUM)
        weights = jnp.asarray(rng.normal(size=layout.num_weights), jnp.float32)
        message = standalone_fatal_message(layout, indices, offsets)
        lookup = jax.jit(lambda w, i, o, layout=layout: embedding_bag_lookup(
            w, i, o, layout=layout, bounds_check_mode="FATAL"))
        if message is None:
            want = embedding_bag_lookup(weights, indices, offsets, layout=layout, bounds_check_mode="NONE",
                                        backend="reference")
            np.testing.assert_allclose(lookup(weights, indices, offsets), want, rtol=1e-5, atol=1e-5)
            continue
        found += 1
        with pytest.raises(Exception, match=re.escape(message)):
            jax.block_until_ready(lookup(weights, indices, offsets))
    assert found >= cases // 3  # most random cases are corrupt
