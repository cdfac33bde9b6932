"""EmbeddingBagCollection / EmbeddingCollection equal the functional lookup they wrap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrec.nn import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedTables,
    set_learning_rate,
)
from jaxrec.ops import TableLayout, embedding_bag_lookup_kjt
from jaxrec.optim import SGD
from jaxrec.sparse import KeyedJaggedTensor

# t_user (SUM) serves "user"; t_item (MEAN) serves "item" and "last_item"; t_geo (SUM, bf16).
TABLES = [
    EmbeddingBagConfig(name="t_user", num_embeddings=37, embedding_dim=8, feature_names=["user"]),
    EmbeddingBagConfig(name="t_item", num_embeddings=23, embedding_dim=4,
                       feature_names=["item", "last_item"], pooling="MEAN"),
    EmbeddingBagConfig(name="t_geo", num_embeddings=11, embedding_dim=6, feature_names=["geo"]),
]
FEATURES = ["user", "item", "last_item", "geo"]
ROWS = {"user": 37, "item": 23, "last_item": 23, "geo": 11}
B = 5


def random_kjt(rng, keys, weighted=False, capacity=64):
    """Random bags (empty ones and duplicates included) of ``keys``, padded to ``capacity``."""
    lengths = rng.integers(0, 5, size=len(keys) * B)
    lengths[1] = 0
    values = np.concatenate([rng.integers(0, min(6, ROWS[k]), lengths[i * B:(i + 1) * B].sum())
                             for i, k in enumerate(keys)])
    weights = rng.uniform(0.5, 2.0, size=values.shape[0]).astype(np.float32) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights=weights,
                                               capacity=capacity)


def functional_pooled(ebc, kjt):
    """Per-feature pooled rows from embedding_bag_lookup_kjt, one table per call."""
    weights = ebc.split_embedding_weights()
    out = {}
    for t in TABLES:
        layout = TableLayout.from_embedding_specs([(t.num_embeddings, t.embedding_dim)],
                                                  [0] * len(t.feature_names))
        sub = kjt.permute([list(kjt.keys()).index(f) for f in t.feature_names])
        pooled = embedding_bag_lookup_kjt(weights[t.name].astype(jnp.float32).reshape(-1), sub,
                                          layout=layout, pooling=t.pooling)
        out.update(pooled.to_dict())
    return out


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_ebc_equals_functional_lookup(fused, weighted):
    ebc = EmbeddingBagCollection(TABLES, optimizer=SGD(learning_rate=0.1) if fused else None,
                                 rngs=nnx.Rngs(0))
    # Input keys in another order, plus a key no table uses.
    rng = np.random.default_rng(1)
    ROWS["extra"] = 9
    kjt = random_kjt(rng, ["geo", "extra", "item", "user", "last_item"], weighted)
    out = ebc(kjt)
    assert out.keys() == FEATURES
    assert out.values().shape == (B, 8 + 4 + 4 + 6)
    assert len(ebc.tables) == 2  # (SUM, f32) and (MEAN, f32): t_user and t_geo share a buffer
    expected = functional_pooled(ebc, kjt)
    for f in FEATURES:
        np.testing.assert_allclose(out[f], expected[f], rtol=1e-6, atol=1e-7)
    assert isinstance(ebc.tables[0], FusedTables if fused else nnx.Param)


def test_ebc_jit_and_bf16_table():
    tables = [TABLES[0], EmbeddingBagConfig(name="t_geo", num_embeddings=11, embedding_dim=6,
                                            feature_names=["geo"], dtype="bfloat16")]
    ebc = EmbeddingBagCollection(tables, rngs=nnx.Rngs(3))
    assert [t[...].dtype for t in ebc.tables] == [jnp.float32, jnp.bfloat16]
    kjt = random_kjt(np.random.default_rng(2), ["user", "geo"])
    eager = ebc(kjt).values()
    jitted = nnx.jit(lambda m, x: m(x).values())(ebc, kjt)
    np.testing.assert_array_equal(eager, jitted)
    assert eager.dtype == jnp.float32


@pytest.mark.parametrize("fused", [False, True])
def test_ec_equals_functional_lookup(fused):
    tables = [EmbeddingConfig(name="t_a", num_embeddings=13, embedding_dim=4, feature_names=["a"]),
              EmbeddingConfig(name="t_b", num_embeddings=7, embedding_dim=4,
                              feature_names=["b", "c"])]
    ROWS.update(a=13, b=7, c=7)
    ec = EmbeddingCollection(tables, optimizer=SGD(learning_rate=0.1) if fused else None,
                             rngs=nnx.Rngs(4))
    kjt = random_kjt(np.random.default_rng(5), ["c", "a", "b"])
    out = ec(kjt)
    assert list(out) == ["a", "b", "c"]
    w = ec.split_embedding_weights()
    for key, table in (("a", "t_a"), ("b", "t_b"), ("c", "t_b")):
        jt = kjt[key]
        n = int(jt.lengths().sum())
        ids = np.asarray(jt.values())[:n]
        np.testing.assert_array_equal(out[key].lengths(), jt.lengths())
        np.testing.assert_array_equal(out[key].values()[:n], np.asarray(w[table])[ids])
        assert not np.asarray(out[key].values()[n:]).any()  # zeros after the key's rows


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="feature names must be unique.*'user'"):
        EmbeddingBagCollection([TABLES[0], EmbeddingBagConfig(
            name="t2", num_embeddings=3, embedding_dim=8, feature_names=["user"])], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="lacks the features \\['geo'\\]"):
        EmbeddingBagCollection(TABLES, rngs=nnx.Rngs(0))(
            random_kjt(np.random.default_rng(0), ["user", "item", "last_item"]))
    with pytest.raises(TypeError, match="write feature_names=\\['x'\\]"):
        EmbeddingBagConfig(name="t", num_embeddings=3, embedding_dim=2, feature_names="x")
    with pytest.raises(ValueError, match="EmbeddingBagConfig pools"):
        EmbeddingBagConfig(name="t", num_embeddings=3, embedding_dim=2, feature_names=["x"],
                           pooling="NONE")
    with pytest.raises(ValueError, match="one embedding_dim, got \\[2, 4\\]"):
        EmbeddingCollection([EmbeddingConfig(name="a", num_embeddings=3, embedding_dim=2,
                                             feature_names=["a"]),
                             EmbeddingConfig(name="b", num_embeddings=3, embedding_dim=4,
                                             feature_names=["b"])], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_embeddings must be an int >= 1, got 0"):
        EmbeddingBagConfig(name="t", num_embeddings=0, embedding_dim=2, feature_names=["x"])
    with pytest.raises(ValueError, match="no fused tables"):
        set_learning_rate(EmbeddingBagCollection(TABLES, rngs=nnx.Rngs(0)), 0.1)


def test_init_bounds_and_init_fn():
    table = EmbeddingBagConfig(name="t", num_embeddings=400, embedding_dim=8, feature_names=["x"])
    w = np.asarray(table.init(jax.random.key(0)))
    assert np.abs(w).max() <= np.sqrt(1 / 400) and np.abs(w).max() > 0.9 * np.sqrt(1 / 400)
    custom = EmbeddingBagConfig(name="t", num_embeddings=4, embedding_dim=3, feature_names=["x"],
                                init_fn=lambda k, s, d: jax.random.normal(k, s, d) * 3.0)
    assert np.asarray(custom.init(jax.random.key(1))).std() > 1.0
    bounded = EmbeddingBagConfig(name="t", num_embeddings=50, embedding_dim=8,
                                 feature_names=["x"], weight_init_min=0.5, weight_init_max=0.6)
    w = np.asarray(bounded.init(jax.random.key(2)))
    assert w.min() >= 0.5 and w.max() <= 0.6


def test_linen_bridge_recipe():
    """docs/nn.md: Linen users wrap the module with nnx.bridge.to_linen (plain tables)."""
    from flax import linen  # noqa: F401  (the bridge needs Linen)

    tables = [EmbeddingBagConfig(name="t_user", num_embeddings=37, embedding_dim=8,
                                 feature_names=["user"])]
    ebc = nnx.bridge.to_linen(EmbeddingBagCollection, tables)
    kjt = random_kjt(np.random.default_rng(6), ["user"])
    variables = ebc.init(jax.random.key(0), kjt)
    flat = variables["params"]["tables"][0]
    layout = TableLayout.from_embedding_specs([(37, 8)])
    np.testing.assert_allclose(ebc.apply(variables, kjt).values(),
                               embedding_bag_lookup_kjt(flat, kjt, layout=layout).values(),
                               rtol=1e-6, atol=1e-7)
    grads = jax.grad(lambda v: ebc.apply(v, kjt).values().sum())(variables)
    assert grads["params"]["tables"][0].shape == (37 * 8,)
