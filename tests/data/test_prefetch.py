"""Prefetcher (order, device_put, errors, clean shutdown) and the Batch pytree / rebatching."""

import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data_testing import bags
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrec.data import Batch, Prefetcher, SyntheticClickLog
from jaxrec.data._batch import make_batch, rebatch


class CountingSource:
    """A generator source that counts what it produced and whether it was closed."""

    def __init__(self, n, fail_at=None):
        self.n, self.fail_at = n, fail_at
        self.produced = 0
        self.closed = threading.Event()

    def __iter__(self):
        # the source keeps its generator alive, so only an explicit close() runs `finally`
        self.generator = self._generate()
        return self.generator

    def _generate(self):
        try:
            for i in range(self.n):
                if i == self.fail_at:
                    raise RuntimeError(f"source failed at item {i}")
                self.produced += 1
                yield np.full((3,), i, np.int32)
        finally:
            self.closed.set()


def assert_batches_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_same_batches_in_order_as_plain_iterator():
    log = SyntheticClickLog(max_rows=300, seed=11)
    plain = list(log.batches(32, 6))
    with Prefetcher(log.batches(32, 6), buffer_size=2) as it:
        fetched = list(it)
        assert not it.alive
    assert len(fetched) == 6
    for a, b in zip(plain, fetched):
        assert isinstance(b, Batch) and isinstance(b.dense, jax.Array)
        assert_batches_equal(a, b)
    assert not np.array_equal(np.asarray(fetched[0].dense), np.asarray(fetched[1].dense))


def test_device_put_places_items():
    device = jax.devices("cpu")[1]
    items = list(Prefetcher(CountingSource(4), device=device))
    assert [int(x[0]) for x in items] == [0, 1, 2, 3]
    assert all(isinstance(x, jax.Array) and x.devices() == {device} for x in items)
    raw = list(Prefetcher(CountingSource(2), device=False))
    assert all(isinstance(x, np.ndarray) for x in raw)


@pytest.mark.parametrize("how", ["close", "with", "gc"])
def test_early_stop_ends_thread_and_closes_source(how):
    source = CountingSource(10_000)
    before = set(threading.enumerate())
    it = Prefetcher(source, buffer_size=3, join_timeout_s=5)
    (thread,) = set(threading.enumerate()) - before
    first = [int(next(it)[0]) for _ in range(2)]
    assert first == [0, 1]
    if how == "close":
        it.close()
        it.close()  # idempotent
        assert not it.alive
        with pytest.raises(StopIteration):
            next(it)
    elif how == "with":
        with it:
            next(it)
        assert not it.alive
    else:
        del it
        gc.collect()
    assert source.closed.wait(timeout=5), "the prefetch thread did not stop"
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert source.produced <= 3 + 3 + 2  # consumed + queue + one in flight, not 10_000


def test_source_error_is_raised_in_order():
    it = Prefetcher(CountingSource(5, fail_at=3))
    assert [int(next(it)[0]) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="source failed at item 3"):
        next(it)
    assert not it.alive
    with pytest.raises(StopIteration):
        next(it)


def test_buffer_size_validated():
    with pytest.raises(ValueError, match=r"buffer_size must be an int >= 1, got 0"):
        Prefetcher([], buffer_size=0)


def test_batch_is_a_pytree_through_jit():
    log = SyntheticClickLog(num_embeddings_per_feature=[10, 20], num_dense=3, seed=0)
    batch = next(log.batches(8))

    @jax.jit
    def scale(b: Batch) -> Batch:
        return b._replace(dense=b.dense * 2.0, labels=1.0 - b.labels)

    out = scale(batch)
    assert isinstance(out, Batch) and out.batch_size == 8
    np.testing.assert_allclose(np.asarray(out.dense), 2.0 * np.asarray(batch.dense))
    np.testing.assert_array_equal(np.asarray(out.labels), 1.0 - np.asarray(batch.labels))
    assert bags(out.sparse) == bags(batch.sparse)
    assert jax.tree.structure(out) == jax.tree.structure(batch)


@settings(max_examples=40, deadline=None)
@given(
    chunk_sizes=st.lists(st.integers(0, 9), max_size=8),
    batch_size=st.integers(1, 7),
    last_batch=st.sampled_from(["pad", "drop"]),
)
def test_rebatch_keeps_rows_in_order(chunk_sizes, batch_size, last_batch):
    total = sum(chunk_sizes)
    rows = np.arange(1, total + 1)
    starts = np.cumsum([0] + chunk_sizes)
    chunks = [(rows[a:b], rows[a:b, None] * 10) for a, b in zip(starts[:-1], starts[1:])]
    out = list(rebatch(chunks, batch_size, last_batch))
    full = total // batch_size
    assert len(out) == (full if last_batch == "drop" or total % batch_size == 0 else full + 1)
    got = []
    for (a, b), num_valid in out:
        assert a.shape == (batch_size,) and b.shape == (batch_size, 1)
        assert not a[num_valid:].any() and not b[num_valid:].any()  # zero padding
        got += a[:num_valid].tolist()
        np.testing.assert_array_equal(b[:, 0], a * 10)
    assert got == rows[: full * batch_size if last_batch == "drop" else total].tolist()


def test_make_batch_padding_rows():
    #              0       1      2 (padding)  <-- batch
    # "a"          [4, 5]  []     []
    # "b"          [6]     [7]    []
    batch = make_batch(["a", "b"], np.array([4, 5, 6, 7]), np.array([[2, 0, 0], [1, 1, 0]]),
                       np.ones((3, 2)), np.array([1.0, 0.0, 0.0]), num_valid=2, capacity=8)
    assert bags(batch.sparse) == {"a": [[4, 5], [], []], "b": [[6], [7], []]}
    assert batch.sparse.capacity == 8 and batch.mask.tolist() == [1.0, 1.0, 0.0]
    assert batch.dense.dtype == jnp.float32 and batch.labels.tolist() == [1.0, 0.0, 0.0]
