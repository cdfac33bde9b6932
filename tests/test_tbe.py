"""TBE lookup: CPU/CUDA kernels and the jnp reference against a float64 NumPy model built
from per-table ``torch.nn.functional.embedding_bag`` semantics, and against FBGEMM's
documented example."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxrec.ops import (
    PoolingMode,
    TableLayout,
    embedding_bag_lookup,
    embedding_bag_lookup_kjt,
    embedding_bag_sparse_grad,
    init_weights,
)
from jaxrec.sparse import KeyedJaggedTensor

GARBAGE_ID = 10**9  # in the padding: reading it would crash or show
# Relative error allowed by the output dtype (f32 sums vs float64: far below 1e-5).
TOLERANCE = {jnp.float32: 1e-5, jnp.float16: 2e-3, jnp.bfloat16: 1.6e-2}


def embedding_bag_numpy(table, indices, offsets, mode, per_sample_weights=None):
    """float64 ``torch.nn.functional.embedding_bag(include_last_offset=True)`` for one feature."""
    out = np.zeros((len(offsets) - 1, table.shape[1]))
    for b in range(len(offsets) - 1):
        ids = indices[offsets[b]:offsets[b + 1]]
        w = np.ones(len(ids)) if per_sample_weights is None else per_sample_weights[offsets[b]:offsets[b + 1]]
        if len(ids):
            out[b] = (w[:, None] * table[ids]).sum(0) / (len(ids) if mode == PoolingMode.MEAN else 1)
    return out


def tbe_numpy(tables, layout, indices, offsets, pooling, psw=None):
    """The TBE as one embedding_bag per feature: [B, total_dim], or [N, dim] for NONE."""
    num_features = layout.num_features
    batch = (len(offsets) - 1) // num_features
    if pooling == PoolingMode.NONE:
        out = np.zeros((len(indices), layout.feature_dims[0]))
        for f in range(num_features):
            for p in range(offsets[f * batch], offsets[(f + 1) * batch]):
                out[p] = tables[layout.feature_table_map[f]][indices[p]]
        return out
    pieces = []
    for f in range(num_features):
        lo, hi = f * batch, (f + 1) * batch
        pieces.append(embedding_bag_numpy(tables[layout.feature_table_map[f]], indices,
                                          offsets[lo:hi + 1], pooling, psw))
    return np.concatenate(pieces, axis=1)


def random_case(rng, dims=(4, 3, 16, 1, 8), batch=5, weighted=False, pooling=PoolingMode.SUM):
    """Tables of odd and even dims, two features on one table, empty bags, duplicate ids
    (few rows), garbage ids in the padding."""
    if pooling == PoolingMode.NONE:
        dims = (dims[0],) * len(dims)
    rows = tuple(int(r) for r in rng.integers(3, 12, size=len(dims)))
    feature_table_map = tuple(range(len(dims))) + (0,)
    layout = TableLayout(rows=rows, dims=tuple(dims), feature_table_map=feature_table_map)
    lengths = rng.integers(0, 5, size=layout.num_features * batch) * (rng.random(layout.num_features * batch) < 0.8)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    indices = np.full(offsets[-1] + 3, GARBAGE_ID, np.int32)
    for k in range(len(lengths)):
        indices[offsets[k]:offsets[k + 1]] = rng.integers(0, layout.feature_rows[k // batch], size=lengths[k])
    psw = rng.uniform(-1, 2, size=len(indices)).astype(np.float32) if weighted else None
    return layout, indices, offsets, psw


def split_numpy(layout, weights):
    return [np.asarray(t, np.float64) for t in layout.split_embedding_weights(weights.astype(jnp.float32))]


CASES = list(itertools.product(
    [PoolingMode.SUM, PoolingMode.MEAN, PoolingMode.NONE], [False, True],
    [jnp.float32, jnp.float16, jnp.bfloat16], [jnp.float32, jnp.float16, jnp.bfloat16]))


@pytest.mark.parametrize("pooling, weighted, weight_dtype, output_dtype",
                         [c for c in CASES if not (c[0] == PoolingMode.NONE and c[1])])
@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_forward_matches_float64_embedding_bags(platform, backend, pooling, weighted, weight_dtype, output_dtype):
    rng = np.random.default_rng(hash((pooling, weighted)) % 2**32)
    layout, indices, offsets, psw = random_case(rng, weighted=weighted, pooling=pooling)
    weights = init_weights(jax.random.key(int(rng.integers(1 << 30))), layout, weight_dtype)
    got = jax.jit(lambda w, i, o, s: embedding_bag_lookup(
        w, i, o, layout=layout, pooling=pooling, per_sample_weights=s, output_dtype=output_dtype,
        backend=backend))(weights, indices, offsets, psw)
    want = tbe_numpy(split_numpy(layout, weights), layout, indices, offsets, pooling, psw)
    assert got.dtype == output_dtype and got.shape == want.shape
    error = np.linalg.norm(np.asarray(got, np.float64) - want) / max(np.linalg.norm(want), 1e-30)
    assert error < TOLERANCE[output_dtype], error


def grads_numpy(tables, layout, indices, offsets, pooling, g, psw=None):
    """d(sum(out * g))/d tables and /d per-sample weights, float64."""
    num_features = layout.num_features
    batch = (len(offsets) - 1) // num_features
    grad_tables = [np.zeros_like(t) for t in tables]
    grad_psw = np.zeros(len(indices))
    for k in range(num_features * batch):
        f, b = divmod(k, batch)
        t, lo, hi = layout.feature_table_map[f], offsets[k], offsets[k + 1]
        cols = slice(layout.output_offsets[f], layout.output_offsets[f + 1])
        for p in range(lo, hi):
            scale = 1.0 / (hi - lo) if pooling == PoolingMode.MEAN else 1.0
            g_row = g[p] if pooling == PoolingMode.NONE else g[b, cols]
            w = 1.0 if psw is None else psw[p]
            grad_tables[t][indices[p]] += scale * w * g_row
            grad_psw[p] = scale * g_row @ tables[t][indices[p]]
    return np.concatenate([x.ravel() for x in grad_tables]), grad_psw


@pytest.mark.parametrize("pooling, weighted", [(PoolingMode.SUM, False), (PoolingMode.SUM, True),
                                               (PoolingMode.MEAN, True), (PoolingMode.NONE, False)])
@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_gradients_match_float64(platform, backend, pooling, weighted):
    rng = np.random.default_rng(7 + int(pooling) + 10 * weighted)
    layout, indices, offsets, psw = random_case(rng, weighted=weighted, pooling=pooling)
    weights = init_weights(jax.random.key(3), layout)
    out_shape = jax.eval_shape(lambda: embedding_bag_lookup(
        weights, indices, offsets, layout=layout, pooling=pooling, per_sample_weights=psw, backend="reference")).shape
    g = rng.normal(size=out_shape).astype(np.float32)

    def loss(w, s):
        out = embedding_bag_lookup(w, indices, offsets, layout=layout, pooling=pooling,
                                   per_sample_weights=s, backend=backend)
        return jnp.sum(out * g)

    if weighted:
        grad_w, grad_s = jax.jit(jax.grad(loss, argnums=(0, 1)))(weights, psw)
    else:
        grad_w, grad_s = jax.jit(jax.grad(lambda w: loss(w, None)))(weights), None
    want_w, want_s = grads_numpy(split_numpy(layout, weights), layout, indices, offsets, pooling,
                                 g.astype(np.float64), psw)
    np.testing.assert_allclose(grad_w, want_w, rtol=1e-5, atol=1e-6)
    if weighted:
        np.testing.assert_allclose(grad_s, want_s, rtol=1e-5, atol=1e-6)


def test_check_grads_of_the_kernel_path(platform):
    rng = np.random.default_rng(11)
    layout, indices, offsets, psw = random_case(rng, weighted=True, pooling=PoolingMode.MEAN)
    weights = init_weights(jax.random.key(5), layout)

    def f(w, s):
        return embedding_bag_lookup(w, indices, offsets, layout=layout, pooling=PoolingMode.MEAN,
                                    per_sample_weights=s, backend="kernel")

    check_grads(f, (weights, jnp.asarray(psw)), order=1, modes=["rev"], atol=2e-2, rtol=2e-2)


def check_sparse_grad_equals_dense_grad(index_dtype):
    rng = np.random.default_rng(12)
    layout, indices, offsets, psw = random_case(rng, weighted=True, pooling=PoolingMode.MEAN)
    indices, offsets = indices.astype(index_dtype), offsets.astype(index_dtype)
    weights = init_weights(jax.random.key(6), layout)
    g = rng.normal(size=(5, layout.total_dim)).astype(np.float32)
    sparse = jax.jit(lambda g: embedding_bag_sparse_grad(
        g, indices, offsets, layout=layout, pooling=PoolingMode.MEAN, per_sample_weights=psw))(g)
    dense = jax.grad(lambda w: jnp.sum(g * embedding_bag_lookup(
        w, indices, offsets, layout=layout, pooling=PoolingMode.MEAN, per_sample_weights=psw)))(weights)
    np.testing.assert_allclose(sparse.to_dense(layout), dense, rtol=1e-5, atol=1e-6)
    keys = set(zip(np.asarray(sparse.tables).tolist(), np.asarray(sparse.rows).tolist()))
    keys.discard((-1, 0))
    assert len(keys) == int(sparse.num_unique)  # each touched row exactly once


def test_sparse_grad_equals_dense_grad():
    check_sparse_grad_equals_dense_grad(np.int32)


def test_sparse_grad_int64_ids(x64):
    check_sparse_grad_equals_dense_grad(np.int64)


def test_fbgemm_documented_example(platform):
    """FBGEMM's SplitTableBatchedEmbeddingBagsCodegen docstring: tables (3, 8) and (5, 4),
    batch 3, with the weights it prints; its printed output has 4 decimals."""
    t0 = [[-0.9426, 0.7046, 0.4214, -0.0419, 0.1331, -0.7856, -0.8124, -0.2021],
          [-0.5771, 0.5911, -0.7792, -0.1068, -0.6203, 0.4813, -0.1677, 0.4790],
          [-0.5587, -0.0941, 0.5754, 0.3475, -0.8952, -0.1964, 0.0810, -0.4174]]
    t1 = [[-0.2513, -0.4039, -0.3775, 0.3273], [-0.5399, -0.0229, -0.1455, -0.8770],
          [-0.9520, 0.4593, -0.7169, 0.6307], [-0.1765, 0.8757, 0.8614, 0.2051],
          [-0.0603, -0.9980, -0.7958, -0.5826]]
    layout = TableLayout.from_embedding_specs([(3, 8), (5, 4)])
    weights = layout.merge_embedding_weights([jnp.array(t0), jnp.array(t1)])
    indices = jnp.array([0, 1, 2, 0, 1, 2, 0, 3, 1, 4, 2, 0, 0], jnp.int32)
    offsets = jnp.array([0, 2, 5, 7, 9, 12, 13], jnp.int32)
    out = embedding_bag_lookup(weights, indices, offsets, layout=layout, backend="kernel")
    fbgemm_output = [
        [-1.5197, 1.2957, -0.3578, -0.1487, -0.4873, -0.3044, -0.9801, 0.2769, -0.7164, 0.8528, 0.7159, -0.6719],
        [-2.0784, 1.2016, 0.2176, 0.1988, -1.3825, -0.5008, -0.8991, -0.1405, -1.2637, -0.9427, -1.8902, 0.3754],
        [-1.5013, 0.6105, 0.9968, 0.3057, -0.7621, -0.9821, -0.7314, -0.6195, -0.2513, -0.4039, -0.3775, 0.3273]]
    assert out.shape == (3, 12)
    np.testing.assert_allclose(out, fbgemm_output, atol=2.5e-4)  # 3 rows of 4-decimal inputs


def test_matches_torch_embedding_bag_when_available(platform):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(13)
    layout, indices, offsets, psw = random_case(rng, weighted=True)
    weights = init_weights(jax.random.key(8), layout)
    out = np.asarray(embedding_bag_lookup(weights, indices, offsets, layout=layout, per_sample_weights=psw))
    batch = 5
    for f in range(layout.num_features):
        table = torch.tensor(np.asarray(layout.split_embedding_weights(weights)[layout.feature_table_map[f]]))
        o = offsets[f * batch:(f + 1) * batch + 1].astype(np.int64)
        ids, weights_f = indices[o[0]:o[-1]].astype(np.int64), psw[o[0]:o[-1]]
        want = torch.nn.functional.embedding_bag(
            torch.tensor(ids), table, torch.tensor(o - o[0]), mode="sum",
            per_sample_weights=torch.tensor(weights_f), include_last_offset=True)
        cols = slice(layout.output_offsets[f], layout.output_offsets[f + 1])
        np.testing.assert_allclose(out[:, cols], want.numpy(), rtol=1e-5, atol=1e-6)


def test_int64_ids(platform, x64):
    rng = np.random.default_rng(14)
    layout, indices, offsets, _ = random_case(rng)
    weights = init_weights(jax.random.key(9), layout)
    got = embedding_bag_lookup(weights, indices.astype(np.int64), offsets.astype(np.int64),
                               layout=layout, backend="kernel")
    want = tbe_numpy(split_numpy(layout, weights), layout, indices, offsets, PoolingMode.SUM)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_kjt_front_door(platform):
    #              0       1        2  <-- batch
    # "user"       [1,4]   None    [2]
    # "item"       [0]     [3]     [3,1,0]
    kjt = KeyedJaggedTensor.from_lengths_sync(["user", "item"], [1, 4, 2, 0, 3, 3, 1, 0],
                                              [2, 0, 1, 1, 1, 3])
    layout = TableLayout.from_embedding_specs([(5, 4), (4, 4)])
    weights = init_weights(jax.random.key(10), layout)
    pooled = jax.jit(lambda w, k: embedding_bag_lookup_kjt(w, k, layout=layout))(weights, kjt)
    user, item = (np.asarray(t) for t in layout.split_embedding_weights(weights))
    assert pooled.keys() == ["user", "item"]
    np.testing.assert_allclose(pooled["user"], [user[1] + user[4], np.zeros(4), user[2]], rtol=1e-6)
    np.testing.assert_allclose(pooled["item"], [item[0], item[3], item[3] + item[1] + item[0]], rtol=1e-6)
    seq = embedding_bag_lookup_kjt(weights, kjt, layout=layout, pooling=PoolingMode.NONE)
    np.testing.assert_allclose(seq["item"].values()[:5], [item[0], item[3], item[3], item[1], item[0]], rtol=1e-6)
    np.testing.assert_array_equal(seq["item"].values()[5:], 0)
    np.testing.assert_array_equal(seq["user"].lengths(), [2, 0, 1])


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(offsets=np.arange(4, dtype=np.int32)), ValueError, "not T * B + 1 for the layout's T = 2"),
    (dict(pooling=7), ValueError, "pooling must be PoolingMode.SUM (0), MEAN (1) or NONE (2), or their names"),
    (dict(weights=jnp.zeros(3)), ValueError, "weights must be the flat buffer of 32 elements"),
    (dict(per_sample_weights=np.ones(2, np.float32)), ValueError,
     "per_sample_weights must be a floating point array of shape [4]"),
    (dict(output_dtype=jnp.int32), TypeError, "output_dtype must be float32, float16 or bfloat16"),
])
def test_bad_arguments_get_clear_errors(kwargs, error, message):
    layout = TableLayout.from_embedding_specs([(4, 4), (4, 4)])
    args = dict(weights=init_weights(jax.random.key(0), layout), indices=np.array([0, 1, 2, 3], np.int32),
                offsets=np.array([0, 1, 2, 3, 4], np.int32))
    args.update(kwargs)
    w, i, o = args.pop("weights"), args.pop("indices"), args.pop("offsets")
    with pytest.raises(error, match=__import__("re").escape(message)):
        embedding_bag_lookup(w, i, o, layout=layout, **args)
