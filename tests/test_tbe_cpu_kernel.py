"""The CPU TBE handlers (csrc/cpu/tbe_forward.cc, tbe_backward.cc) against float64 NumPy.

The handlers are called directly through ``jax.ffi.ffi_call`` (the wrapper in
``jaxrec.ops.tbe`` adds validation and the custom_vjp on top). Bags are FBGEMM's::

    #              b=0       b=1     b=2   <-- batch (B = 3)
    # feature 0    [4, 4]    []      [1]        (ids repeat, bags may be empty)
    # feature 1    [0]       [2, 5]  []
    # indices = [<pad>, 4, 4, 1, 0, 2, 5, <pad>, <pad>]      (N = 9, pads are 10**9)
    # offsets = [1, 3, 3, 4, 5, 7, 7]                        (T * B + 1 = 7)

Tolerances: the kernels sum in float32 and the reference in float64, so an element
that sums n terms may differ by about n * 2**-24 times the sum of the terms'
magnitudes; every case here has n <= 140, so ``1e-5 * sum|terms|`` bounds it
(``ACC_RTOL``). A float16/bfloat16 output adds its own rounding: half an ulp,
``2**-11`` / ``2**-8`` relative, plus half the smallest subnormal for float16.
"""


import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrec import _ffi

SUM, MEAN, NONE = 0, 1, 2
PAD_ID = 10**9  # padding ids: reading one would crash or fail the comparison
ACC_RTOL = 1e-5
OUT_RTOL = {np.float32: 0.0, np.float16: 2.0**-11, ml_dtypes.bfloat16: 2.0**-8}
OUT_ATOL = {np.float32: 0.0, np.float16: 2.0**-25, ml_dtypes.bfloat16: 0.0}
FLOATS = [np.float32, np.float16, ml_dtypes.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def register_targets():
    """jaxrec registers its CPU handlers (jaxrec._ffi.TARGETS) when the library loads."""
    if not _ffi.has_kernel("cpu"):
        pytest.skip("jaxrec was built without its CPU library (see jaxrec.build_info())")


def packed_layout(tables, feature_table):
    """tables: [(rows, dim)]; feature_table[f] = table of feature f -> (int32 operand, parts)."""
    starts = np.concatenate([[0], np.cumsum([r * d for r, d in tables])])
    off = [int(starts[t]) for t in feature_table]
    dims = [tables[t][1] for t in feature_table]
    rows = [tables[t][0] for t in feature_table]
    first_rows = np.concatenate([[0], np.cumsum([r for r, _ in tables])])
    first = [int(first_rows[t]) for t in feature_table]
    out_off = np.concatenate([[0], np.cumsum(dims)]).tolist()
    packed = np.array(off + dims + rows + first + out_off, np.int64).view(np.int32)
    return packed, dict(off=off, dims=dims, rows=rows, out_off=out_off, size=int(starts[-1]))


class Case:
    """A random lookup: several tables, shared tables, empty bags, duplicates, padding."""

    def __init__(self, rng, tables, feature_table, batch, max_len, pooling, weighted,
                 weight_dtype=np.float32, index_dtype=np.int32, lead=2, tail=5):
        self.layout, self.parts = packed_layout(tables, feature_table)
        self.T, self.B, self.pooling, self.weighted = len(feature_table), batch, pooling, weighted
        lengths = rng.integers(0, max_len + 1, self.T * batch)
        lengths[rng.random(lengths.size) < 0.2] = 0  # more empty bags
        total = int(lengths.sum())
        self.N = lead + total + tail
        self.offsets = (lead + np.concatenate([[0], np.cumsum(lengths)])).astype(index_dtype)
        self.indices = np.full(self.N, PAD_ID, index_dtype)
        for k in range(self.T * batch):
            rows = self.parts["rows"][k // batch]
            # Few distinct rows, so ids repeat within and across bags.
            self.indices[self.offsets[k]:self.offsets[k + 1]] = rng.integers(0, min(rows, 7) if k % 3 == 0
                                                                             else rows, lengths[k])
        self.weights = rng.standard_normal(self.parts["size"]).astype(weight_dtype)
        self.psw = (rng.standard_normal(self.N).astype(np.float32) if weighted
                    else np.zeros(0, np.float32))
        if weighted:  # padding weights must never be read
            self.psw[:lead] = np.nan
            self.psw[lead + total:] = np.nan

    def bags(self):
        """(f, b, positions) of every bag."""
        for k in range(self.T * self.B):
            yield k // self.B, k % self.B, np.arange(self.offsets[k], self.offsets[k + 1])

    def row(self, table, f, i):
        p = self.parts
        return table[p["off"][f] + int(i) * p["dims"][f]:][:p["dims"][f]]

    def out_shape(self):
        if self.pooling == NONE:
            return (self.N, self.parts["dims"][0])
        return (self.B, self.parts["out_off"][-1])

    def reference(self):
        """float64 output and the sum of |terms| of each element (for the tolerance)."""
        w64 = self.weights.astype(np.float64)
        out, mag = np.zeros(self.out_shape()), np.zeros(self.out_shape())
        for f, b, pos in self.bags():
            for p in pos:
                r = self.row(w64, f, self.indices[p])
                if self.pooling == NONE:
                    out[p], mag[p] = r, np.abs(r)
                    continue
                s = (1.0 / len(pos) if self.pooling == MEAN else 1.0) * (self.psw[p] if self.weighted else 1.0)
                cols = slice(self.parts["out_off"][f], self.parts["out_off"][f + 1])
                out[b, cols] += s * r
                mag[b, cols] += np.abs(s * r)
        return out, mag

    def reference_grad(self, g):
        g64, w64 = g.astype(np.float64), self.weights.astype(np.float64)
        gw, gw_mag = np.zeros(self.weights.size), np.zeros(self.weights.size)
        gp, gp_mag = np.zeros(self.psw.size), np.zeros(self.psw.size)
        for f, b, pos in self.bags():
            scale = 1.0 / max(len(pos), 1) if self.pooling == MEAN else 1.0
            cols = slice(self.parts["out_off"][f], self.parts["out_off"][f + 1])
            for p in pos:
                gr = g64[p] if self.pooling == NONE else g64[b, cols]
                coeff = scale * (self.psw[p] if self.weighted else 1.0)
                self.row(gw, f, self.indices[p])[:] += coeff * gr
                self.row(gw_mag, f, self.indices[p])[:] += np.abs(coeff * gr)
                if self.weighted:
                    terms = gr * self.row(w64, f, self.indices[p])
                    gp[p], gp_mag[p] = scale * terms.sum(), scale * np.abs(terms).sum()
        return gw, gw_mag, gp, gp_mag


def forward(case, out_dtype=np.float32):
    call = jax.ffi.ffi_call("jaxrec_tbe_forward", jax.ShapeDtypeStruct(case.out_shape(), out_dtype))
    return np.asarray(jax.jit(lambda *a: call(*a, pooling=np.int32(case.pooling)))(
        case.weights, case.indices, case.offsets, case.psw, case.layout))


def backward(case, g):
    shapes = (jax.ShapeDtypeStruct(case.weights.shape, jnp.float32),
              jax.ShapeDtypeStruct(case.psw.shape, jnp.float32))
    call = jax.ffi.ffi_call("jaxrec_tbe_backward", shapes)
    gw, gp = jax.jit(lambda *a: call(*a, pooling=np.int32(case.pooling)))(
        g, case.weights, case.indices, case.offsets, case.psw, case.layout)
    return np.asarray(gw), np.asarray(gp)


def assert_close(got, want, mag, out_dtype=np.float32):
    got = np.asarray(got, np.float64)
    tol = ACC_RTOL * mag * (1 + OUT_RTOL[out_dtype]) + OUT_RTOL[out_dtype] * np.abs(want) + OUT_ATOL[out_dtype]
    bad = ~(np.abs(got - want) <= tol)
    assert not bad.any(), (f"{bad.sum()} of {bad.size} differ; first at {np.argwhere(bad)[0]}: "
                           f"got {got[bad][0]}, want {want[bad][0]}")


# Tables of different rows and dims (1, 3, 6, 130, 8); features 0 and 3 share table 0,
# features 2 and 4 share table 2.
MIXED_TABLES = [(50, 6), (7, 1), (300, 130), (20, 3), (1000, 8)]
MIXED_FEATURES = [0, 1, 2, 0, 2, 3, 4]
SEQ_TABLES = [(40, 12), (9, 12), (300, 12)]
SEQ_FEATURES = [0, 1, 2, 0]


def make_case(rng, pooling, weighted, **kw):
    tables, features = (SEQ_TABLES, SEQ_FEATURES) if pooling == NONE else (MIXED_TABLES, MIXED_FEATURES)
    return Case(rng, tables, features, kw.pop("batch", 9), kw.pop("max_len", 12), pooling, weighted, **kw)


@pytest.mark.parametrize("pooling,weighted", [(SUM, False), (SUM, True), (MEAN, False), (MEAN, True),
                                              (NONE, False)])
@pytest.mark.parametrize("weight_dtype", FLOATS)
def test_forward(pooling, weighted, weight_dtype):
    rng = np.random.default_rng(pooling * 10 + weighted)
    case = make_case(rng, pooling, weighted, weight_dtype=weight_dtype)
    want, mag = case.reference()
    for out_dtype in FLOATS:
        assert_close(forward(case, out_dtype), want, mag, out_dtype)


@pytest.mark.parametrize("pooling,weighted", [(SUM, False), (SUM, True), (MEAN, False), (MEAN, True),
                                              (NONE, False)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_backward(pooling, weighted, dtype):
    """dtype: of the weights and of grad_output."""
    rng = np.random.default_rng(100 + pooling * 10 + weighted)
    case = make_case(rng, pooling, weighted, weight_dtype=dtype)
    g = rng.standard_normal(case.out_shape()).astype(dtype)
    gw, gp = backward(case, g)
    want_gw, gw_mag, want_gp, gp_mag = case.reference_grad(g)
    assert gw.dtype == np.float32 and gw.shape == case.weights.shape
    assert_close(gw, want_gw, gw_mag)
    assert_close(gp, want_gp, gp_mag)
    if weighted:  # padding positions get a zero gradient
        assert np.all(gp[:case.offsets[0]] == 0) and np.all(gp[case.offsets[-1]:] == 0)


def test_int64_ids(x64):
    rng = np.random.default_rng(7)
    for pooling, weighted in [(SUM, True), (MEAN, False), (NONE, False)]:
        case = make_case(rng, pooling, weighted, index_dtype=np.int64)
        want, mag = case.reference()
        assert_close(forward(case), want, mag)
        g = rng.standard_normal(case.out_shape()).astype(np.float32)
        gw, gp = backward(case, g)
        want_gw, gw_mag, want_gp, gp_mag = case.reference_grad(g)
        assert_close(gw, want_gw, gw_mag)
        assert_close(gp, want_gp, gp_mag)


def test_large_batch_uses_all_paths():
    """Enough bags for many parallel work items; wide rows (D = 128, 130) and long bags."""
    rng = np.random.default_rng(8)
    case = Case(rng, [(2000, 128), (500, 130), (3, 4)], [0, 1, 2, 0], 300, 30, SUM, True)
    want, mag = case.reference()
    assert_close(forward(case), want, mag)


@pytest.mark.parametrize("out_dtype", [np.float16, ml_dtypes.bfloat16])
def test_output_rounding_is_nearest_even(out_dtype):
    """NONE pooling is a pure conversion: fp32 rows -> fp16/bf16 must equal NumPy's RNE cast."""
    rng = np.random.default_rng(9)
    case = Case(rng, [(64, 16)], [0], 4, 8, NONE, False)
    info = ml_dtypes.finfo(out_dtype)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, float(info.max), 65519.0, 65520.0, 1e6,
                        float(info.tiny), float(info.smallest_subnormal), 1.5 * float(info.smallest_subnormal),
                        2.5 * float(info.smallest_subnormal), 1 + float(info.eps) / 2, 1 + 1.5 * float(info.eps),
                        3e-38, 1e-45, -1 - float(info.eps) / 2], np.float32)
    ties = (rng.standard_normal(200).astype(out_dtype).astype(np.float32)
            + rng.standard_normal(200).astype(out_dtype).astype(np.float32) * np.float32(info.eps / 2))
    values = np.concatenate([special, ties, rng.standard_normal(case.weights.size) * 10.0**rng.integers(-9, 6)])
    case.weights = values[:case.weights.size].astype(np.float32)
    got = forward(case, out_dtype)
    want = np.zeros(case.out_shape(), out_dtype)
    for f, _, pos in case.bags():
        for p in pos:
            with np.errstate(over="ignore"):  # fp32 -> fp16 overflow to inf is expected
                want[p] = case.row(case.weights, f, case.indices[p]).astype(out_dtype)
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))  # nan == nan here
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("weight_dtype", [np.float16, ml_dtypes.bfloat16])
def test_input_conversion_is_exact(weight_dtype):
    """fp16/bf16 weights -> fp32 output, including subnormals, inf and nan."""
    rng = np.random.default_rng(10)
    case = Case(rng, [(1 << 12, 16)], [0], 64, 20, NONE, False, weight_dtype=weight_dtype)
    case.weights = np.arange(1 << 16, dtype=np.uint16).view(weight_dtype)  # every bit pattern
    case.indices[case.offsets[0]:case.offsets[-1]] = rng.permutation(1 << 12)[:case.offsets[-1] - case.offsets[0]]
    got = forward(case, np.float32)
    want = np.zeros(case.out_shape(), np.float32)
    for f, _, pos in case.bags():
        for p in pos:
            want[p] = case.row(case.weights, f, case.indices[p]).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_backward_is_deterministic():
    """Many duplicates of few rows: two runs agree bit for bit."""
    rng = np.random.default_rng(11)
    case = Case(rng, [(5, 64), (3, 7)], [0, 1, 0], 400, 25, SUM, True)
    g = rng.standard_normal(case.out_shape()).astype(np.float32)
    first = backward(case, g)
    for _ in range(3):
        again = backward(case, g)
        np.testing.assert_array_equal(again[0], first[0])
        np.testing.assert_array_equal(again[1], first[1])


