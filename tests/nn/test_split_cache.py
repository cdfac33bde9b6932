"""The train steps keep a model's split between steps (jaxrec.nn._split_cache): they must see
every change that nnx.split would, and only split again then."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrec.nn import make_train_step
from jaxrec.nn._split_cache import SplitCache, split_for_training


class Scaled(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 1, rngs=rngs)])
        self.scale = 1.0  # static: part of the graphdef
        self.sizes = (3, 4)  # static too
        self.extra = nnx.data([])  # a plain list of data

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        for variable in self.extra:
            x = x + variable[...]
        return self.scale * x[:, 0]


def loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def data(seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=(5, 3)), jnp.float32), jnp.asarray(rng.normal(size=5),
                                                                         jnp.float32)


def test_the_split_is_kept_until_something_is_reassigned():
    model, cache = Scaled(nnx.Rngs(0)), SplitCache(split_for_training)
    first = cache.split(model)
    assert cache.split(model) is first
    model.layers[0].kernel[...] = model.layers[0].kernel[...] + 1  # a value: same structure
    assert cache.split(model) is first
    model.sizes = tuple(range(3, 5))  # an equal new tuple: same graphdef
    model.scale = float("1.0")
    assert cache.split(model) is first

    changes = [
        lambda m: setattr(m, "scale", 2.0),                               # a static attribute
        lambda m: setattr(m, "sizes", (3, 5)),                            # an unequal tuple
        lambda m: setattr(m.layers[1], "bias", nnx.Param(jnp.ones(1))),   # a new Variable
        lambda m: m.layers.append(nnx.Linear(1, 1, rngs=nnx.Rngs(1))),    # an nnx.List grows
        lambda m: m.extra.append(nnx.Param(jnp.ones(()))),                # a plain list grows
        lambda m: m.layers[0].kernel.set_metadata("tag", 1),              # Variable metadata
    ]
    for change in changes:
        before = cache.split(model)
        change(model)
        after = cache.split(model)
        assert after is not before
        graphdef, *states = split_for_training(model)
        assert after.graphdef == graphdef
        now = [jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, nnx.Variable)) for s in states]
        assert all(a is b for kept, new in zip(after.variables, now)
                   for a, b in zip(kept, new, strict=True))
        assert cache.split(model) is after


def test_a_step_after_a_change_of_structure_trains_the_changed_model():
    """The nn step with a kept split against a model split afresh at every step."""
    model, reference = Scaled(nnx.Rngs(0)), Scaled(nnx.Rngs(0))
    step, tx = make_train_step(loss), optax.sgd(0.1)
    opt, ref_opt = nnx.Optimizer(model, tx, wrt=nnx.Param), nnx.Optimizer(reference, tx, wrt=nnx.Param)
    for i, scale in enumerate([1.0, 1.0, 3.0, 3.0, 0.5]):
        model.scale = reference.scale = scale
        x, y = data(i)
        got = float(step(model, opt, x, y))
        # the reference goes through a new step function each time: nothing kept
        want = float(make_train_step(loss)(reference, ref_opt, x, y))
        np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                    nnx.to_flat_state(nnx.state(reference, nnx.Param)), strict=True):
        np.testing.assert_allclose(np.asarray(a[1][...]), np.asarray(b[1][...]), rtol=1e-6)


def test_values_set_between_steps_are_trained_from():
    model = Scaled(nnx.Rngs(0))
    step = make_train_step(loss)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x, y = data(0)
    step(model, opt, x, y)
    fresh = Scaled(nnx.Rngs(7))
    want = float(loss(fresh, x, y))
    nnx.update(model, nnx.state(fresh))  # e.g. a restored checkpoint (the step donates them)
    got = float(step(model, opt, x, y))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_the_cache_forgets_a_collected_model():
    cache = SplitCache()
    model = Scaled(nnx.Rngs(0))
    cache.split(model)
    assert len(cache._entries) == 1
    del model
    gc.collect()
    assert not cache._entries


def test_optimizer_state_set_between_steps_is_used():
    model = Scaled(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    step = make_train_step(loss)
    x, y = data(0)
    step(model, opt, x, y)
    assert int(opt.opt_state[0].count[...]) == 1 and int(opt.step[...]) == 1
    fresh = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    nnx.update(opt, nnx.state(fresh))  # reset, as a restored checkpoint would
    step(model, opt, x, y)
    assert int(opt.opt_state[0].count[...]) == 1 and int(opt.step[...]) == 1
    opt.opt_state = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param).opt_state  # reassigned
    step(model, opt, x, y)
    assert int(opt.opt_state[0].count[...]) == 1


def test_an_optimizer_whose_wrt_selects_fused_tables_is_refused():
    from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig
    from jaxrec.optim import SGD
    from jaxrec.sparse import KeyedJaggedTensor

    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10,
                                                     feature_names=["f"])],
                                 optimizer=SGD(learning_rate=0.1), rngs=nnx.Rngs(0))
    kjt = KeyedJaggedTensor(["f"], jnp.asarray([1, 2, 3]), lengths=jnp.asarray([2, 1]))
    opt = nnx.Optimizer(ebc, optax.sgd(0.1), wrt=nnx.Variable)
    with pytest.raises(ValueError, match="wrt=nnx.Param"):
        make_train_step(lambda m, k: jnp.sum(m(k).values()))(ebc, opt, kjt)


def test_one_step_serves_optimizers_of_different_rates():
    """Compiled steps are shared by equal optimizer graphdefs only: the tx is part of it."""
    step = make_train_step(loss)
    x, y = data(3)
    trained = []
    for lr in (0.1, 0.5):
        model, reference = Scaled(nnx.Rngs(0)), Scaled(nnx.Rngs(0))
        step(model, nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param), x, y)
        make_train_step(loss)(reference, nnx.Optimizer(reference, optax.sgd(lr), wrt=nnx.Param), x, y)
        got, want = (np.asarray(m.layers[0].kernel[...]) for m in (model, reference))
        np.testing.assert_allclose(got, want, rtol=1e-6)
        trained.append(got)
    assert not np.allclose(trained[0], trained[1])


def test_two_variables_holding_one_array_are_named_and_nothing_changes():
    # The step donates every Variable's array; XLA refuses a buffer donated twice.
    model = Scaled(nnx.Rngs(0))
    shared = jnp.asarray([0.5], jnp.float32)
    model.extra.append(nnx.Variable(shared))
    model.extra.append(nnx.Variable(shared))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = make_train_step(loss)
    before = jax.tree.map(np.asarray, nnx.state(model))
    with pytest.raises(ValueError, match=r"model\.extra\.0 and model\.extra\.1 hold the same array"):
        step(model, optimizer, *data(0))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(model)), before)
    model.extra[1] = nnx.Variable(jnp.array(shared, copy=True))  # its own array: it trains
    assert np.isfinite(float(step(model, optimizer, *data(0))))
