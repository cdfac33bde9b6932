"""jaxrec.serving: row-wise int8 / int4 quantization (FBGEMM's inference layout), the
quantized lookup against a float64 NumPy lookup of the dequantized rows, and a trained
DLRM served quantized (AUC, bytes)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrec import metrics, serving
from jaxrec.data import SyntheticClickLog
from jaxrec.models import DLRM
from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig, make_train_step
from jaxrec.optim import RowWiseAdagrad
from jaxrec.sparse import KeyedJaggedTensor


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_rows_come_back_within_the_bound(precision):
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.3, (57, 16)).astype(np.float32) * rng.uniform(0.01, 3, (57, 1)).astype(np.float32)
    w[5] = 0.25  # a constant row: scale 0, back exactly
    rows = serving.quantize_rows(w, precision)
    assert rows.dtype == np.uint8 and rows.shape == (57, serving.row_bytes(16, precision))
    assert rows.shape[1] == 4 + (16 if precision == "int8" else 8)
    back = np.asarray(serving.dequantize_rows(rows, precision))
    error = np.abs(back - w).max(axis=1)
    assert (error <= serving.quantization_error_bound(w, precision)).all()
    np.testing.assert_array_equal(back[5], w[5])
    step = (w.max(1) - w.min(1)) / (255 if precision == "int8" else 15)
    assert error.max() > 0.1 * step.max()  # the bound is not vacuous: errors are of its order


def test_odd_dims_and_bad_values_are_refused():
    with pytest.raises(ValueError, match="embedding_dim 12 must be a positive multiple of 8"):
        serving.quantize_rows(np.zeros((3, 12), np.float32), "int4")
    with pytest.raises(ValueError, match="NaN or Inf"):
        serving.quantize_rows(np.full((2, 4), np.nan, np.float32), "int8")
    with pytest.raises(ValueError, match="keep such a table in fp32"):  # float16 scale would overflow
        serving.quantize_rows(np.array([[-4e4, 4e4, 0, 1]], np.float32), "int8")
    with pytest.raises(ValueError, match="precision must be one of"):
        serving.quantize_rows(np.zeros((2, 4), np.float32), "int2")


def _collection(pooling="SUM"):
    tables = [EmbeddingBagConfig(name="t_a", num_embeddings=40, embedding_dim=8, feature_names=["a"]),
              EmbeddingBagConfig(name="t_b", num_embeddings=25, embedding_dim=8,
                                 feature_names=["b", "c"], pooling=pooling)]
    return EmbeddingBagCollection(tables, rngs=nnx.Rngs(3))


@pytest.mark.parametrize("pooling", ["SUM", "MEAN"])
@pytest.mark.parametrize("weighted", [False, True])
def test_lookup_equals_pooling_the_dequantized_rows(pooling, weighted):
    """Random bags with duplicates, empty bags, an id past its table (row 0), against a
    float64 NumPy pooling of the dequantized rows."""
    ebc = _collection(pooling)
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 4, 3 * 5)
    lengths[[2, 7]] = 0
    rows = {"a": 40, "b": 25, "c": 25}
    values = np.concatenate([rng.integers(0, rows[k], lengths[5 * j:5 * j + 5].sum())
                             for j, k in enumerate("abc")])
    values[1] = 99  # outside t_a: read as row 0
    weights = rng.uniform(0.5, 2, values.size).astype(np.float32) if weighted else None
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b", "c"], values, lengths, weights=weights,
                                              capacity=values.size + 6)
    served = serving.QuantizedEmbeddingBagCollection(ebc, {"t_a": "int8", "t_b": "int4"})
    out = np.asarray(served(kjt).values())
    table = {"a": ("t_a", "int8"), "b": ("t_b", "int4"), "c": ("t_b", "int4")}
    expected, start = [], 0
    for j, key in enumerate("abc"):
        name, precision = table[key]
        deq = np.asarray(serving.dequantize_rows(served.tables[name][...], precision), np.float64)
        block = np.zeros((5, deq.shape[1]))
        for b in range(5):
            n = lengths[5 * j + b]
            ids = values[start:start + n]
            ids = np.where(ids < rows[key], ids, 0)
            w = np.ones(n) if weights is None else weights[start:start + n].astype(np.float64)
            block[b] = (deq[ids] * w[:, None]).sum(0)
            if pooling == "MEAN" and key != "a" and n:
                block[b] /= n
            start += n
        expected.append(block)
    np.testing.assert_allclose(out, np.concatenate(expected, 1), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="precisions name tables"):
        serving.quantize(ebc, {"t_zz": "int8"})


def test_a_trained_dlrm_served_quantized_keeps_its_auc():
    log = SyntheticClickLog(max_rows=2_000, seed=0)
    tables = [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=n, embedding_dim=16, feature_names=[k])
              for k, n in zip(log.keys, log.table_sizes)]
    ebc = EmbeddingBagCollection(tables, optimizer=RowWiseAdagrad(learning_rate=0.1), rngs=nnx.Rngs(0))
    model = DLRM(ebc, log.num_dense, [32, 16], [32, 16, 1], rngs=nnx.Rngs(1))
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    def loss_fn(model, batch):
        return optax.sigmoid_binary_cross_entropy(model(batch.dense, batch.sparse)[:, 0], batch.labels).mean()

    step = make_train_step(loss_fn)
    for batch in log.batches(256, 100):
        step(model, optimizer, batch)
    held_out = next(log.batches(4096, 1, start=10**6))

    def auc(m):
        scores = jax.jit(lambda m, b: m(b.dense, b.sparse)[:, 0])(m, held_out)
        return metrics.auc(np.asarray(held_out.labels), np.asarray(scores))

    fp32 = auc(model)
    int8, report8 = serving.quantize(model, "int8")
    int4, report4 = serving.quantize(model, {"*": "int4", "t_" + log.keys[0]: "int8"})
    assert abs(auc(int8) - fp32) < 0.001 and abs(auc(int4) - fp32) < 0.003
    assert report8.ratio > 3.0 and report4.bytes_after < report8.bytes_after
    assert report4.precisions["t_" + log.keys[0]] == "int8"
    assert isinstance(model.sparse_arch, EmbeddingBagCollection)  # left as it was
    assert isinstance(int8.sparse_arch, serving.QuantizedEmbeddingBagCollection)


def test_there_is_no_gradient_through_a_quantized_table():
    served = serving.QuantizedEmbeddingBagCollection(_collection(), {"t_a": "int8", "t_b": "int8"})
    def loss(weights):  # 3 keys x 2 samples, one id each
        features = KeyedJaggedTensor.from_lengths_sync(["a", "b", "c"], np.arange(6), np.ones(6, np.int32),
                                                       weights=weights, capacity=6)
        return jnp.sum(served(features).values())

    assert np.isfinite(float(loss(jnp.ones(6))))
    with pytest.raises(ValueError, match="a quantized embedding table has no gradient"):
        jax.grad(loss)(jnp.ones(6))
