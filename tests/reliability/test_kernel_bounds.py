"""No bounds-check mode reads or writes outside a feature's own table (docs/bounds_check.md).

Every reproduction of issue 18's "crashes and cross-table writes" gets a test, on the CPU
kernel and the jnp reference here and on the CUDA kernel where there is a GPU (marked
``gpu``), then a seeded fuzz over ids, offsets and per-sample weights in every mode.
The oracle is a float64 NumPy model of the documented semantics::

    # NONE: offsets -> max_{j<=i} clip(offsets[j], 0, N) (the CUDA forward: each bag
    #       clipped into [0, N] on its own); an id outside [0, rows(f)) adds nothing
    #       (MEAN still divides by L) and gets zero gradients.
    # WARNING / IGNORE: the same offsets, bad ids -> 0.   FATAL: an error.
    #
    # layout: t0 (11 x 4), t1 (5 x 3), t2 (17 x 8), canary t3 (7 x 2, read by no feature)
    # features: f0 -> t0, f1 -> t1, f2 -> t2, f3 -> t1
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrec import optim
from jaxrec.fused._update import _fused_update
from jaxrec.ops import PoolingMode, TableLayout, embedding_bag_lookup
from jaxrec.ops.tbe_sparse_grad import embedding_bag_sparse_grad

LAYOUT = TableLayout(rows=(11, 5, 17, 7), dims=(4, 3, 8, 2), feature_table_map=(0, 1, 2, 1))
CANARY = 3
BATCH, CAPACITY = 4, 40
MODES = ["FATAL", "WARNING", "IGNORE", "NONE"]
BACKENDS = [pytest.param(("cpu", "kernel"), id="cpu-kernel"),
            pytest.param(("cpu", "reference"), id="cpu-reference"),
            pytest.param(("cuda", "kernel"), id="cuda-kernel", marks=pytest.mark.gpu)]
RTOL, ATOL = 1e-5, 1e-6  # float32 sums of a few float32 terms vs float64


@pytest.fixture(params=BACKENDS)
def backend(request):
    device, name = request.param
    with jax.default_device(jax.devices(device)[0]):
        yield name


def cuda_kernel(backend: str) -> bool:
    """Whether ``backend`` (inside the ``backend`` fixture) runs the CUDA kernel."""
    device = jax.config.jax_default_device
    return backend == "kernel" and device is not None and device.platform == "gpu"


def random_tables(rng, layout=LAYOUT):
    return [rng.uniform(-1, 1, (r, d)).astype(np.float32) for r, d in zip(layout.rows, layout.dims)]


def flat(layout, tables):
    return jnp.asarray(np.concatenate([t.ravel() for t in tables]))


def split(layout, weights):
    w = np.asarray(weights, np.float64)
    return [w[o:o + r * d].reshape(r, d) for o, r, d in zip(layout.table_offsets, layout.rows, layout.dims)]


# --- the float64 model ---------------------------------------------------------------


def clamp_offsets(offsets, n):
    return np.maximum.accumulate(np.clip(np.asarray(offsets, np.int64), 0, n))


def bag_ranges(offsets, n, per_bag=False):
    """[start, end) of each bag: the corrected offsets, or (``per_bag``, the CUDA forward
    under NONE) each bag clamped into [0, N] on its own, so that bags may overlap."""
    if not per_bag:
        off = clamp_offsets(offsets, n)
        return list(zip(off[:-1], off[1:]))
    off = np.clip(np.asarray(offsets, np.int64), 0, n)
    return [(s, max(s, e)) for s, e in zip(off[:-1], off[1:])]


def bags(layout, indices, offsets, per_bag=False):
    """(feature, sample, position, id, valid, length) of every position inside a bag."""
    ranges = bag_ranges(offsets, len(indices), per_bag)
    batch = len(ranges) // layout.num_features
    for k, (start, end) in enumerate(ranges):
        f, b = divmod(k, batch)
        for p in range(start, end):
            i = int(indices[p])
            yield f, b, p, i, 0 <= i < layout.feature_rows[f], end - start


def model(layout, tables, indices, offsets, pooling, psw, grad_output, per_bag=False):
    """Output, table gradients and per-sample-weight gradient of the NONE semantics
    (``per_bag``: the bags of the CUDA forward under NONE, ``bag_ranges``)."""
    batch = (len(offsets) - 1) // layout.num_features
    cols = layout.output_offsets
    out = np.zeros((batch, layout.total_dim))
    grads = [np.zeros(t.shape) for t in tables]
    gpsw = np.zeros(len(indices))
    g = np.asarray(grad_output, np.float64)
    for f, b, p, i, ok, length in bags(layout, indices, offsets, per_bag):
        if not ok:
            continue
        t = layout.feature_table_map[f]
        scale = 1.0 / length if pooling == PoolingMode.MEAN else 1.0
        w = 1.0 if psw is None else float(psw[p])
        gb = g[b, cols[f]:cols[f + 1]]
        out[b, cols[f]:cols[f + 1]] += scale * w * tables[t][i]
        grads[t][i] += scale * w * gb
        gpsw[p] = scale * gb @ tables[t][i]
    return out, grads, gpsw


def corrected_ids(layout, indices, offsets):
    """WARNING/IGNORE's ids: bad ids inside bags become 0."""
    fixed = np.array(indices)
    for _, _, p, _, ok, _ in bags(layout, indices, offsets):
        if not ok:
            fixed[p] = 0
    return fixed


