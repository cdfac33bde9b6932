"""Tables in host memory: rows and optimizer state in host memory, either with a small
cache in device memory and rows exchanged every step (placement="host_cached"), or with
each batch's rows read into device memory and written back (placement="host").

Training equals the same collection with every table on the device (losses, rows and
optimizer state after every step, evictions happening every step), for SGD, row-wise
Adagrad and Adam, LRU and LFU; the row exchange's handlers equal its jnp reference; bad
ids follow the bounds-check mode; a batch the cache cannot hold fails its step and keeps
the model (and trains with placement="host"); checkpoints and the portable form carry the
tables between placements."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from host_memory_testing import assert_same_tables, trainer

from jaxrec import _ffi
from jaxrec.checkpoint import restore_checkpoint, save_checkpoint
from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig, TTConfig, _memory
from jaxrec.ops.host_cache import exchange_rows, in_host_memory, to_host_memory
from jaxrec.optim import SGD, Adam, RowWiseAdagrad
from jaxrec.serving import quantize
from jaxrec.sparse import KeyedJaggedTensor

B = 16
ROWS = {"user": 1000, "user2": 1000, "item": 500, "d": 50}  # rows of each feature's table


def tables(placement: str, policy: str = "lru", cache_rows: int = 128):
    kw = {"device": {}, "host": dict(placement="host"),
          "host_cached": dict(placement="host_cached", cache_rows=cache_rows, cache_policy=policy)}[placement]
    return [EmbeddingBagConfig(name="t_user", num_embeddings=1000, embedding_dim=8, feature_names=["user", "user2"],
                               **kw),
            EmbeddingBagConfig(name="t_item", num_embeddings=500, embedding_dim=8, feature_names=["item"], **kw),
            # MEAN: a lookup group of its own in both collections, so that their groups (and
            # the order XLA sums the outputs in) are alike
            EmbeddingBagConfig(name="t_dense", num_embeddings=50, embedding_dim=4, feature_names=["d"], pooling="mean")]


class Model(nnx.Module):
    def __init__(self, ebc):
        self.ebc = ebc

    def __call__(self, kjt):
        return jnp.sum(jnp.tanh(self.ebc(kjt).values()), axis=1)



def batch(rng, bad: int = 0):
    """0-4 ids a bag (empty bags too), repeats; ``bad`` ids made out of range."""
    lengths = rng.integers(0, 5, size=len(ROWS) * B)
    ids = np.concatenate([rng.integers(0, rows, size=lengths[k * B:(k + 1) * B].sum())
                          for k, rows in enumerate(ROWS.values())])
    ids[rng.choice(ids.size, size=bad, replace=False)] = rng.choice([-3, 1000, 5000], size=bad)
    return (KeyedJaggedTensor(list(ROWS), ids.astype(np.int32), lengths=lengths, capacity=256),
            jnp.asarray(rng.normal(size=B), jnp.float32))


def collection(placement: str, optimizer, **kw):
    policy = kw.pop("policy", "lru")
    return Model(EmbeddingBagCollection(tables(placement, policy), optimizer=optimizer, rngs=nnx.Rngs(0), **kw))




OPTIMIZERS = [(RowWiseAdagrad(learning_rate=0.3), "lru"), (Adam(learning_rate=0.01), "lru"),
              (SGD(learning_rate=0.5), "lfu")]


@pytest.mark.parametrize("optimizer,policy", OPTIMIZERS)
def test_host_cached_training_equals_device_placement(platform, optimizer, policy):
    exact = platform == "cpu"  # the GPU's fused update may sum a row's gradients in another order
    cached, device = collection("host_cached", optimizer, policy=policy), collection("device", optimizer)
    (step_c, opt_c), (step_d, opt_d) = trainer(cached), trainer(device)
    rng = np.random.default_rng(0)
    evicted = 0
    for s in range(10):
        features, target = batch(rng)
        got, want = step_c(cached, opt_c, features, target), step_d(device, opt_d, features, target)
        np.testing.assert_allclose(got, want, rtol=0 if exact else 1e-6, err_msg=f"step {s}")
        index = cached.ebc.caches[0].get_value().index
        if s >= 5:  # the 128-row caches are full: every step evicts from both tables
            assert (np.asarray(index.evicted) > evicted).all(), (s, index.evicted)
        evicted = np.asarray(index.evicted)
    assert_same_tables(cached, device, exact)
    rows = cached.ebc.caches[0].get_value().rows
    assert in_host_memory(rows.weights) and all(in_host_memory(getattr(rows.state, n))
                                                for n in rows.config.state_names)
    assert not in_host_memory(cached.ebc.tables[0].get_value().weights)  # the cache is on the device


@pytest.mark.parametrize("optimizer", [o for o, _ in OPTIMIZERS])
def test_host_placed_training_equals_device_placement(platform, optimizer):
    exact = platform == "cpu"
    host, device = collection("host", optimizer), collection("device", optimizer)
    (step_h, opt_h), (step_d, opt_d) = trainer(host), trainer(device)
    rng = np.random.default_rng(0)
    for s in range(10):
        features, target = batch(rng)
        got, want = step_h(host, opt_h, features, target), step_d(device, opt_d, features, target)
        np.testing.assert_allclose(got, want, rtol=0 if exact else 1e-6, err_msg=f"step {s}")
    assert_same_tables(host, device, exact)
    placed = host.ebc.tables[0].get_value()
    assert in_host_memory(placed.weights) and all(in_host_memory(getattr(placed.state, n))
                                                  for n in placed.config.state_names)
    assert int(placed.step) == 10 and len(host.ebc.caches) == 0
    forward = nnx.jit(lambda m, f: m(f), donate_argnums=0)  # evaluation reads the host rows only
    features, _ = batch(rng)
    np.testing.assert_allclose(forward(host, features), forward(device, features), rtol=0 if exact else 1e-6)
    assert_same_tables(host, device, exact)


def test_evaluation_caches_rows_and_reads_them_alike(platform):
    optimizer = RowWiseAdagrad(learning_rate=0.3)
    cached, device = collection("host_cached", optimizer), collection("device", optimizer)
    (step_c, opt_c), (step_d, opt_d) = trainer(cached), trainer(device)
    rng = np.random.default_rng(5)
    for _ in range(3):
        features, target = batch(rng)
        step_c(cached, opt_c, features, target)
        step_d(device, opt_d, features, target)
    forward = nnx.jit(lambda m, f: m(f))
    for k in range(4):  # eager and jitted lookups, each caching (and evicting) rows
        features, _ = batch(rng)
        run = forward if k % 2 else (lambda m, f: m(f))
        np.testing.assert_allclose(run(cached, features), run(device, features), rtol=1e-6, err_msg=str(k))
    assert int(cached.ebc.cache_statistics()["t_user"]["evicted"]) > 0
    assert_same_tables(cached, device, exact=platform == "cpu")


@pytest.mark.parametrize("dtype,width", [("float32", 8), ("float16", 3), ("bfloat16", 8)])
def test_the_row_exchange_equals_its_reference(platform, dtype, width):
    rng = np.random.default_rng(1)
    cache_rows, host_rows, n = 40, 300, 32

    def buffers(rows):  # the weights and a row-wise state
        return [jnp.asarray(rng.normal(size=rows * width), dtype), jnp.asarray(rng.normal(size=rows), jnp.float32)]

    cache, host = buffers(cache_rows), buffers(host_rows)
    slots = rng.permutation(cache_rows + 10)[:n] - 5  # distinct, some out of the cache
    slots[::4] = -1
    picked = rng.permutation(host_rows + 20)[:2 * n] - 10  # distinct host rows, some outside
    evict, load = picked[:n], picked[n:]
    evict[::3] = -1
    load[::5] = -1
    args = [jnp.asarray(a, jnp.int32) for a in (slots, evict, load)]
    kw = dict(cache_num_rows=cache_rows, host_num_rows=host_rows)
    want = exchange_rows(cache, host, *args, backend="reference", **kw)
    run = jax.jit(lambda c, h, *a: exchange_rows(c, h, *a, backend="kernel", **kw), donate_argnums=(0, 1))
    got = run([jnp.array(c) for c in cache], [to_host_memory(jnp.array(h)) for h in host], *args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert all(in_host_memory(h) for h in got[1])
    # the reference itself, against NumPy: the evicted rows went out, the loaded came in
    c0, h0 = np.asarray(cache[0]).reshape(cache_rows, width), np.asarray(host[0]).reshape(host_rows, width)
    new_c, new_h = np.asarray(want[0][0]).reshape(cache_rows, width), np.asarray(want[1][0]).reshape(host_rows, width)
    for s, e, ld in zip(slots, evict, load):
        if 0 <= s < cache_rows:
            if 0 <= e < host_rows:
                np.testing.assert_array_equal(new_h[e], c0[s])
            np.testing.assert_array_equal(new_c[s], h0[ld] if 0 <= ld < host_rows else c0[s])


@pytest.mark.parametrize("change, message", [
    ({}, None),
    (dict(src=np.zeros(12, np.float16)), r"copy_rows: src float16\[12\] and dst float32\[24\] must hold"),
    (dict(dst=np.zeros(25, np.float32)), r"dst float32\[25\] must hold src_num_rows=3 and dst_num_rows=6"),
    (dict(src_rows=np.zeros(3, np.int32)), r"src_rows must be int32\[2\], got int32\[3\]"),
    (dict(dst_rows=np.zeros(2, np.int64)), r"dst_rows must be int32\[2\], got int64\[2\]"),
])
def test_the_copy_handlers_check_their_operands(platform, change, message, x64):
    """The target called past copy_rows' own checks: the CPU and CUDA handlers give one message."""
    _ffi.has_kernel(platform)  # registers the target
    args = {**dict(dst_rows=np.array([5, 0], np.int32), src_rows=np.array([2, 1], np.int32),
                   src=np.arange(12, dtype=np.float32), dst=np.zeros(24, np.float32)), **change}
    call = jax.ffi.ffi_call("jaxrec_copy_rows", jax.ShapeDtypeStruct(args["dst"].shape, args["dst"].dtype))
    run = jax.jit(lambda *a: call(*a, src_num_rows=3, dst_num_rows=6))
    operands = [jnp.asarray(args[k]) for k in ("dst_rows", "src_rows", "src", "dst")]
    if message is None:  # the control: rows 2 and 1 of src to rows 5 and 0 of dst
        np.testing.assert_array_equal(np.asarray(run(*operands)).reshape(6, 4)[[5, 0]],
                                      np.arange(12, dtype=np.float32).reshape(3, 4)[[2, 1]])
        return
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(run(*operands))  # the GPU reports a handler's error when the result is awaited


