"""Tables in and out: a collection's weights and fused optimizer state set from arrays,
the inverse of split_embedding_weights / split_optimizer_states (how a trained FBGEMM or
TorchRec table is loaded)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrec import optim
from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig, make_train_step
from jaxrec.ops import TableLayout
from jaxrec.sparse import KeyedJaggedTensor

TABLES = [
    EmbeddingBagConfig(name="t_a", num_embeddings=13, embedding_dim=8, feature_names=["a"]),
    EmbeddingBagConfig(name="t_b", num_embeddings=7, embedding_dim=4, feature_names=["b"]),
    EmbeddingBagConfig(name="t_c", num_embeddings=5, embedding_dim=4, feature_names=["c"], pooling="MEAN"),
]
B = 4


def kjt(rng):
    lengths = rng.integers(0, 4, size=3 * B)
    values = np.concatenate([rng.integers(0, t.num_embeddings, lengths[i * B:(i + 1) * B].sum())
                             for i, t in enumerate(TABLES)]).astype(np.int32)
    return KeyedJaggedTensor.from_lengths_sync(["a", "b", "c"], values, lengths, capacity=48)


class Model(nnx.Module):
    def __init__(self, ebc):
        self.ebc = ebc

    def __call__(self, features):
        return jnp.sum(jnp.tanh(self.ebc(features).values()), axis=1)


def train(model, batches):
    optimizer = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    step = make_train_step(lambda m, f, y: jnp.mean((m(f) - y) ** 2))
    for features, target in batches:
        step(model, optimizer, features, target)


def host(tree):
    return jax.tree.map(np.asarray, tree)


def test_a_fused_collection_restored_from_arrays_trains_on_identically():
    rng = np.random.default_rng(0)
    batches = [(kjt(rng), jnp.asarray(rng.normal(size=B), jnp.float32)) for _ in range(4)]
    source = Model(EmbeddingBagCollection(TABLES, optimizer=optim.RowWiseAdagrad(learning_rate=0.3),
                                          rngs=nnx.Rngs(0)))
    train(source, batches[:2])
    weights, states = host(source.ebc.split_embedding_weights()), host(source.ebc.split_optimizer_states())
    assert set(states) == {"t_a", "t_b", "t_c"} and states["t_a"]["momentum1"].shape == (13,)
    assert np.any(states["t_a"]["momentum1"] != 0)  # trained: the state is not the initial one

    target = Model(EmbeddingBagCollection(TABLES, optimizer=optim.RowWiseAdagrad(learning_rate=0.3),
                                          rngs=nnx.Rngs(7)))
    target.ebc.set_embedding_weights(weights)
    target.ebc.set_optimizer_states(states, step=2)
    for name in weights:
        np.testing.assert_array_equal(target.ebc.split_embedding_weights()[name], weights[name])
        np.testing.assert_array_equal(target.ebc.split_optimizer_states()[name]["momentum1"],
                                      states[name]["momentum1"])
    train(source, batches[2:])
    train(target, batches[2:])
    for name, value in source.ebc.split_embedding_weights().items():
        np.testing.assert_array_equal(target.ebc.split_embedding_weights()[name], value)


def test_plain_collection_sets_some_tables_and_keeps_the_rest():
    ebc = EmbeddingBagCollection(TABLES, rngs=nnx.Rngs(0))
    before = host(ebc.split_embedding_weights())
    new_b = np.arange(7 * 4, dtype=np.float32).reshape(7, 4)
    ebc.set_embedding_weights({"t_b": new_b})
    after = ebc.split_embedding_weights()
    np.testing.assert_array_equal(after["t_b"], new_b)
    np.testing.assert_array_equal(after["t_a"], before["t_a"])
    np.testing.assert_array_equal(after["t_c"], before["t_c"])


def test_bad_arrays_get_errors_that_name_the_table():
    ebc = EmbeddingBagCollection(TABLES, optimizer=optim.Adam(learning_rate=0.1), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"table 't_b' has shape \(7, 4\).*\(4, 7\)"):
        ebc.set_embedding_weights({"t_b": np.zeros((4, 7), np.float32)})
    with pytest.raises(ValueError, match=r"no table \['t_x'\]"):
        ebc.set_embedding_weights({"t_x": np.zeros((7, 4), np.float32)})
    states = host(ebc.split_optimizer_states())
    with pytest.raises(ValueError, match="share one fused buffer"):
        ebc.set_optimizer_states({"t_a": states["t_a"]})
    del states["t_c"]["exp_avg_sq"]
    with pytest.raises(ValueError, match="has the states"):
        ebc.set_optimizer_states(states)
    with pytest.raises(ValueError, match="plain tables"):
        EmbeddingBagCollection(TABLES, rngs=nnx.Rngs(0)).split_optimizer_states()


@pytest.mark.parametrize("config", [optim.SGD(), optim.RowWiseAdagrad(), optim.Adam(), optim.PartialRowWiseAdam()],
                         ids=lambda c: type(c).__name__)
def test_merge_inverts_split_for_every_state_layout(config):
    layout = TableLayout(rows=(11, 3), dims=(4, 8), feature_table_map=(0, 1))
    rng = np.random.default_rng(1)
    tables = [{name: rng.normal(size=(r,) if name in config.state_type.row_fields else (r, d)).astype(np.float32)
               for name in optim.init_state(config, layout)._fields if name != "step"}
              for r, d in zip(layout.rows, layout.dims)]
    state = optim.merge_optimizer_states(config, layout, tables, step=5)
    assert int(state.step) == 5
    for got, want in zip(optim.split_optimizer_states(config, layout, state), tables):
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])


@pytest.mark.parametrize("optimizer", [None, optim.Adam(learning_rate=0.1)], ids=["plain", "fused"])
def test_portable_tables_are_host_copies_of_the_tables_and_state(optimizer):
    """The checkpoint form is cut from one host copy of each buffer (NumPy), so a save never
    holds a second copy of the tables on the device; it equals the device's own split."""
    ebc = EmbeddingBagCollection(TABLES, optimizer=optimizer, rngs=nnx.Rngs(0))
    if optimizer is not None:  # a trained state, not zeros
        rng = np.random.default_rng(0)
        ebc.set_optimizer_states({n: {k: rng.uniform(0.1, 1.0, v.shape).astype(np.float32) for k, v in s.items()}
                                  for n, s in ebc.split_optimizer_states().items()}, step=3)
    portable = ebc.portable_tables()
    weights = ebc.split_embedding_weights()
    states = ebc.split_optimizer_states() if optimizer is not None else {}
    assert portable.keys() == weights.keys()
    for name, fields in portable.items():
        assert all(isinstance(x, np.ndarray) for x in fields.values()), name
        np.testing.assert_array_equal(fields["weights"], weights[name])
        for field, value in states.get(name, {}).items():
            assert np.asarray(value).min() > 0
            np.testing.assert_array_equal(fields[field], value)
        if states:
            assert int(fields["step"]) == 3
        assert set(fields) == {"weights"} | (set(states[name]) | {"step"} if states else set())
