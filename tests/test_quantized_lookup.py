"""jaxrec.ops.quantized_lookup: the CPU and CUDA kernels and the jnp reference, each against
a float64 NumPy pooling of the dequantized rows; mixed precisions in one call, duplicates,
empty bags, ids outside their table (row 0), padding, odd sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrec.ops.quantized_lookup import MAX_FEATURES_PER_CALL, quantized_lookup
from jaxrec.ops.quantized_rows import dequantize_rows, quantize_rows

TOLERANCE = {jnp.float32: 2e-5, jnp.float16: 2e-3, jnp.bfloat16: 1.6e-2}  # ~ a few ulps of the output


def _tables(rng, specs):
    """(tables, their rows dequantized in float64) for specs [(rows, dim, precision)]."""
    tables, exact = [], []
    for rows, dim, precision in specs:
        w = (rng.normal(0, 0.5, (rows, dim)) * rng.uniform(0.1, 2, (rows, 1))).astype(np.float32)
        if precision in ("int8", "int4"):
            table = quantize_rows(w, precision)
            exact.append(np.asarray(dequantize_rows(table, precision), np.float64))
        else:
            table = w.astype(np.float16 if precision == "fp16" else np.float32)
            exact.append(table.astype(np.float64))
        tables.append(jnp.asarray(table))
    return tables, exact


def _bags(rng, rows_of_feature, batch, pad=5):
    """ids and offsets of random bags (empty ones, duplicates, ids outside the table), then
    ``pad`` padding positions holding junk."""
    lengths = rng.integers(0, 6, len(rows_of_feature) * batch)
    lengths[::4] = 0
    ids = []
    for k, n in enumerate(lengths):
        rows = rows_of_feature[k // batch]
        bag = rng.integers(0, rows, n)
        if n > 2:
            bag[1] = bag[0]  # a duplicate
        if k % 7 == 3 and n:
            bag[-1] = rows if k % 2 else -1  # outside the table: reads row 0
        ids.append(bag)
    ids.append(rng.integers(-5, 10**6, pad))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return np.concatenate(ids).astype(np.int32), offsets.astype(np.int32)


def _float64_lookup(exact, feature_tables, ids, offsets, psw, pooling, batch):
    out_rows = [[] for _ in range(batch)]
    sequence = np.zeros((len(ids), exact[feature_tables[0]].shape[1])) if pooling == "NONE" else None
    for f, t in enumerate(feature_tables):
        table = exact[t]
        for b in range(batch):
            start, end = offsets[f * batch + b], offsets[f * batch + b + 1]
            bag = ids[start:end]
            rows = table[np.where((bag >= 0) & (bag < len(table)), bag, 0)]
            if pooling == "NONE":
                sequence[start:end] = rows
            w = np.ones(len(bag)) if psw is None else psw[start:end].astype(np.float64)
            pooled = (rows * w[:, None]).sum(0)
            if pooling == "MEAN" and len(bag):
                pooled /= len(bag)
            out_rows[b].append(pooled)
    return sequence if pooling == "NONE" else np.stack([np.concatenate(r) for r in out_rows])


MIXED = [(37, 16, "int8"), (19, 24, "int4"), (11, 6, "fp16"), (13, 5, "fp32"), (50, 128, "int8")]
ONE_DIM = [(37, 16, "int8"), (19, 16, "int4"), (11, 16, "fp16"), (13, 16, "fp32")]


@pytest.mark.parametrize("pooling", ["SUM", "MEAN", "NONE"])
@pytest.mark.parametrize("weighted", [False, True])
def test_kernel_and_reference_match_float64(platform, pooling, weighted):
    rng = np.random.default_rng([3, len(pooling), weighted])
    specs = ONE_DIM if pooling == "NONE" else MIXED
    feature_tables = [0, 1, 2, 3, 0] + ([4] if pooling != "NONE" else [])
    tables, exact = _tables(rng, specs)
    batch = 13
    ids, offsets = _bags(rng, [specs[t][0] for t in feature_tables], batch)
    psw = rng.uniform(-1, 2, ids.shape).astype(np.float32) if weighted else None
    expected = _float64_lookup(exact, feature_tables, ids, offsets, psw, pooling, batch)
    precisions = [s[2] for s in specs]
    for backend in ("kernel", "reference"):
        out = jax.jit(lambda i, o, w, b=backend: quantized_lookup(
            tables, precisions, feature_tables, i, o, pooling=pooling, per_sample_weights=w, backend=b))(
            ids, offsets, psw)
        assert out.shape == expected.shape and out.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(out), expected, rtol=TOLERANCE[jnp.float32],
                                   atol=TOLERANCE[jnp.float32], err_msg=backend)
    if pooling == "NONE":  # padding positions are zero rows
        np.testing.assert_array_equal(np.asarray(out)[offsets[-1]:], 0)


@pytest.mark.parametrize("output_dtype", [jnp.float16, jnp.bfloat16])
def test_half_outputs(platform, output_dtype):
    rng = np.random.default_rng(4)
    tables, exact = _tables(rng, MIXED)
    feature_tables = [4, 0, 1]
    ids, offsets = _bags(rng, [MIXED[t][0] for t in feature_tables], 9)
    out = quantized_lookup(tables, [s[2] for s in MIXED], feature_tables, ids, offsets, output_dtype=output_dtype)
    assert out.dtype == output_dtype
    expected = _float64_lookup(exact, feature_tables, ids, offsets, None, "SUM", 9)
    tol = TOLERANCE[output_dtype]
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=tol, atol=tol)


def test_int64_ids(platform, x64):
    rng = np.random.default_rng(5)
    tables, exact = _tables(rng, MIXED[:2])
    ids, offsets = _bags(rng, [37, 19], 6)
    out = quantized_lookup(tables, ["int8", "int4"], [0, 1], ids.astype(np.int64), offsets.astype(np.int64))
    expected = _float64_lookup(exact, [0, 1], ids, offsets, None, "SUM", 6)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("pooling", ["SUM", "NONE"])
def test_more_features_than_one_launch_takes(platform, pooling):
    rng = np.random.default_rng(6)
    tables, exact = _tables(rng, ONE_DIM[:3])
    feature_tables = [f % 3 for f in range(MAX_FEATURES_PER_CALL + 7)]
    ids, offsets = _bags(rng, [ONE_DIM[t][0] for t in feature_tables], 3)
    out = quantized_lookup(tables, ["int8", "int4", "fp16"], feature_tables, ids, offsets, pooling=pooling)
    expected = _float64_lookup(exact, feature_tables, ids, offsets, None, pooling, 3)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-5)


def test_bad_arguments_are_named():
    rng = np.random.default_rng(7)
    tables, _ = _tables(rng, MIXED[:2])
    ids, offsets = _bags(rng, [37], 4)
    with pytest.raises(ValueError, match=r"precisions\[0\] must be one of"):
        quantized_lookup(tables[:1], ["int2"], [0], ids, offsets)
    with pytest.raises(ValueError, match=r"tables\[0\] \(int8\) must be uint8"):
        quantized_lookup([jnp.zeros((3, 20), jnp.float32)], ["int8"], [0], ids, offsets)
    with pytest.raises(ValueError, match="embedding_dim 14 must be a positive multiple of 4"):
        quantized_lookup([jnp.zeros((3, 18), jnp.uint8)], ["int8"], [0], ids, offsets)
    with pytest.raises(ValueError, match=r"feature_tables \[2\] name no table"):
        quantized_lookup(tables, ["int8", "int4"], [2], ids, offsets)
    with pytest.raises(ValueError, match="offsets must hold F \\* B \\+ 1 entries for F = 2"):
        quantized_lookup(tables, ["int8", "int4"], [0, 1], ids, offsets[:-1])
    with pytest.raises(ValueError, match="every feature needs one dim"):
        quantized_lookup(tables, ["int8", "int4"], [0, 1], ids, np.concatenate([offsets, offsets[1:]]),
                         pooling="NONE")
    with pytest.raises(ValueError, match="a quantized embedding table has no gradient"):
        jax.grad(lambda w: quantized_lookup(tables[:1], ["int8"], [0], ids, offsets,
                                            per_sample_weights=w).sum())(jnp.ones(ids.shape))