@pytest.mark.parametrize("placement", ["host", "host_cached"])
@pytest.mark.parametrize("mode", ["WARNING", "NONE"])
def test_bad_ids_follow_the_bounds_check_mode(mode, placement):
    optimizer = RowWiseAdagrad(learning_rate=0.3)
    cached = collection(placement, optimizer, bounds_check_mode=mode)
    device = collection("device", optimizer, bounds_check_mode=mode)
    (step_c, opt_c), (step_d, opt_d) = trainer(cached), trainer(device)
    rng = np.random.default_rng(2)
    for s in range(4):
        features, target = batch(rng, bad=5)
        got, want = step_c(cached, opt_c, features, target), step_d(device, opt_d, features, target)
        np.testing.assert_array_equal(got, want, err_msg=f"step {s}")
    assert_same_tables(cached, device, exact=True)


def test_a_batch_the_cache_cannot_hold_fails_its_step_and_keeps_the_model():
    optimizer = RowWiseAdagrad(learning_rate=0.3)
    model = collection("host_cached", optimizer)
    step, opt = trainer(model)
    rng = np.random.default_rng(3)
    step(model, opt, *batch(rng))
    before = model.ebc.split_embedding_weights()
    # 300 distinct users in one batch: more than the 128-row cache can hold
    lengths = np.zeros(len(ROWS) * B, np.int64)
    lengths[:B] = 300 // B + 1
    ids = np.arange(lengths.sum(), dtype=np.int32)
    features = KeyedJaggedTensor(list(ROWS), ids, lengths=lengths, capacity=512)
    with pytest.raises(Exception, match=r"host-cached table 't_user': \d+ distinct ids of one batch found no row "
                                         r"in its cache of 128 rows.*Raise the table's cache_rows"):
        step(model, opt, features, jnp.ones(B))
        step.check()
    after = model.ebc.split_embedding_weights()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    step(model, opt, *batch(rng))  # a batch that fits trains on
    # placed in host memory without a cache, the batch trains as on the device
    host, device = collection("host", optimizer), collection("device", optimizer)
    (step_h, opt_h), (step_d, opt_d) = trainer(host), trainer(device)
    np.testing.assert_array_equal(step_h(host, opt_h, features, jnp.ones(B)),
                                  step_d(device, opt_d, features, jnp.ones(B)))
    assert_same_tables(host, device, exact=True)


