"""Variable batch size per key (TorchRec's VBE): a KJT whose keys have different numbers
of bags, mapped to the full batch by inverse indices, against the same batch expanded by
hand (every sample given its own copy of its bags) — outputs, gradients and a fused
training step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, make_train_step
from jaxrec.ops import TableLayout, embedding_bag_lookup_kjt, init_weights
from jaxrec.optim import RowWiseAdagrad
from jaxrec.sparse import KeyedJaggedTensor

KEYS = ["user", "user_hist", "item"]
ROWS = [40, 40, 25]


def variable_batch(rng, batch, strides, weighted=False):
    """(VBE KJT, the same batch expanded by hand as a KJT of stride ``batch``). Bags hold 0-4
    ids with duplicates; every bag of a key is used by some sample, and some several times."""
    lengths = [rng.integers(0, 5, size=s) for s in strides]
    bags = [[rng.integers(0, r, size=n) for n in ls] for r, ls in zip(ROWS, lengths)]
    inverse = np.stack([np.concatenate([np.arange(s), rng.integers(0, s, size=batch - s)])[rng.permutation(batch)]
                        for s in strides]).astype(np.int32)
    flat = np.concatenate([b for key_bags in bags for b in key_bags]).astype(np.int32)
    weights = rng.uniform(0.5, 1.5, size=flat.size).astype(np.float32) if weighted else None
    vbe = KeyedJaggedTensor(KEYS, flat, weights=weights, lengths=np.concatenate(lengths),
                            stride_per_key_per_rank=[[s] for s in strides], inverse_indices=(KEYS, inverse))
    starts = np.concatenate([[0], np.cumsum(np.concatenate(lengths))])
    first_bag = np.concatenate([[0], np.cumsum(strides)])
    take, full_lengths = [], []
    for k in range(len(KEYS)):
        for b in range(batch):
            bag = first_bag[k] + inverse[k, b]
            take.append(np.arange(starts[bag], starts[bag + 1]))
            full_lengths.append(starts[bag + 1] - starts[bag])
    take = np.concatenate(take).astype(int)
    full = KeyedJaggedTensor(KEYS, flat[take], weights=None if weights is None else weights[take],
                             lengths=np.asarray(full_lengths), stride=batch)
    return vbe, full


def test_kjt_accessors_and_re_layouts():
    rng = np.random.default_rng(0)
    vbe, full = variable_batch(rng, 6, [2, 2, 6])
    assert vbe.variable_stride_per_key() and vbe.stride() == 6
    assert vbe.stride_per_key() == [2, 2, 6] and vbe.stride_per_key_per_rank() == [[2], [2], [6]]
    lengths = np.asarray(vbe.lengths())
    np.testing.assert_array_equal(vbe.length_per_key(), [lengths[:2].sum(), lengths[2:4].sum(), lengths[4:].sum()])
    np.testing.assert_array_equal(vbe["user_hist"].lengths(), lengths[2:4])
    permuted = jax.jit(lambda k: k.permute([2, 0]))(vbe)
    assert permuted.keys() == ["item", "user"] and permuted.stride_per_key() == [6, 2]
    np.testing.assert_array_equal(permuted.inverse_indices()[1], np.asarray(vbe.inverse_indices()[1])[[2, 0]])
    np.testing.assert_array_equal(permuted["user"].values()[:lengths[:2].sum()],
                                  vbe["user"].values()[:lengths[:2].sum()])
    first, rest = vbe.split([1, 2])
    assert first.stride_per_key() == [2] and rest.stride_per_key() == [2, 6]
    again = KeyedJaggedTensor.concat([KeyedJaggedTensor.empty(), first, rest])  # keyless parts hold no bags
    assert again.stride_per_key() == [2, 2, 6]
    assert KeyedJaggedTensor.concat([KeyedJaggedTensor.empty(), full]).stride() == full.stride() == 6
    np.testing.assert_array_equal(again.inverse_indices()[1], vbe.inverse_indices()[1])
    np.testing.assert_array_equal(again.lengths(), vbe.lengths())
    assert "stride_per_key=[2, 2, 6]" in repr(vbe)


def test_kjt_refuses_inconsistent_variable_batches():
    ranks = [[1], [2], [1]]
    with pytest.raises(ValueError, match="lengths has 3 entries but stride_per_key_per_rank gives"):
        KeyedJaggedTensor(KEYS, [1, 2, 3], lengths=[1, 1, 1], stride_per_key_per_rank=ranks)
    with pytest.raises(ValueError, match=r"inverse_indices\[1\] \(key 'user_hist'\) maps sample 0 to bag 2"):
        KeyedJaggedTensor(KEYS, [1, 2, 3, 4], lengths=[1, 1, 1, 1], stride_per_key_per_rank=ranks,
                          inverse_indices=(KEYS, [[0, 0], [2, 1], [0, 0]]))
    with pytest.raises(ValueError, match="pass stride_per_key_per_rank with them"):
        KeyedJaggedTensor(KEYS, [1, 2, 3], lengths=[1, 1, 1], inverse_indices=(KEYS, [[0], [0], [0]]))
    vbe = KeyedJaggedTensor(KEYS, [1, 2, 3, 4], lengths=[1, 1, 1, 1], stride_per_key_per_rank=ranks)
    layout = TableLayout.from_embedding_specs([(r, 4) for r in ROWS])
    with pytest.raises(ValueError, match="needs inverse_indices to expand each key's bags"):
        embedding_bag_lookup_kjt(init_weights(jax.random.key(0), layout), vbe, layout=layout)


@pytest.mark.parametrize("pooling, weighted", [("SUM", False), ("MEAN", False), ("SUM", True)])
def test_lookup_and_gradients_equal_the_expanded_batch(platform, pooling, weighted):
    rng = np.random.default_rng(1 + weighted)
    vbe, full = variable_batch(rng, 13, [3, 3, 13], weighted)
    layout = TableLayout.from_embedding_specs([(r, d) for r, d in zip(ROWS, (4, 3, 8))])
    weights = init_weights(jax.random.key(2), layout)
    cotangent = jnp.asarray(rng.normal(size=(13, 15)), jnp.float32)

    def value_and_grads(kjt):
        def f(w, psw):
            kjt_w = kjt if psw is None else KeyedJaggedTensor._make(
                kjt.keys(), kjt.stride(), kjt.values(), kjt.lengths(), psw, kjt._ranks, kjt._inverse)
            return embedding_bag_lookup_kjt(w, kjt_w, layout=layout, pooling=pooling).values()
        out, pullback = jax.vjp(f, weights, kjt.weights_or_none())
        return out, pullback(cotangent)

    got, got_grads = jax.jit(value_and_grads)(vbe)
    want, want_grads = jax.jit(value_and_grads)(full)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_grads[0], want_grads[0], rtol=1e-5, atol=1e-5)
    if weighted:  # each id's weight gradient: its bag's cotangent summed over the bag's samples
        want_psw = np.zeros(vbe.capacity, np.float32)
        take = _expanded_positions(vbe, full)
        np.add.at(want_psw, take, np.asarray(want_grads[1])[:take.size])
        np.testing.assert_allclose(got_grads[1], want_psw, rtol=1e-5, atol=1e-5)


def _expanded_positions(vbe, full):
    """For each id of ``full``, the position in ``vbe`` it was copied from."""
    lengths, inverse = np.asarray(vbe.lengths()), np.asarray(vbe.inverse_indices()[1])
    starts = np.concatenate([[0], np.cumsum(lengths)])
    first_bag = np.concatenate([[0], np.cumsum(vbe.stride_per_key())])
    take = [np.arange(starts[first_bag[k] + i], starts[first_bag[k] + i + 1])
            for k in range(len(vbe.keys())) for i in inverse[k]]
    return np.concatenate(take).astype(int)


def collection(fused):
    tables = [EmbeddingBagConfig(name="t_user", num_embeddings=40, embedding_dim=8,
                                 feature_names=["user", "user_hist"]),
              EmbeddingBagConfig(name="t_item", num_embeddings=25, embedding_dim=8, feature_names=["item"])]
    return EmbeddingBagCollection(tables, optimizer=RowWiseAdagrad(learning_rate=0.1) if fused else None,
                                  rngs=nnx.Rngs(0))


@pytest.mark.parametrize("fused", [False, True])
def test_collection_trains_as_on_the_expanded_batch(platform, fused):
    rng = np.random.default_rng(4)
    vbe, full = variable_batch(rng, 16, [5, 5, 16])
    target = jnp.asarray(rng.normal(size=(16, 24)), jnp.float32)
    results = []
    for kjt in (vbe, full):
        model = collection(fused)
        assert model(kjt).values().shape == (16, 24)

        def loss_fn(model, kjt):
            return jnp.mean((model(kjt).values() - target) ** 2)

        if fused:
            step = make_train_step(loss_fn)
            for _ in range(2):
                step(model, nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param), kjt)
        else:
            grads = nnx.grad(loss_fn)(model, kjt)
            nnx.update(model, jax.tree.map(lambda p, g: p - 0.5 * g, nnx.state(model, nnx.Param), grads))
        results.append((model(kjt).values(), model.split_embedding_weights()))
    (got_out, got_tables), (want_out, want_tables) = results
    np.testing.assert_allclose(got_out, want_out, rtol=1e-5, atol=1e-5)
    for name in want_tables:
        np.testing.assert_allclose(got_tables[name], want_tables[name], rtol=1e-5, atol=1e-6)


def test_per_id_collections_refuse_variable_batches():
    vbe, _ = variable_batch(np.random.default_rng(5), 4, [2, 2, 4])
    ec = EmbeddingCollection([EmbeddingConfig(name="t", num_embeddings=40, embedding_dim=4, feature_names=KEYS)],
                             rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs pooled tables"):
        ec(vbe)