def _call_forward(case, out_shape, **overrides):
    args = dict(weights=case.weights, indices=case.indices, offsets=case.offsets, psw=case.psw, layout=case.layout)
    args.update(overrides)
    call = jax.ffi.ffi_call("jaxrec_tbe_forward", jax.ShapeDtypeStruct(out_shape, np.float32))
    return jax.block_until_ready(call(*args.values(), pooling=np.int32(case.pooling)))


@pytest.mark.parametrize("override,message", [
    (lambda c: dict(offsets=c.offsets[:-1]), "offsets has"),
    (lambda c: dict(psw=np.ones(3, np.float32)), "per_sample_weights has"),
    (lambda c: dict(offsets=c.offsets[::-1].copy()), "non-decreasing|offsets must lie"),
    (lambda c: dict(offsets=c.offsets + np.int32(c.N)), "offsets must lie"),
    (lambda c: dict(layout=c.layout[:-2]), "layout has"),
    (lambda c: dict(weights=c.weights[:-1]), "does not fit in weights"),
    (lambda c: dict(weights=c.weights.astype(np.float64)), "weights must be float32"),
])
def test_forward_rejects_bad_operands(override, message, x64):
    rng = np.random.default_rng(12)
    case = make_case(rng, SUM, True)
    with pytest.raises(Exception, match=message):
        _call_forward(case, case.out_shape(), **override(case))


def test_rejects_bad_output_shapes():
    rng = np.random.default_rng(13)
    case = make_case(rng, SUM, False)
    with pytest.raises(Exception, match="output has shape"):
        _call_forward(case, (case.B + 1, case.out_shape()[1]))
    call = jax.ffi.ffi_call("jaxrec_tbe_backward", (jax.ShapeDtypeStruct(case.weights.shape, jnp.float32),
                                                    jax.ShapeDtypeStruct((0,), jnp.float32)))
    with pytest.raises(Exception, match="grad_output has shape"):
        jax.block_until_ready(call(np.zeros((case.B, 3), np.float32), case.weights, case.indices,
                                   case.offsets, case.psw, case.layout, pooling=np.int32(SUM)))
