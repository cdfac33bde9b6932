"""Prefetch of host-cached tables (``train_step(..., prefetch=next_features)``): the next
batch's rows are cached during the step, in the background.

Training with prefetch equals the same collection with every table on the device (losses,
rows and optimizer state; evictions every step; an evaluation in between that evicts the
prefetched rows), for SGD, row-wise Adagrad and Adam, LRU and LFU; a prefetched batch's
step loads no row; a prefetch larger than the cache never evicts the rows of the batch in
flight (its step equals the device's) and fails nothing."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from host_memory_testing import assert_same_tables, trainer

from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig
from jaxrec.optim import SGD, Adam, RowWiseAdagrad
from jaxrec.sparse import KeyedJaggedTensor

B = 16
ROWS = {"user": 1000, "item": 500}


class Model(nnx.Module):
    def __init__(self, placement: str, optimizer, policy: str = "lru", cache_rows: int = 256):
        kw = dict(placement="host_cached", cache_rows=cache_rows, cache_policy=policy) if placement != "device" else {}
        configs = [EmbeddingBagConfig(name=f"t_{f}", num_embeddings=rows, embedding_dim=8, feature_names=[f], **kw)
                   for f, rows in ROWS.items()]
        self.ebc = EmbeddingBagCollection(configs, optimizer=optimizer, rngs=nnx.Rngs(0))

    def __call__(self, kjt):
        return jnp.sum(jnp.tanh(self.ebc(kjt).values()), axis=1)



def batch(rng, lengths=None):
    """0-4 ids a bag (empty bags too), repeats; or ``lengths`` ids a bag."""
    lengths = rng.integers(0, 5, size=len(ROWS) * B) if lengths is None else lengths
    ids = np.concatenate([rng.integers(0, rows, size=lengths[k * B:(k + 1) * B].sum())
                          for k, rows in enumerate(ROWS.values())])
    features = KeyedJaggedTensor(list(ROWS), ids.astype(np.int32), lengths=lengths, capacity=512)
    return features, jnp.asarray(rng.normal(size=B), jnp.float32)




@pytest.mark.parametrize("optimizer,policy", [(RowWiseAdagrad(learning_rate=0.3), "lru"),
                                              (Adam(learning_rate=0.01), "lru"), (SGD(learning_rate=0.5), "lfu")])
def test_prefetching_training_equals_device_placement(platform, optimizer, policy):
    exact = platform == "cpu"  # the GPU's fused update may sum a row's gradients in another order
    cached, device = Model("host_cached", optimizer, policy, cache_rows=128), Model("device", optimizer)
    (step_c, opt_c), (step_d, opt_d) = trainer(cached), trainer(device)
    rng = np.random.default_rng(0)
    batches = [batch(rng) for _ in range(16)]
    evaluate = nnx.jit(lambda m, f: m(f), donate_argnums=0)
    evicted = 0
    for s, (features, target) in enumerate(batches):
        upcoming = batches[min(s + 1, len(batches) - 1)][0]  # the last step prefetches its own batch
        got = step_c(cached, opt_c, features, target, prefetch=upcoming)
        want = step_d(device, opt_d, features, target)
        np.testing.assert_allclose(got, want, rtol=0 if exact else 1e-6, err_msg=f"step {s}")
        evicted_now = np.asarray(cached.ebc.cache_statistics()["t_user"]["evicted"])
        if 8 <= s < len(batches) - 1:  # the full cache evicts every step (the last prefetches nothing new)
            assert evicted_now > evicted, (s, evicted_now)
        evicted = evicted_now
        if s == 9:  # an evaluation caches rows of its own, evicting some of the prefetched ones
            other, _ = batch(rng)
            np.testing.assert_allclose(evaluate(cached, other), evaluate(device, other), rtol=0 if exact else 1e-6)
    assert_same_tables(cached, device, exact)


def test_a_prefetched_batch_loads_no_row_in_its_step(platform):
    optimizer = RowWiseAdagrad(learning_rate=0.3)
    model = Model("host_cached", optimizer)
    step, opt = trainer(model)
    rng = np.random.default_rng(1)
    batches = [batch(rng) for _ in range(4)]

    def loaded():
        return sum(int(t["inserted"]) for t in model.ebc.cache_statistics().values())

    step(model, opt, *batches[0], prefetch=batches[1][0])
    first = loaded()
    assert first > 0
    step(model, opt, *batches[1], prefetch=batches[1][0])  # its rows were prefetched: no miss
    assert loaded() == first
    step(model, opt, *batches[2], prefetch=batches[3][0])  # not prefetched: its rows load in the step
    assert loaded() > first


def test_a_prefetch_larger_than_the_cache_never_evicts_the_batch_in_flight(platform):
    """A next batch of 400 distinct users for a 128-row cache: it cannot all be cached, and
    each step still looks up and updates exactly the rows the device does."""
    optimizer = RowWiseAdagrad(learning_rate=0.3)
    cached, device = Model("host_cached", optimizer, cache_rows=128), Model("device", optimizer)
    (step_c, opt_c), (step_d, opt_d) = trainer(cached), trainer(device)
    rng = np.random.default_rng(2)
    lengths = np.zeros(len(ROWS) * B, np.int64)
    lengths[:B] = 25
    crowd, _ = batch(rng, lengths)  # 400 user ids, most of them distinct
    for s in range(6):
        features, target = batch(rng)
        got = step_c(cached, opt_c, features, target, prefetch=crowd)
        want = step_d(device, opt_d, features, target)
        np.testing.assert_allclose(got, want, rtol=0 if platform == "cpu" else 1e-6, err_msg=f"step {s}")
    step_c.check()  # the prefetch's ids left without a row failed nothing
    assert_same_tables(cached, device, exact=platform == "cpu")