# --- the ops under test ----------------------------------------------------------------


def lookup_and_grads(weights, indices, offsets, psw, grad_output, *, pooling, mode, backend,
                     layout=LAYOUT):
    def f(w, p):
        return embedding_bag_lookup(w, indices, offsets, layout=layout, pooling=pooling,
                                    per_sample_weights=p, bounds_check_mode=mode, backend=backend)

    out, vjp = jax.vjp(f, weights, psw)
    gw, gpsw = vjp(jnp.asarray(grad_output, jnp.float32))
    return np.asarray(out), split(layout, gw), np.asarray(gpsw)


def check_against_model(layout, tables, indices, offsets, psw, grad_output, got, pooling,
                        cuda_none=False):
    """``cuda_none``: the CUDA kernel under NONE, whose forward clamps each bag on its own
    (docs/bounds_check.md); its gradients take the corrected offsets like every path."""
    want_out, want_grads, want_gpsw = model(layout, tables, indices, offsets, pooling, psw, grad_output)
    if cuda_none:
        want_out = model(layout, tables, indices, offsets, pooling, psw, grad_output, True)[0]
    out, grads, gpsw = got
    np.testing.assert_allclose(out, want_out, rtol=RTOL, atol=ATOL)
    for t in range(layout.num_tables):
        np.testing.assert_allclose(grads[t], want_grads[t], rtol=RTOL, atol=ATOL, err_msg=f"table {t}")
    np.testing.assert_allclose(gpsw, want_gpsw, rtol=RTOL, atol=ATOL)


def one_bag_case(rng, ids, feature=0):
    """Feature `feature`'s bag of sample 0 holds `ids` (after a good id); every other bag is empty."""
    n = CAPACITY
    indices = np.zeros(n, np.asarray(ids).dtype if isinstance(ids, np.ndarray) else np.int32)
    k = feature * BATCH
    bag = [1] + list(ids)
    indices[:len(bag)] = bag
    offsets = np.zeros(LAYOUT.num_features * BATCH + 1, indices.dtype)
    offsets[k + 1:] = len(bag)
    psw = rng.uniform(0.5, 1.5, n).astype(np.float32)
    grad_output = rng.normal(size=(BATCH, LAYOUT.total_dim)).astype(np.float32)
    return indices, offsets, psw, grad_output


# --- the reproductions -------------------------------------------------------------------


