"""The train steps keep a model's split between steps (jaxrec.nn._split_cache): they must see
every change that nnx.split would, and only split again then."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrec.nn import PartitionedOptimizer, make_train_step
from jaxrec.nn._split_cache import SplitCache
from jaxrec.nn._tables import FusedTables


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
    model, cache = Scaled(nnx.Rngs(0)), SplitCache()
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
        graphdef, *states = nnx.split(model, nnx.Param, FusedTables, ...)
        assert after.graphdef == graphdef
        now = [jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, nnx.Variable)) for s in states]
        assert all(a is b for kept, new in zip(after.variables, now)
                   for a, b in zip(kept, new, strict=True))
        assert cache.split(model) is after


def test_a_step_after_a_change_of_structure_trains_the_changed_model():
    """The nn step with a kept split against a model split afresh at every step."""
    model, reference = Scaled(nnx.Rngs(0)), Scaled(nnx.Rngs(0))
    step, tx = make_train_step(loss), optax.sgd(0.1)
    opt, ref_opt = PartitionedOptimizer(model, tx), PartitionedOptimizer(reference, tx)
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
    opt = PartitionedOptimizer(model, optax.sgd(0.1))
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
    opt = PartitionedOptimizer(model, optax.adam(0.1))
    step = make_train_step(loss)
    x, y = data(0)
    step(model, opt, x, y)
    count = int(opt.opt_state[0].count)
    assert count == 1
    opt.opt_state = opt.tx.init(nnx.state(model, nnx.Param))  # reset, as a restore would
    step(model, opt, x, y)
    assert int(opt.opt_state[0].count) == 1


@pytest.mark.parametrize("flat", [True, False])
def test_flat_optimizer_state_round_trips(flat):
    model = Scaled(nnx.Rngs(0))
    opt = PartitionedOptimizer(model, optax.adam(0.1))
    treedef, leaves = opt.flat_opt_state()
    if flat:
        opt.set_flat_opt_state(treedef, [x + 1 for x in leaves])
        assert all(np.array_equal(np.asarray(a), np.asarray(b) + 1)
                   for a, b in zip(jax.tree.leaves(opt.opt_state), leaves))
    else:
        assert opt.flat_opt_state()[1] is leaves  # kept until opt_state is set