def test_checkpoints_and_the_portable_form_cross_placements(tmp_path):
    optimizer = Adam(learning_rate=0.01)
    rng = np.random.default_rng(4)
    batches = [batch(rng) for _ in range(6)]
    cached = collection("host_cached", optimizer)
    step, opt = trainer(cached)
    for features, target in batches[:3]:
        step(cached, opt, features, target)
    # the NNX state, saved and restored into a fresh model: host buffers stay in host memory
    save_checkpoint(tmp_path / "ckpt", 3, nnx.state(cached))
    resumed = collection("host_cached", optimizer)
    state, _ = restore_checkpoint(tmp_path / "ckpt", nnx.state(resumed))
    nnx.update(resumed, state)
    assert in_host_memory(resumed.ebc.caches[0].get_value().rows.weights)
    # the portable form, into a device-placed collection, a host-placed one and back
    device = collection("device", optimizer)
    device.ebc.load_portable_tables(cached.ebc.portable_tables())
    host = collection("host", optimizer)
    host.ebc.load_portable_tables(device.ebc.portable_tables())
    assert in_host_memory(host.ebc.tables[0].get_value().weights)
    save_checkpoint(tmp_path / "host", 3, nnx.state(host))
    host_resumed = collection("host", optimizer)
    state, _ = restore_checkpoint(tmp_path / "host", nnx.state(host_resumed))
    nnx.update(host_resumed, state)
    assert in_host_memory(host_resumed.ebc.tables[0].get_value().weights)
    again = collection("host_cached", optimizer)
    again.ebc.load_portable_tables(host_resumed.ebc.portable_tables())
    for other in (resumed, device, host, host_resumed, again):
        assert_same_tables(other, cached, exact=True)
    models = [cached, resumed, device, host_resumed, again]
    trainers = [(step, opt)] + [trainer(m) for m in models[1:]]
    for features, target in batches[3:]:
        losses = [float(st(m, o, features, target)) for m, (st, o) in zip(models, trainers)]
        assert len(set(losses)) == 1, losses
    for other in models[1:]:
        assert_same_tables(other, cached, exact=True)
    served, _ = quantize(cached, "fp32")  # serving reads the tables with the cached rows over them
    np.testing.assert_array_equal(served(batches[0][0]), cached(batches[0][0]))