@pytest.mark.parametrize("bad_id", [123456789, -7, 11, -1], ids=["huge", "negative", "rows", "minus1"])
@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.MEAN])
def test_bad_id_under_none_contributes_nothing(backend, bad_id, pooling):
    """123456789 crashed the CPU kernel (also under grad), -7 read garbage, id == rows read
    table 1's first row; each now adds nothing and gets zero gradients."""
    rng = np.random.default_rng(1)
    tables = random_tables(rng)
    indices, offsets, psw, g = one_bag_case(rng, [bad_id, 3])
    got = lookup_and_grads(flat(LAYOUT, tables), indices, offsets, psw, g, pooling=pooling,
                           mode="NONE", backend=backend)
    check_against_model(LAYOUT, tables, indices, offsets, psw, g, got, pooling)
    assert got[2][1] == 0  # the bad id's per-sample-weight gradient


@pytest.mark.parametrize("bad_id", [2**31, 2**31 + 3, 2**40, -(2**31) - 5])
def test_int64_ids_beyond_int32_are_out_of_range(backend, x64, bad_id):
    """int64 ids of 2**31 crashed the CPU kernel; they must not wrap into a valid row."""
    rng = np.random.default_rng(2)
    tables = random_tables(rng)
    indices, offsets, psw, g = one_bag_case(rng, np.array([bad_id, 2], np.int64))
    got = lookup_and_grads(flat(LAYOUT, tables), indices, offsets, psw, g, pooling=PoolingMode.SUM,
                           mode="NONE", backend=backend)
    check_against_model(LAYOUT, tables, indices, offsets, psw, g, got, PoolingMode.SUM)


def test_int64_host_ids_without_x64_get_a_clear_error():
    """Without x64, JAX would wrap 2**31 to -2**31 silently."""
    indices = np.array([1, 2**31], np.int64)
    offsets = np.array([0, 2] + [2] * (LAYOUT.num_features * 1 - 1), np.int64)
    with pytest.raises(ValueError, match="jax_enable_x64"):
        embedding_bag_lookup(flat(LAYOUT, random_tables(np.random.default_rng(0))), indices, offsets,
                             layout=LAYOUT, bounds_check_mode="NONE")


@pytest.mark.parametrize("offsets", [[-3, 2, 9, 5, 5, 60, 7, 7, 3, 100, 8, 8, 8, -1, 9, 9, 12],
                                     [0, 3, 3, 1, 0, 6, 6, 6, 6, 9, 9, 9, 40, 41, 45, 50, 99]],
                         ids=["negative-decreasing-past-end", "decreasing-past-end"])
def test_bad_offsets_under_none_are_clamped(backend, offsets):
    rng = np.random.default_rng(3)
    tables = random_tables(rng)
    indices = rng.integers(0, 5, CAPACITY).astype(np.int32)
    offsets = np.array(offsets, np.int32)
    psw = rng.uniform(0.5, 1.5, CAPACITY).astype(np.float32)
    g = rng.normal(size=(BATCH, LAYOUT.total_dim)).astype(np.float32)
    got = lookup_and_grads(flat(LAYOUT, tables), indices, offsets, psw, g, pooling=PoolingMode.MEAN,
                           mode="NONE", backend=backend)
    check_against_model(LAYOUT, tables, indices, offsets, psw, g, got, PoolingMode.MEAN,
                        cuda_none=cuda_kernel(backend))


