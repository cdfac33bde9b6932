"""JaggedTensor on hand-drawn cases; expected values written out from TorchRec's semantics.

Each case runs eagerly and under ``jax.jit`` (``run`` fixture) with garbage in the padding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sparse_testing import jt_bags, padded, run  # noqa: F401  (fixtures)

from jaxrec.sparse import JaggedTensor

# bag:      0        1      2
#           [1,2]    None   [3,4,5]
# lengths = [2, 0, 3]; offsets = [0, 2, 2, 5]
# values  = [1, 2, 3, 4, 5, 999, -7, 999]              capacity 8, 3 garbage slots
# weights = [.5, 1, 1.5, 2, 2.5, -7, 1e6, -7]
VALUES = [1, 2, 3, 4, 5]
WEIGHTS = [0.5, 1.0, 1.5, 2.0, 2.5]
LENGTHS = [2, 0, 3]


@pytest.fixture
def jt(padded):
    return JaggedTensor(
        padded(VALUES, 8), weights=padded(WEIGHTS, 8, jnp.float32), lengths=jnp.asarray(LENGTHS)
    )


def test_offsets_and_accessors(jt, run):
    offsets = run(lambda j: j.offsets(), jt)
    np.testing.assert_array_equal(offsets, [0, 2, 2, 5])
    np.testing.assert_array_equal(jt.lengths(), LENGTHS)
    assert jt.capacity == 8 and jt.weights().shape == (8,)


def test_to_padded_dense(jt, run):
    # desired_length=2, padding -1: bags cut to 2 ->  [[1, 2], [-1, -1], [3, 4]]
    # desired_length=4, padding 0:                    [[1, 2, 0, 0], [0, 0, 0, 0], [3, 4, 5, 0]]
    # weights, desired_length=3:                      [[.5, 1, 0], [0, 0, 0], [1.5, 2, 2.5]]
    cut, wide, w = run(
        lambda j: (j.to_padded_dense(2, -1), j.to_padded_dense(4), j.to_padded_dense_weights(3)), jt
    )
    np.testing.assert_array_equal(cut, [[1, 2], [-1, -1], [3, 4]])
    np.testing.assert_array_equal(wide, [[1, 2, 0, 0], [0, 0, 0, 0], [3, 4, 5, 0]])
    np.testing.assert_array_equal(w, [[0.5, 1.0, 0.0], [0.0, 0.0, 0.0], [1.5, 2.0, 2.5]])
    assert cut.dtype == jnp.int32 and w.dtype == jnp.float32
    # Default desired_length = the longest bag (3); needs concrete lengths.
    np.testing.assert_array_equal(jt.to_padded_dense(), [[1, 2, 0], [0, 0, 0], [3, 4, 5]])
    np.testing.assert_array_equal(jt.to_padded_dense_weights(padding_value=9.0)[1], [9.0, 9.0, 9.0])


def test_to_dense(jt):
    # TorchRec: a list of one array per bag.
    assert [b.tolist() for b in jt.to_dense()] == [[1, 2], [], [3, 4, 5]]
    assert [b.tolist() for b in jt.to_dense_weights()] == [[0.5, 1.0], [], [1.5, 2.0, 2.5]]


def test_dense_views_under_jit_say_what_to_do(jt):
    with pytest.raises(ValueError, match=r"to_dense\(\).*to_padded_dense\(desired_length=...\)"):
        jax.jit(lambda j: j.to_dense())(jt)
    with pytest.raises(ValueError, match="pass a static desired_length"):
        jax.jit(lambda j: j.to_padded_dense())(jt)
    with pytest.raises(ValueError, match="desired_length must be a static Python int"):
        jt.to_padded_dense(jnp.array(3))


def test_weights_absent(run):
    j = JaggedTensor(jnp.array([7, 8, 999]), lengths=jnp.array([0, 2]))
    assert j.weights_or_none() is None and j.to_dense_weights() is None
    assert run(lambda j: j.to_padded_dense_weights(2), j) is None
    with pytest.raises(ValueError, match="no weights; use weights_or_none"):
        j.weights()


def test_from_dense(jt_bags):
    # [[1.], [], [7., 8.]] -> lengths [1, 0, 2]; host data -> capacity bucket 8
    j = JaggedTensor.from_dense([[1.0], [], [7.0, 8.0]], weights=[[0.1], [], [0.2, 0.3]])
    assert j.capacity == 8 and j.values().dtype == jnp.float32
    np.testing.assert_array_equal(j.lengths(), [1, 0, 2])
    assert jt_bags(j) == [[1.0], [], [7.0, 8.0]]
    np.testing.assert_allclose(j.weights()[:3], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="weights has 1 bags but values has 3"):
        JaggedTensor.from_dense([[1.0], [], [7.0]], weights=[[1.0]])


def test_from_dense_lengths(run, jt_bags):
    # values = [[1, 2, 3],       lengths = [2, 0, 3]  ->  bags [[1, 2], [], [7, 8, 9]]
    #           [4, 5, 6],                                 (4, 5, 6, 3 never read)
    #           [7, 8, 9]]
    dense = jnp.arange(1, 10).reshape(3, 3)
    j = run(lambda d, l: JaggedTensor.from_dense_lengths(d, l), dense, jnp.array([2, 0, 3]))
    assert j.capacity == 9 and jt_bags(j) == [[1, 2], [], [7, 8, 9]]
    with pytest.raises(ValueError, match=r"lengths must be <= values.shape\[1\]=3"):
        JaggedTensor.from_dense_lengths(dense, jnp.array([4, 0, 0]))


def test_trailing_dims(run):
    # Sequence embeddings: values [capacity, 2]; bags [[e0, e1], [e2]] -> [2, 2, 2] padded.
    emb = jnp.array([[1.0, 1.5], [2.0, 2.5], [3.0, 3.5], [-7.0, -7.0]])
    j = JaggedTensor(emb, lengths=jnp.array([2, 1]))
    dense = run(lambda j: j.to_padded_dense(2), j)
    np.testing.assert_array_equal(dense, [[[1.0, 1.5], [2.0, 2.5]], [[3.0, 3.5], [0.0, 0.0]]])


def test_offsets_constructor_empty_and_errors(jt_bags):
    j = JaggedTensor([4, 5, 6], offsets=[0, 0, 3])
    assert jt_bags(j) == [[], [4, 5, 6]] and j.capacity == 8
    e = JaggedTensor.empty(is_weighted=True)
    assert (
        e.lengths().shape == (0,) and e.weights().shape == (0,) and e.values().dtype == jnp.float32
    )
    np.testing.assert_array_equal(e.offsets(), [0])
    assert e.to_dense() == [] and e.to_padded_dense().shape == (0, 0)
    with pytest.raises(ValueError, match="offsets must start at 0, got offsets.0.=1"):
        JaggedTensor([1, 2], offsets=[1, 2])
    with pytest.raises(ValueError, match=r"offsets differences \(lengths\) must be >= 0"):
        JaggedTensor([1, 2], offsets=[0, 2, 1])
    with pytest.raises(ValueError, match="values has 3 ids but capacity=2"):
        JaggedTensor([1, 2, 3], lengths=[3], capacity=2)
    with pytest.raises(ValueError, match="capacity must be a non-negative Python int"):
        JaggedTensor([1, 2, 3], lengths=[3], capacity=-1)


def test_pytree(jt):
    out = jax.jit(lambda j: jax.tree.map(lambda x: x + 1, j))(jt)
    assert isinstance(out, JaggedTensor)
    np.testing.assert_array_equal(out.lengths(), [3, 1, 4])
    assert "JaggedTensor([[1, 2], [], [3, 4, 5]], weights=" in repr(jt)