def test_bad_placements_are_refused_with_the_fix(monkeypatch):
    config = dict(name="t", num_embeddings=1000, embedding_dim=8, feature_names=["f"])
    with pytest.raises(ValueError, match="placement must be one of"):
        EmbeddingBagConfig(**config, placement="uvm")
    with pytest.raises(ValueError, match="apply to placement='host_cached' only"):
        EmbeddingBagConfig(**config, cache_rows=128)
    with pytest.raises(ValueError, match="apply to placement='host_cached' only; the table's placement is 'host'"):
        EmbeddingBagConfig(**config, placement="host", cache_load_factor=0.5)
    with pytest.raises(ValueError, match="not TT, not dynamic"):
        EmbeddingBagConfig(**config, placement="host", tt=TTConfig(tt_ranks=(4,)))
    with pytest.raises(ValueError, match="cache_policy must be one of"):
        EmbeddingBagConfig(**config, placement="host_cached", cache_policy="fifo")
    with pytest.raises(ValueError, match="cache_rows or cache_load_factor, not both"):
        EmbeddingBagConfig(**config, placement="host_cached", cache_rows=128, cache_load_factor=0.1)
    with pytest.raises(ValueError, match=r"cache_load_factor must lie in \(0, 1\]"):
        EmbeddingBagConfig(**config, placement="host_cached", cache_load_factor=1.5)
    with pytest.raises(ValueError, match="not TT, not dynamic"):
        EmbeddingBagConfig(**config, placement="host_cached", tt=TTConfig(tt_ranks=(4,)))
    cached = EmbeddingBagConfig(**config, placement="host_cached", cache_load_factor=0.3)
    assert cached.cache_size() == 384  # 300 rounded up to buckets of 128
    assert EmbeddingBagConfig(**config, placement="host_cached", cache_rows=5000).cache_size() == 1024
    for placed in (cached, EmbeddingBagConfig(**config, placement="host")):
        with pytest.raises(ValueError, match="placed in host memory.*give the collection a fused optimizer"):
            EmbeddingBagCollection([placed], rngs=nnx.Rngs(0))
    with monkeypatch.context() as patch:  # the host copy is checked against host memory
        patch.setattr(_memory, "free_bytes", lambda device=None: 1 << 40)  # the device: room
        patch.setattr(_memory, "host_free_bytes", lambda: 1000)
        with pytest.raises(ValueError, match=r"places 0.00 GiB of tables and optimizer state in host memory "
                                             r"\(tables \['t'\]\) but the host has"):
            EmbeddingBagCollection([cached], optimizer=SGD(learning_rate=0.1), rngs=nnx.Rngs(0))
    with monkeypatch.context() as patch:  # on the GPU, XLA's cap on host memory is checked too
        patch.setattr(_memory, "free_bytes", lambda device=None: 1 << 40)
        patch.setattr(_memory, "host_limit_bytes", lambda: 1000)
        with pytest.raises(ValueError, match="XLA hands out at most 0.00 GiB of it on the GPU: set "
                                             "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB to 8 or more"):
            EmbeddingBagCollection([cached], optimizer=SGD(learning_rate=0.1), rngs=nnx.Rngs(0))