def test_sequence_pooling_gives_zero_rows_for_bad_ids(backend):
    layout = TableLayout(rows=(6, 4), dims=(4, 4), feature_table_map=(0, 1))
    rng = np.random.default_rng(4)
    tables = random_tables(rng, layout)
    indices = np.array([2, 6, -1, 3, 4, 1, 0, 0], np.int32)  # f0: [2, 6, -1]; f1: [3, 4, 1]
    offsets = np.array([0, 3, 3, 6, 6], np.int32)
    out = np.asarray(embedding_bag_lookup(flat(layout, tables), indices, offsets, layout=layout,
                                          pooling="none", bounds_check_mode="NONE", backend=backend))
    want = np.zeros((8, 4), np.float32)
    want[0], want[3], want[5] = tables[0][2], tables[1][3], tables[1][1]
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("bad_id", [5, 50_000_000, -2], ids=["rows", "5e7", "negative"])
def test_fused_sgd_never_writes_another_table(backend, bad_id):
    """id == rows made SGD update row 0 of another table; 5e7 crashed."""
    rng = np.random.default_rng(5)
    tables = random_tables(rng)
    indices, offsets, psw, g = one_bag_case(rng, [bad_id, 2], feature=1)  # f1 reads t1 (5 rows)
    config = optim.SGD(learning_rate=0.5)
    weights = flat(LAYOUT, tables)
    new_w, _, gpsw, _ = _fused_update(weights, optim.init_state(config, LAYOUT), g, indices, offsets,
                                      layout=LAYOUT, config=config, hparams=None, pooling=PoolingMode.SUM,
                                      per_sample_weights=psw, bounds_check_mode="NONE", backend=backend)
    _, grads, want_gpsw = model(LAYOUT, tables, indices, offsets, PoolingMode.SUM, psw, g)
    got = split(LAYOUT, new_w)
    for t in range(LAYOUT.num_tables):
        np.testing.assert_allclose(got[t], tables[t] - 0.5 * grads[t], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(gpsw), want_gpsw, rtol=RTOL, atol=ATOL)
    for t in (0, 2, 3):
        np.testing.assert_array_equal(got[t], tables[t])


def test_sparse_grad_drops_bad_ids():
    rng = np.random.default_rng(6)
    tables = random_tables(rng)
    indices, offsets, _, g = one_bag_case(rng, [11, -3, 4, 4])
    sparse = embedding_bag_sparse_grad(g, indices, offsets, layout=LAYOUT)
    _, want, _ = model(LAYOUT, tables, indices, offsets, PoolingMode.SUM, None, g)
    for got, expected in zip(split(LAYOUT, sparse.to_dense(LAYOUT)), want):
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    assert int(sparse.num_unique) == 2  # ids 1 and 4 of table 0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_per_sample_weights_are_accepted(backend, dtype):
    rng = np.random.default_rng(7)
    tables = random_tables(rng)
    indices, offsets, psw, g = one_bag_case(rng, [2, 3, 3])
    low = jnp.asarray(psw).astype(dtype)
    weights = flat(LAYOUT, tables)
    out = embedding_bag_lookup(weights, indices, offsets, layout=LAYOUT, per_sample_weights=low,
                               backend=backend)
    want, _, _ = model(LAYOUT, tables, indices, offsets, PoolingMode.SUM, np.asarray(low, np.float64), g)
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL)
    grad = jax.grad(lambda p: jnp.sum(embedding_bag_lookup(
        weights, indices, offsets, layout=LAYOUT, per_sample_weights=p, backend=backend)))(low)
    assert grad.dtype == dtype
    config = optim.SGD()
    _, _, gpsw, _ = _fused_update(weights, optim.init_state(config, LAYOUT), g, indices, offsets,
                                  layout=LAYOUT, config=config, hparams=None, pooling=PoolingMode.SUM,
                                  per_sample_weights=low, bounds_check_mode="WARNING", backend=backend)
    assert gpsw.shape == psw.shape


# --- the fuzz --------------------------------------------------------------------------------

BAD_IDS = [-1, -7, 11, 17, 5, 123456789, 2**31 - 1]


