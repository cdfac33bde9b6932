"""KeyedTensor on hand-drawn cases; expected values written out from TorchRec's semantics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sparse_testing import run  # noqa: F401  (fixtures)

from jaxrec.sparse import KeyedTensor

#          "f0" (dim 2)   "f1" (dim 3)           "f2" (dim 1)
# kt0 =  [[ 1  2   |   3  4  5],         kt1 = [[ 6],
#         [11 12   |  13 14 15]]                [16]]
# kt0: length_per_key [2, 3], offset_per_key [0, 2, 5]; kt1: [1], [0, 1]
KT0 = np.array([[1, 2, 3, 4, 5], [11, 12, 13, 14, 15]], np.float32)
KT1 = np.array([[6], [16]], np.float32)


@pytest.fixture
def kts():
    return KeyedTensor(["f0", "f1"], [2, 3], KT0), KeyedTensor(["f2"], [1], KT1)


def test_accessors(kts, run):
    kt0, _ = kts
    assert kt0.keys() == ["f0", "f1"] and kt0.key_dim() == 1
    assert kt0.length_per_key() == [2, 3] and kt0.offset_per_key() == [0, 2, 5]
    d = run(lambda k: k.to_dict(), kt0)
    np.testing.assert_array_equal(d["f0"], [[1, 2], [11, 12]])
    np.testing.assert_array_equal(d["f1"], [[3, 4, 5], [13, 14, 15]])
    np.testing.assert_array_equal(run(lambda k: k["f1"], kt0), [[3, 4, 5], [13, 14, 15]])
    with pytest.raises(KeyError, match="'f9'"):
        kt0["f9"]


def test_regroup(kts, run):
    # groups [["f2", "f0"], ["f1"]]:
    #   group 0 = [f2 | f0] = [[ 6,  1,  2], [16, 11, 12]]
    #   group 1 = [f1]      = [[ 3,  4,  5], [13, 14, 15]]
    g0, g1 = run(lambda a, b: KeyedTensor.regroup([a, b], [["f2", "f0"], ["f1"]]), *kts)
    np.testing.assert_array_equal(g0, [[6, 1, 2], [16, 11, 12]])
    np.testing.assert_array_equal(g1, [[3, 4, 5], [13, 14, 15]])
    # groups that match the inputs give their values back
    same = KeyedTensor.regroup(list(kts), [["f0", "f1"], ["f2"]])
    np.testing.assert_array_equal(same[0], KT0)
    np.testing.assert_array_equal(same[1], KT1)
    # one group with everything, in a new order: [f1 | f2 | f0]
    (all_,) = run(lambda a, b: KeyedTensor.regroup([a, b], [["f1", "f2", "f0"]]), *kts)
    np.testing.assert_array_equal(all_, [[3, 4, 5, 6, 1, 2], [13, 14, 15, 16, 11, 12]])


def test_regroup_as_dict(kts, run):
    d = run(
        lambda a, b: KeyedTensor.regroup_as_dict([a, b], [["f2", "f0"], ["f1"]], ["user", "item"]),
        *kts,
    )
    assert sorted(d) == ["item", "user"]  # (a dict returned by jax.jit comes back key-sorted)
    assert list(KeyedTensor.regroup_as_dict(list(kts), [["f2"], ["f1"]], ["z", "a"])) == ["z", "a"]
    np.testing.assert_array_equal(d["user"], [[6, 1, 2], [16, 11, 12]])
    np.testing.assert_array_equal(d["item"], [[3, 4, 5], [13, 14, 15]])
    with pytest.raises(ValueError, match="one key per group: 1 keys, 2 groups"):
        KeyedTensor.regroup_as_dict(list(kts), [["f2"], ["f1"]], ["user"])


def test_from_tensor_list_and_pytree(run):
    kt = KeyedTensor.from_tensor_list(["a", "b"], [jnp.ones((2, 1)), jnp.zeros((2, 3))])
    assert kt.length_per_key() == [1, 3] and kt.values().shape == (2, 4)
    out = run(lambda k: jax.tree.map(lambda x: x * 2, k), kt)
    assert isinstance(out, KeyedTensor) and out.keys() == ["a", "b"]
    np.testing.assert_array_equal(out["a"], [[2.0], [2.0]])
    assert len(jax.tree.leaves(kt)) == 1


def test_errors(kts):
    kt0, kt1 = kts
    with pytest.raises(ValueError, match=r"values.shape\[1\]=5 but sum\(length_per_key\)=4"):
        KeyedTensor(["f0", "f1"], [2, 2], KT0)
    with pytest.raises(ValueError, match="one non-negative dim per key"):
        KeyedTensor(["f0", "f1"], [5], KT0)
    with pytest.raises(ValueError, match="duplicates"):
        KeyedTensor(["f0", "f0"], [2, 3], KT0)
    with pytest.raises(ValueError, match="groups.1. names key 'nope'"):
        KeyedTensor.regroup([kt0, kt1], [["f0"], ["nope"]])
    with pytest.raises(ValueError, match="'f2' is in keyed_tensors.0. and keyed_tensors.1."):
        KeyedTensor.regroup([KeyedTensor(["f2"], [1], KT1), kt1], [["f2"]])
    with pytest.raises(ValueError, match="non-empty list of keys"):
        KeyedTensor.regroup([kt0], [[]])
