"""KeyedJaggedTensor on hand-drawn cases; expected values written out from TorchRec's semantics.

Every case is checked eagerly and under ``jax.jit`` (the ``run`` fixture), with garbage
(999, -7, ...) in the padding slots of the input; outputs must have 0 in theirs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sparse_testing import jt_bags, kjt_bags, padded, run  # noqa: F401  (fixtures)

from jaxrec.sparse import JaggedTensor, KeyedJaggedTensor, capacity_bucket

# Case A: TorchRec's docstring example, capacity 12 (not a bucket size), weights present.
#
#              0         1       2  <-- batch (stride 3)
# "f0"         [10,11]   None    [12]
# "f1"         [20]      [21]    [22,23,24]
# lengths = [2, 0, 1, 1, 1, 3]; offsets = [0, 2, 2, 3, 4, 5, 8]
# values  = [10, 11, 12, 20, 21, 22, 23, 24, 999, -7, 999, -7]   (4 garbage slots)
# weights = [ 1,  2,  3,  4,  5,  6,  7,  8,  -7, 1e6, -7, 1e6]
# length_per_key = [3, 5]; offset_per_key = [0, 3, 8]
A_VALUES = [10, 11, 12, 20, 21, 22, 23, 24]
A_LENGTHS = [2, 0, 1, 1, 1, 3]
A_WEIGHTS = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
A_BAGS = [("f0", [[10, 11], [], [12]]), ("f1", [[20], [21], [22, 23, 24]])]

# Case B: three keys, stride 2, a key whose bags are all empty, no weights, capacity 10.
#
#              0         1       <-- batch (stride 2)
# "a"          [1]       [2,3]
# "b"          None      None
# "c"          [4,5,6]   [7]
# lengths = [1, 2, 0, 0, 3, 1]; offsets = [0, 1, 3, 3, 3, 6, 7]
# length_per_key = [3, 0, 4]; offset_per_key = [0, 3, 3, 7]
B_VALUES = [1, 2, 3, 4, 5, 6, 7]
B_LENGTHS = [1, 2, 0, 0, 3, 1]
B_BAGS = [("a", [[1], [2, 3]]), ("b", [[], []]), ("c", [[4, 5, 6], [7]])]


@pytest.fixture
def kjt_a(padded):
    return KeyedJaggedTensor.from_lengths_sync(
        ["f0", "f1"],
        padded(A_VALUES, 12),
        jnp.asarray(A_LENGTHS),
        padded(A_WEIGHTS, 12, jnp.float32),
    )


@pytest.fixture
def kjt_b(padded):
    return KeyedJaggedTensor.from_lengths_sync(["a", "b", "c"], padded(B_VALUES, 10), B_LENGTHS)


def test_layout_case_a(kjt_a, run, kjt_bags):
    offsets, lpk, opk = run(lambda k: (k.offsets(), k.length_per_key(), k.offset_per_key()), kjt_a)
    np.testing.assert_array_equal(offsets, [0, 2, 2, 3, 4, 5, 8])
    np.testing.assert_array_equal(lpk, [3, 5])
    np.testing.assert_array_equal(opk, [0, 3, 8])
    assert kjt_a.stride() == 3 and kjt_a.keys() == ["f0", "f1"] and kjt_a.capacity == 12
    assert kjt_a.stride_per_key() == [3, 3]
    assert kjt_bags(kjt_a, check_padding=False) == A_BAGS
    assert kjt_bags(kjt_a, check_padding=False, weights=True) == [
        ("f0", [[1.0, 2.0], [], [3.0]]),
        ("f1", [[4.0], [5.0], [6.0, 7.0, 8.0]]),
    ]


def test_layout_case_b(kjt_b, run):
    lpk, opk = run(lambda k: (k.length_per_key(), k.offset_per_key()), kjt_b)
    np.testing.assert_array_equal(lpk, [3, 0, 4])
    np.testing.assert_array_equal(opk, [0, 3, 3, 7])
    assert kjt_b.stride() == 2 and kjt_b.weights_or_none() is None


def test_to_dict_and_getitem(kjt_a, run, jt_bags):
    d = run(lambda k: k.to_dict(), kjt_a)
    assert list(kjt_a.permute([1, 0]).to_dict()) == ["f1", "f0"]  # key order, not sorted
    # "f0" -> lengths [2, 0, 1], ids [10, 11, 12]; "f1" -> lengths [1, 1, 3], ids [20..24].
    np.testing.assert_array_equal(d["f0"].lengths(), [2, 0, 1])
    np.testing.assert_array_equal(d["f0"].offsets(), [0, 2, 2, 3])
    assert jt_bags(d["f0"]) == [[10, 11], [], [12]]
    assert jt_bags(d["f1"]) == [[20], [21], [22, 23, 24]]
    assert jt_bags(d["f1"], weights=True) == [[4.0], [5.0], [6.0, 7.0, 8.0]]
    f1 = run(lambda k: k["f1"], kjt_a)
    np.testing.assert_array_equal(f1.values(), [20, 21, 22, 23, 24, 0, 0, 0, 0, 0, 0, 0])
    # Padded dense of "f1" (3 bags, longest 3):
    #   [[20,  0,  0],
    #    [21,  0,  0],
    #    [22, 23, 24]]
    dense = run(lambda k: k["f1"].to_padded_dense(3), kjt_a)
    np.testing.assert_array_equal(dense, [[20, 0, 0], [21, 0, 0], [22, 23, 24]])
    with pytest.raises(KeyError, match="'f9'.*'f0', 'f1'"):
        kjt_a["f9"]


def test_permute(kjt_a, run, kjt_bags):
    # [1, 0]: keys [f1, f0]; lengths [1, 1, 3, 2, 0, 1]; values [20..24, 10, 11, 12]
    p = run(lambda k: k.permute([1, 0]), kjt_a)
    assert p.keys() == ["f1", "f0"] and p.stride() == 3 and p.capacity == 12
    np.testing.assert_array_equal(p.lengths(), [1, 1, 3, 2, 0, 1])
    np.testing.assert_array_equal(p.values()[:8], [20, 21, 22, 23, 24, 10, 11, 12])
    np.testing.assert_array_equal(p.weights()[:8], [4, 5, 6, 7, 8, 1, 2, 3])
    assert kjt_bags(p) == [A_BAGS[1], A_BAGS[0]]


def test_permute_with_repeats(kjt_a, run, kjt_bags):
    # [1, 0, 1]: keys [f1, f0, f1]; capacity 12 * 2 (index 1 appears twice)
    # lengths [1, 1, 3, 2, 0, 1, 1, 1, 3]; values [20..24, 10, 11, 12, 20..24]
    p = run(lambda k: k.permute([1, 0, 1]), kjt_a)
    assert p.keys() == ["f1", "f0", "f1"] and p.capacity == 24
    np.testing.assert_array_equal(p.lengths(), [1, 1, 3, 2, 0, 1, 1, 1, 3])
    np.testing.assert_array_equal(
        p.values()[:13], [20, 21, 22, 23, 24, 10, 11, 12, 20, 21, 22, 23, 24]
    )
    assert kjt_bags(p) == [A_BAGS[1], A_BAGS[0], A_BAGS[1]]
    assert kjt_bags(p, weights=True)[2] == ("f1", [[4.0], [5.0], [6.0, 7.0, 8.0]])
    # Duplicate keys: lookups see the last occurrence (TorchRec's index_per_key).
    assert p.index_per_key() == {"f1": 2, "f0": 1}


def test_permute_subset_and_capacity(kjt_b, run, kjt_bags):
    # [2, 0]: drops "b"; keys [c, a]; lengths [3, 1, 1, 2]; values [4, 5, 6, 7, 1, 2, 3]
    p = run(lambda k: k.permute([2, 0]), kjt_b)
    assert kjt_bags(p) == [B_BAGS[2], B_BAGS[0]]
    np.testing.assert_array_equal(p.lengths(), [3, 1, 1, 2])
    p = run(lambda k: k.permute([2, 2, 2], capacity=12), kjt_b)
    assert p.capacity == 12 and kjt_bags(p) == [B_BAGS[2]] * 3
    with pytest.raises(ValueError, match="12 ids but capacity=11"):
        kjt_b.permute([2, 2, 2], capacity=11)
    with pytest.raises(ValueError, match=r"indices must be in \[0, 3\).*got 3"):
        kjt_b.permute([0, 3])
    with pytest.raises(TypeError, match="static list"):
        kjt_b.permute(jnp.array([0, 1]))


def test_split(kjt_b, run, kjt_bags):
    # segments [1, 0, 2]:
    #   KJT(["a"]):      lengths [1, 2],        values [1, 2, 3]
    #   KJT([]):         lengths [],            values []        (stride 2 kept)
    #   KJT(["b", "c"]): lengths [0, 0, 3, 1],  values [4, 5, 6, 7]
    s0, s1, s2 = run(lambda k: k.split([1, 0, 2]), kjt_b)
    assert kjt_bags(s0) == [B_BAGS[0]]
    np.testing.assert_array_equal(s0.lengths(), [1, 2])
    assert s1.keys() == [] and s1.stride() == 2 and s1.values().shape == (0,)
    assert s1.lengths().shape == (0,)
    np.testing.assert_array_equal(s1.offsets(), [0])
    assert s1.length_per_key().shape == (0,)
    np.testing.assert_array_equal(s1.offset_per_key(), [0])
    assert kjt_bags(s2) == B_BAGS[1:]
    np.testing.assert_array_equal(s2.values()[:4], [4, 5, 6, 7])
    np.testing.assert_array_equal(s2.offset_per_key(), [0, 0, 4])
    # One segment covering every key: the same KJT (padding zeroed); [0, 3]; [2] drops "c".
    (whole,) = run(lambda k: k.split([3]), kjt_b)
    assert kjt_bags(whole) == B_BAGS and whole.capacity == 10
    e, w = run(lambda k: k.split([0, 3]), kjt_b)
    assert e.keys() == [] and kjt_bags(w, check_padding=False) == B_BAGS
    (ab,) = run(lambda k: k.split([2]), kjt_b)
    assert kjt_bags(ab) == B_BAGS[:2]
    with pytest.raises(ValueError, match="sum to at most len.keys.=3"):
        kjt_b.split([2, 2])


def test_split_weighted(kjt_a, run, kjt_bags):
    s0, s1, s2 = run(lambda k: k.split([0, 1, 1]), kjt_a)
    assert s0.keys() == [] and s0.weights().shape == (0,)
    assert kjt_bags(s1) == [A_BAGS[0]] and kjt_bags(s2) == [A_BAGS[1]]
    assert kjt_bags(s2, weights=True) == [("f1", [[4.0], [5.0], [6.0, 7.0, 8.0]])]


def test_concat(kjt_a, padded, run, kjt_bags):
    # kjt_a (capacity 12) ++ g (capacity 8):
    #              0       1      2
    # "g0"         [30]    None   [31,32]
    # keys [f0, f1, g0]; lengths [2, 0, 1, 1, 1, 3, 1, 0, 2]
    # values [10, 11, 12, 20, 21, 22, 23, 24, 30, 31, 32]; capacity 12 + 8 = 20
    g = KeyedJaggedTensor.from_lengths_sync(
        ["g0"],
        padded([30, 31, 32], 8),
        [1, 0, 2],
        weights=padded([9.0, 10.0, 11.0], 8, jnp.float32),
    )
    c = run(lambda a, b: KeyedJaggedTensor.concat([a, b]), kjt_a, g)
    assert c.keys() == ["f0", "f1", "g0"] and c.stride() == 3 and c.capacity == 20
    np.testing.assert_array_equal(c.lengths(), [2, 0, 1, 1, 1, 3, 1, 0, 2])
    np.testing.assert_array_equal(c.values()[:11], [10, 11, 12, 20, 21, 22, 23, 24, 30, 31, 32])
    np.testing.assert_array_equal(c.weights()[:11], np.arange(1, 12))
    assert kjt_bags(c) == A_BAGS + [("g0", [[30], [], [31, 32]])]


def test_split_then_concat_roundtrip(kjt_b, run, kjt_bags):
    c = run(lambda k: KeyedJaggedTensor.concat(k.split([1, 0, 2])), kjt_b)
    assert c.capacity == 10 + 0 + 10 and kjt_bags(c) == B_BAGS


def test_concat_errors(kjt_a, kjt_b):
    with pytest.raises(ValueError, match="same stride"):
        KeyedJaggedTensor.concat([kjt_b, KeyedJaggedTensor(["x"], [1], lengths=[1, 0, 0])])
    with pytest.raises(ValueError, match="weighted with unweighted"):
        KeyedJaggedTensor.concat([kjt_a, KeyedJaggedTensor(["x"], [1], lengths=[1, 0, 0])])
    with pytest.raises(ValueError, match="at least one"):
        KeyedJaggedTensor.concat([])
    with pytest.raises(ValueError, match="capacity=5"):
        KeyedJaggedTensor.concat([kjt_b, kjt_b], capacity=5)


def test_from_offsets_and_jt_dict(kjt_bags, run):
    # Same layout as case A, from offsets [0, 2, 2, 3, 4, 5, 8]; host data -> capacity 8.
    k = KeyedJaggedTensor.from_offsets_sync(["f0", "f1"], A_VALUES, [0, 2, 2, 3, 4, 5, 8])
    assert k.capacity == 8 and kjt_bags(k) == A_BAGS
    jt_dict = {
        "f0": JaggedTensor(jnp.array([10, 11, 12, -7]), lengths=jnp.array([2, 0, 1])),
        "f1": JaggedTensor(jnp.array([20, 21, 22, 23, 24, 999]), lengths=jnp.array([1, 1, 3])),
    }
    k = run(KeyedJaggedTensor.from_jt_dict, jt_dict)
    assert k.capacity == 10 and k.stride() == 3 and kjt_bags(k) == A_BAGS
    with pytest.raises(ValueError, match="same number of bags"):
        KeyedJaggedTensor.from_jt_dict({"x": JaggedTensor([1], lengths=[1]), "y": jt_dict["f0"]})
    with pytest.raises(ValueError, match="offsets must start at 0"):
        KeyedJaggedTensor.from_offsets_sync(["f0"], [1, 2], [1, 2])


def test_stride_one_and_single_huge_bag(run, padded, kjt_bags):
    # stride 1:   "x" [1..100] (one bag of 100 ids)   "y" None   "z" [7]
    # lengths = [100, 0, 1]; offsets = [0, 100, 100, 101]; capacity 128
    vals = list(range(1, 101)) + [7]
    k = KeyedJaggedTensor.from_lengths_sync(["x", "y", "z"], padded(vals, 128), [100, 0, 1])
    assert k.stride() == 1
    opk, p = run(lambda k: (k.offset_per_key(), k.permute([2, 1, 0])), k)
    np.testing.assert_array_equal(opk, [0, 100, 100, 101])
    assert kjt_bags(p) == [("z", [[7]]), ("y", [[]]), ("x", [list(range(1, 101))])]
    dense = run(lambda k: k["x"].to_padded_dense(101, -1), k)
    np.testing.assert_array_equal(dense, [list(range(1, 101)) + [-1]])


def test_empty_and_all_empty_bags(run, kjt_bags):
    e = KeyedJaggedTensor.empty()
    assert e.keys() == [] and e.stride() == 0 and e.capacity == 0 and e.weights_or_none() is None
    np.testing.assert_array_equal(e.offset_per_key(), [0])
    assert KeyedJaggedTensor.empty(is_weighted=True, capacity=4).weights().shape == (4,)
    # Every bag empty: lengths = [0, 0, 0, 0]; values are all padding.
    k = KeyedJaggedTensor.from_lengths_sync(["a", "b"], jnp.array([5, 6, 7]), [0, 0, 0, 0])
    opk, dense, p = run(
        lambda k: (k.offset_per_key(), k["b"].to_padded_dense(2, 9), k.permute([1, 1])), k
    )
    np.testing.assert_array_equal(opk, [0, 0, 0])
    np.testing.assert_array_equal(dense, [[9, 9], [9, 9]])
    assert kjt_bags(p) == [("b", [[], []]), ("b", [[], []])]


def test_int64_values(run, kjt_bags):
    big = 2**40
    with jax.enable_x64(True):
        k = KeyedJaggedTensor.from_lengths_sync(
            ["f0", "f1"], np.array([big, 1, big + 2, 3], np.int64), [1, 1, 0, 2]
        )
        assert k.values().dtype == jnp.int64 and k.capacity == 8
        p, s, f1 = run(lambda k: (k.permute([1, 0]), k.split([1, 1]), k["f1"]), k)
        assert p.values().dtype == jnp.int64 and s[1].values().dtype == jnp.int64
        assert kjt_bags(p) == [("f1", [[], [big + 2, 3]]), ("f0", [[big], [1]])]
        assert f1.values().dtype == jnp.int64
        c = KeyedJaggedTensor.concat(s)
        assert kjt_bags(c) == [("f0", [[big], [1]]), ("f1", [[], [big + 2, 3]])]
    # Without x64, int32 ids stay int32 and too-large ids are refused.
    small = KeyedJaggedTensor(["a"], np.array([1, 2], np.int64), lengths=[2])
    assert small.values().dtype == jnp.int32
    with pytest.raises(ValueError, match="jax_enable_x64"):
        KeyedJaggedTensor(["a"], np.array([big], np.int64), lengths=[1])


def test_capacity_buckets():
    assert [capacity_bucket(n) for n in (0, 1, 8, 9, 16, 17, 1000)] == [8, 8, 8, 16, 16, 32, 1024]
    assert KeyedJaggedTensor(["a"], list(range(5)), lengths=[5]).capacity == 8
    assert KeyedJaggedTensor(["a"], list(range(17)), lengths=[17]).capacity == 32
    assert KeyedJaggedTensor(["a"], list(range(17)), lengths=[17], capacity=20).capacity == 20
    assert KeyedJaggedTensor(["a"], jnp.arange(13), lengths=[13]).capacity == 13
    k = KeyedJaggedTensor(["a"], jnp.arange(3), lengths=[3], capacity=6)
    np.testing.assert_array_equal(k.values(), [0, 1, 2, 0, 0, 0])
    with pytest.raises(ValueError) as e:
        KeyedJaggedTensor(["a"], np.arange(1000), lengths=[1000], capacity=512)
    assert str(e.value) == (
        "values has 1000 ids but capacity=512; pass capacity>=1000 or split the batch."
    )


def test_validation_errors():
    with pytest.raises(ValueError, match="lengths has 5 entries, not a multiple of len.keys.=2"):
        KeyedJaggedTensor(["a", "b"], [1, 2], lengths=[1, 1, 0, 0, 0])
    with pytest.raises(ValueError, match=r"2 \* 3 = 6"):
        KeyedJaggedTensor(["a", "b"], [1, 2], lengths=[1, 1, 0, 0], stride=3)
    with pytest.raises(ValueError, match=r"lengths\[1\]=-1"):
        KeyedJaggedTensor(["a"], [1, 2], lengths=[2, -1, 1])
    with pytest.raises(ValueError, match="lengths sum to 4 but values has only 3 entries"):
        KeyedJaggedTensor(["a"], jnp.array([1, 2, 3]), lengths=[2, 2])
    with pytest.raises(ValueError, match=r"weights must have shape \(3,\)"):
        KeyedJaggedTensor(["a"], [1, 2, 3], lengths=[3], weights=[1.0, 2.0])
    with pytest.raises(TypeError, match="integer ids.*JaggedTensor"):
        KeyedJaggedTensor(["a"], jnp.array([1.0, 2.0]), lengths=[2])
    with pytest.raises(TypeError, match="values must hold integers"):
        KeyedJaggedTensor(["a"], [1.5, 2.0], lengths=[2])
    with pytest.raises(TypeError, match="lengths must hold integers"):
        KeyedJaggedTensor(["a"], [1, 2], lengths=jnp.array([2.0]))
    with pytest.raises(TypeError, match="weights must be floating"):
        KeyedJaggedTensor(["a"], [1, 2], lengths=[2], weights=jnp.array([1, 2]))
    with pytest.raises(TypeError, match="single str"):
        KeyedJaggedTensor("a", [1, 2], lengths=[2])
    with pytest.raises(ValueError, match="lengths=... or offsets="):
        KeyedJaggedTensor(["a"], [1, 2])
    with pytest.raises(ValueError, match="no weights; use weights_or_none"):
        KeyedJaggedTensor(["a"], [1, 2], lengths=[2]).weights()


def test_pytree_jit_and_tree_map(kjt_a, kjt_bags):
    leaves, treedef = jax.tree.flatten(kjt_a)
    assert len(leaves) == 3  # values, lengths, weights; keys and stride are static
    traces = []

    @jax.jit
    def f(k):
        traces.append(1)
        return k

    out = f(kjt_a)
    assert isinstance(out, KeyedJaggedTensor) and out.keys() == ["f0", "f1"] and out.stride() == 3
    np.testing.assert_array_equal(out.values(), kjt_a.values())
    f(jax.tree.map(lambda x: x, kjt_a))  # same keys/stride/capacity: no retrace
    assert len(traces) == 1
    f(kjt_a.permute([1, 0]))  # other keys: a new trace
    assert len(traces) == 2
    doubled = jax.tree.map(lambda x: x * 2 if x.dtype == jnp.float32 else x, kjt_a)
    assert kjt_bags(doubled, check_padding=False, weights=True)[0] == (
        "f0",
        [[2.0, 4.0], [], [6.0]],
    )
    assert jax.tree.structure(doubled) == treedef


def test_traced_construction_and_repr(kjt_a):
    @jax.jit
    def build(values, lengths):
        k = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], values, lengths)
        assert "stride=3" in repr(k) and "int32[12]" in repr(k)
        return k.length_per_key()

    np.testing.assert_array_equal(build(kjt_a.values(), kjt_a.lengths()), [3, 5])
    assert repr(kjt_a).splitlines()[1] == (
        "    'f0': {'values': [[10, 11], [], [12]], 'weights': [[1.0, 2.0], [], [3.0]]},"
    )
    assert repr(kjt_a.permute([1])).splitlines()[1] == (
        "    'f1': {'values': [[20], [21], [22, 23, 24]], 'weights': [[4.0], [5.0], [6.0, 7.0, 8.0]]}"
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("on_device", [False, True])
def test_half_precision_weights_are_accepted(dtype, on_device):
    rng = np.random.default_rng(11)
    weights = rng.uniform(0.5, 2.0, 5).astype(dtype)
    weights = jnp.asarray(weights) if on_device else weights
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], [1, 2, 3, 4, 5], [2, 0, 1, 2],
                                              weights=weights, capacity=8)
    assert kjt.weights().dtype == dtype
    np.testing.assert_array_equal(np.asarray(kjt.weights()[:5], np.float32),
                                  np.asarray(weights, np.float32))