def random_batch(rng, bad):
    """Random bags (duplicates, empty bags, odd sizes); with `bad`, bad ids and offsets too."""
    lengths = rng.integers(0, 5, LAYOUT.num_features * BATCH)
    lengths[rng.integers(0, len(lengths), 3)] = 0
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    offsets = np.minimum(offsets, CAPACITY)
    indices = np.empty(CAPACITY, np.int32)
    for k in range(len(lengths)):
        f = k // BATCH
        span = slice(offsets[k], offsets[k + 1])
        indices[span] = rng.integers(0, LAYOUT.feature_rows[f], offsets[k + 1] - offsets[k])
    indices[offsets[-1]:] = rng.choice(BAD_IDS, CAPACITY - offsets[-1])  # padding is never read
    if bad:
        where = rng.integers(0, CAPACITY, rng.integers(1, 5))
        indices[where] = rng.choice(BAD_IDS, len(where))
        if rng.random() < 0.5:
            k = rng.integers(0, len(offsets), 2)
            offsets[k] = rng.choice([-4, 0, 3, CAPACITY, CAPACITY + 9], 2)
    psw = rng.uniform(-1.5, 1.5, CAPACITY).astype(np.float32)
    grad_output = rng.normal(size=(BATCH, LAYOUT.total_dim)).astype(np.float32)
    return indices, offsets, psw, grad_output


def is_bad(indices, offsets):
    off = np.asarray(offsets, np.int64)
    if off[0] < 0 or np.any(np.diff(off) < 0) or off[-1] > len(indices):
        return True
    return any(not ok for *_, ok, _ in bags(LAYOUT, indices, offsets))


@pytest.mark.parametrize("mode", MODES)
def test_fuzz_lookup_every_mode(backend, mode):
    rng = np.random.default_rng(MODES.index(mode))
    tables = random_tables(rng)
    weights = flat(LAYOUT, tables)

    @jax.jit
    def run(indices, offsets, psw, g):
        def f(w, p):
            return embedding_bag_lookup(w, indices, offsets, layout=LAYOUT, pooling="mean",
                                        per_sample_weights=p, bounds_check_mode=mode, backend=backend)
        out, vjp = jax.vjp(f, weights, psw)
        return (out, *vjp(g))

    for case in range(12):
        indices, offsets, psw, g = random_batch(rng, bad=case % 3 != 0)
        bad = is_bad(indices, offsets)
        if mode == "FATAL" and bad:
            with pytest.raises(Exception, match="bounds_check_indices"):
                jax.block_until_ready(run(indices, offsets, psw, g))
            continue
        out, gw, gpsw = run(indices, offsets, psw, g)
        if mode in ("WARNING", "IGNORE"):
            indices = corrected_ids(LAYOUT, indices, offsets)
        check_against_model(LAYOUT, tables, indices, offsets, psw, g,
                            (np.asarray(out), split(LAYOUT, gw), np.asarray(gpsw)), PoolingMode.MEAN,
                            cuda_none=mode == "NONE" and cuda_kernel(backend))