def test_a_group_larger_than_the_device_builds_in_host_memory(monkeypatch):
    """Two tables of 3.2 MB each on a device with 7 MB free: placed on the device they need
    their 6.4 MB and as much again to draw them; in host memory, one table drawn at a time."""
    monkeypatch.setattr(_memory, "free_bytes", lambda device=None: 7 * 10**6)

    def configs(**kw):
        return [EmbeddingBagConfig(name=f"t{k}", num_embeddings=100_000, embedding_dim=8, feature_names=[f"f{k}"],
                                   **kw) for k in range(2)]

    with pytest.raises(ValueError, match="collection 'ebc' needs 0.01 GiB to build its tables"):
        EmbeddingBagCollection(configs(), optimizer=SGD(learning_rate=0.1), rngs=nnx.Rngs(0))
    placed = [EmbeddingBagCollection(configs(placement="host_cached", cache_rows=1024),
                                     optimizer=SGD(learning_rate=0.1), rngs=nnx.Rngs(0)),
              EmbeddingBagCollection(configs(placement="host"), optimizer=SGD(learning_rate=0.1), rngs=nnx.Rngs(0))]
    want = EmbeddingBagConfig(name="t1", num_embeddings=100_000, embedding_dim=8, feature_names=["f1"])
    drawn = [ebc.split_embedding_weights() for ebc in placed]
    for weights in drawn:
        assert weights["t1"].shape == (100_000, 8) and np.abs(weights["t1"]).max() <= want.init_bounds()[1]
        assert not np.array_equal(weights["t0"], weights["t1"])  # each drawn from its own key
    np.testing.assert_array_equal(drawn[0]["t0"], drawn[1]["t0"])  # the same rows in either placement
