"""TTEmbeddingBag's cores: one way to read and set them in plain and fused mode, and
starting cores that a donating train step never takes from the caller."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tt_testing import LAYOUT3, random_cores

from jaxrec.nn import TTEmbeddingBag, make_train_step
from jaxrec.ops import tt_full_weight
from jaxrec.optim import SGD

LAY = LAYOUT3


def module(optimizer, cores=None):
    return TTEmbeddingBag(LAY.num_embeddings, LAY.embedding_dim, tt_ranks=LAY.ranks[1:-1],
                          tt_p_shapes=LAY.p_shapes, tt_q_shapes=LAY.q_shapes, optimizer=optimizer,
                          rngs=nnx.Rngs(0), cores=cores)


def batch(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, size=6)
    lengths[2] = 0  # an empty bag
    indices = rng.integers(0, LAY.num_embeddings, size=int(lengths.sum()))
    indices[-1] = indices[0]  # a duplicate
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    target = rng.normal(size=(6, LAY.embedding_dim)).astype(np.float32)
    return jnp.asarray(indices, jnp.int32), jnp.asarray(offsets), jnp.asarray(target)


def loss(model, indices, offsets, target):
    return jnp.mean((model(indices, offsets) - target) ** 2)


@pytest.mark.parametrize("optimizer", [None, SGD(learning_rate=0.5)], ids=["plain", "fused"])
def test_starting_cores_are_read_trained_and_set_in_both_modes(optimizer):
    kept = random_cores(np.random.default_rng(1), LAY)  # host copies of the caller's cores
    mine = tuple(jnp.asarray(c) for c in kept)
    emb = module(optimizer, cores=mine)
    for got, want in zip(emb.cores, kept, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_allclose(emb.full_weight(), tt_full_weight(mine, layout=LAY), rtol=1e-6)

    step = make_train_step(loss)  # donates the module's buffers
    opt = nnx.Optimizer(emb, optax.sgd(0.5), wrt=nnx.Param)
    for seed in range(2):
        step(emb, opt, *batch(seed))
    for c, k in zip(mine, kept):
        np.testing.assert_array_equal(np.asarray(c), k)  # reading a donated array would raise
    assert any(not np.allclose(np.asarray(a), b) for a, b in zip(emb.cores, kept))  # trained

    new = random_cores(np.random.default_rng(2), LAY)
    emb.set_cores([jnp.asarray(c) for c in new])
    for got, want in zip(emb.cores, new, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    if optimizer is not None:  # the fused optimizer's step survives a new set of cores
        assert int(emb.table.get_value().step) == 2
    step(emb, opt, *batch(3))  # and the new cores train
    assert any(not np.allclose(np.asarray(a), b) for a, b in zip(emb.cores, new))


@pytest.mark.parametrize("optimizer", [None, SGD(learning_rate=0.5)], ids=["plain", "fused"])
def test_cores_of_the_wrong_shape_are_refused(optimizer):
    cores = [jnp.asarray(c) for c in random_cores(np.random.default_rng(1), LAY)]
    bad = cores[:1] + [cores[1][:, :1]] + cores[2:]
    with pytest.raises(ValueError, match=r"cores\[1\] must be float32"):
        module(optimizer, cores=bad)
    emb = module(optimizer)
    with pytest.raises(ValueError, match="must hold 3 cores"):
        emb.set_cores(cores[:2])