@pytest.mark.parametrize("mode", MODES)
def test_fuzz_fused_update_every_mode(backend, mode):
    """Rowwise Adagrad: only rows of valid ids change (weights and state); SGD: the exact step."""
    rng = np.random.default_rng(10 + MODES.index(mode))
    tables = random_tables(rng)
    weights = flat(LAYOUT, tables)
    adagrad, sgd = optim.RowWiseAdagrad(learning_rate=0.1), optim.SGD(learning_rate=0.25)
    state = optim.init_state(adagrad, LAYOUT)
    state = state._replace(momentum1=jnp.asarray(rng.uniform(0, 1, state.momentum1.shape), jnp.float32))

    @jax.jit
    def run(indices, offsets, psw, g):
        def step(config, s):
            return _fused_update(weights, s, g, indices, offsets, layout=LAYOUT, config=config,
                                 hparams=None, pooling=PoolingMode.SUM, per_sample_weights=psw,
                                 bounds_check_mode=mode, backend=backend)
        return step(adagrad, state), step(sgd, optim.init_state(sgd, LAYOUT))

    row_start = np.concatenate([[0], np.cumsum(LAYOUT.rows)[:-1]])
    for case in range(9):
        indices, offsets, psw, g = random_batch(rng, bad=case % 3 != 0)
        if mode == "FATAL" and is_bad(indices, offsets):
            with pytest.raises(Exception, match="bounds_check_indices"):
                jax.block_until_ready(run(indices, offsets, psw, g))
            continue
        (w_ada, s_ada, *_), (w_sgd, _, gpsw, _) = run(indices, offsets, psw, g)
        if mode in ("WARNING", "IGNORE"):
            indices = corrected_ids(LAYOUT, indices, offsets)
        _, grads, want_gpsw = model(LAYOUT, tables, indices, offsets, PoolingMode.SUM, psw, g)
        got = split(LAYOUT, w_sgd)
        for t in range(LAYOUT.num_tables):
            np.testing.assert_allclose(got[t], tables[t] - 0.25 * grads[t], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(np.asarray(gpsw), want_gpsw, rtol=RTOL, atol=ATOL)
        touched = [set() for _ in LAYOUT.rows]
        for f, _, _, i, ok, _ in bags(LAYOUT, indices, offsets):
            if ok:
                touched[LAYOUT.feature_table_map[f]].add(i)
        assert not touched[CANARY]
        got_ada, before = split(LAYOUT, w_ada), split(LAYOUT, weights)
        m_new, m_old = np.asarray(s_ada.momentum1), np.asarray(state.momentum1)
        for t in range(LAYOUT.num_tables):
            keep = np.setdiff1d(np.arange(LAYOUT.rows[t]), list(touched[t]))
            np.testing.assert_array_equal(got_ada[t][keep], before[t][keep], err_msg=f"table {t}")
            np.testing.assert_array_equal(m_new[row_start[t] + keep], m_old[row_start[t] + keep])


@pytest.mark.parametrize("device, backend", [
    ("cpu", "reference"),  # TT has no CPU kernel
    pytest.param("cuda", "kernel", marks=pytest.mark.gpu),
])
def test_tt_bad_ids_under_none_contribute_nothing(device, backend):
    """TT: ids past num_embeddings (97 here, while the cores hold 100 rows) or negative
    read no core slice and get zero gradients; bad offsets are clamped."""
    with jax.default_device(jax.devices(device)[0]):
        _check_tt_bad_ids(backend)


def _check_tt_bad_ids(backend):
    from jaxrec.ops import TTLayout, tt_embedding_bag
    from jaxrec.ops.tt_init import init_tt_cores
    from jaxrec.ops.tt_reference import tt_full_weight

    layout = TTLayout.create(97, 8, (3, 2), tt_p_shapes=(5, 5, 4), tt_q_shapes=(2, 2, 2))
    cores = init_tt_cores(jax.random.key(3), layout)
    rng = np.random.default_rng(8)
    indices = np.array([3, 97, 99, -1, 50, 5, 5, 123456789, 0, 0], np.int32)
    offsets = np.array([0, 4, 4, 9, 12], np.int32)  # the last offset is past N = 10
    psw = rng.uniform(0.5, 1.5, 10).astype(np.float32)
    g = rng.normal(size=(4, 8)).astype(np.float32)
    good = (indices >= 0) & (indices < 97)

    def run(p):
        def f(c, w):
            return tt_embedding_bag(c, indices, offsets, layout=layout, pooling="mean",
                                    per_sample_weights=w, bounds_check_mode="NONE", backend=backend)
        out, vjp = jax.vjp(f, cores, p)
        return (out, *vjp(jnp.asarray(g)))

    out, grad_cores, gpsw = run(psw)
    full = np.asarray(tt_full_weight(cores, layout=layout), np.float64)
    want = np.zeros((4, 8))
    want_gpsw = np.zeros(10)
    off = clamp_offsets(offsets, 10)
    for k in range(4):
        length = off[k + 1] - off[k]
        for p in range(off[k], off[k + 1]):
            if good[p]:
                want[k] += psw[p] * full[indices[p]] / length
                want_gpsw[p] = g[k] @ full[indices[p]] / length
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(gpsw, want_gpsw, rtol=1e-4, atol=1e-6)
    # The bad ids' cores gradients are those of the same batch with their weights at 0.
    _, grad_masked, _ = run(np.where(good, psw, 0).astype(np.float32))
    for got, masked in zip(grad_cores, grad_masked):
        np.testing.assert_allclose(got, masked, rtol=1e-5, atol=1e-7)
