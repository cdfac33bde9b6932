"""Randomized checks of KeyedJaggedTensor / JaggedTensor against a pure-Python model.

The model of a KJT is ``[(key, [bag, bag, ...]), ...]`` with bags as Python lists; each op
is written on it the obvious way. Hypothesis draws lengths (many empty bags, keys whose
bags are all empty, one huge bag) and values, and random garbage fills the padding. The
static layout (keys, stride, capacity, permute indices, split segments) comes from a small
fixed set, so each compiles once and the data varies freely.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrec.sparse import JaggedTensor, KeyedJaggedTensor


@dataclasses.dataclass(frozen=True)
class Layout:
    keys: tuple
    stride: int
    capacity: int
    weighted: bool
    indices: tuple  # for permute (repeats allowed)
    segments: tuple  # for split (zeros allowed)
    dense_len: int  # for to_padded_dense (shorter than some bags: truncation)
    int64: bool = False


LAYOUTS = [
    Layout(("a", "b", "c"), 4, 64, True, (2, 0, 2, 1), (1, 0, 2), 3),
    Layout(("x",), 1, 16, False, (0, 0), (0, 1), 16),
    Layout(("p", "q", "r", "s"), 2, 40, False, (3, 1), (2, 2, 0), 4),
    Layout(("u", "v"), 3, 32, True, (1, 0), (2,), 2, int64=True),
]


# ---- the model -------------------------------------------------------------------------
def model_offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).tolist()


def model_bags(keys, stride, lengths, values):
    off = model_offsets(lengths)
    bags = [values[off[i] : off[i + 1]] for i in range(len(lengths))]
    return [(k, bags[i * stride : (i + 1) * stride]) for i, k in enumerate(keys)]


def model_permute(bags, indices):
    return [bags[i] for i in indices]


def model_split(bags, segments):
    out, start = [], 0
    for s in segments:
        out.append(bags[start : start + s])
        start += s
    return out


def model_padded(bag_list, d, pad):
    return [list(b[:d]) + [pad] * max(d - len(b), 0) for b in bag_list]


def kjt_view(kjt):
    """Host view of a result; its padding must be 0."""
    lengths = np.asarray(kjt.lengths())
    values = np.asarray(kjt.values())
    total = int(lengths.sum())
    assert not values[total:].any(), "output padding must be 0"
    out = model_bags(kjt.keys(), kjt.stride(), lengths, values.tolist())
    if kjt.weights_or_none() is not None:
        w = np.asarray(kjt.weights())
        assert not w[total:].any(), "output weight padding must be 0"
        return out, model_bags(kjt.keys(), kjt.stride(), lengths, w.tolist())
    return out, None


# ---- the ops under test, one jitted program per layout ---------------------------------
@functools.cache
def program(layout: Layout):
    @jax.jit
    def f(kjt):
        d = kjt.to_dict()
        parts = kjt.split(layout.segments)
        return dict(
            offsets=kjt.offsets(),
            lpk=kjt.length_per_key(),
            opk=kjt.offset_per_key(),
            dict=d,
            dense={k: jt.to_padded_dense(layout.dense_len, -1) for k, jt in d.items()},
            permuted=kjt.permute(layout.indices),
            parts=parts,
            concat=KeyedJaggedTensor.concat(parts),
            from_dict=KeyedJaggedTensor.from_jt_dict(d),
        )

    return f


@st.composite
def cases(draw):
    layout = draw(st.sampled_from(LAYOUTS))
    n = len(layout.keys) * layout.stride
    lengths = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    if draw(st.booleans()):  # a key with all bags empty
        k = draw(st.integers(0, len(layout.keys) - 1))
        lengths[k * layout.stride : (k + 1) * layout.stride] = [0] * layout.stride
    if draw(st.booleans()):  # one huge bag fills the capacity
        i = draw(st.integers(0, n - 1))
        lengths[i] = 0
        lengths[i] = layout.capacity - sum(lengths)
    seed = draw(st.integers(0, 2**31 - 1))
    return layout, lengths, seed


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(cases())
def test_kjt_ops_match_model(case):
    layout, lengths, seed = case
    rng = np.random.default_rng(seed)
    with jax.enable_x64(layout.int64):
        dtype = np.int64 if layout.int64 else np.int32
        high = 2**40 if layout.int64 else 1000
        # random ids, garbage in the padding (never 0, so leaks show)
        values = rng.integers(0, high, layout.capacity).astype(dtype)
        total = sum(lengths)
        values[total:] = rng.choice([999, -7], layout.capacity - total)
        weights = rng.uniform(0.5, 2.0, layout.capacity).astype(np.float32)
        weights[total:] = -7.0
        kjt = KeyedJaggedTensor.from_lengths_sync(
            layout.keys,
            jnp.asarray(values),
            jnp.asarray(lengths, jnp.int32),
            weights=jnp.asarray(weights) if layout.weighted else None,
        )
        assert kjt.capacity == layout.capacity and kjt.stride() == layout.stride
        out = program(layout)(kjt)
        assert out["permuted"].values().dtype == dtype

    ids = values[:total].tolist()
    bags = model_bags(layout.keys, layout.stride, lengths, ids)
    wbags = model_bags(layout.keys, layout.stride, lengths, weights[:total].tolist())

    np.testing.assert_array_equal(out["offsets"], model_offsets(lengths))
    lpk = [sum(map(len, b)) for _, b in bags]
    np.testing.assert_array_equal(out["lpk"], lpk)
    np.testing.assert_array_equal(out["opk"], model_offsets(lpk))

    for (key, key_bags), (_, key_wbags) in zip(bags, wbags):
        jt = out["dict"][key]
        jt_lengths = np.asarray(jt.lengths())
        np.testing.assert_array_equal(jt_lengths, [len(b) for b in key_bags])
        got = np.asarray(jt.values())
        n_key = int(jt_lengths.sum())
        assert not got[n_key:].any()
        assert model_bags([key], layout.stride, jt_lengths, got.tolist()) == [(key, key_bags)]
        if layout.weighted:
            np.testing.assert_array_equal(jt.weights()[:n_key], sum(key_wbags, []))
        np.testing.assert_array_equal(
            out["dense"][key], model_padded(key_bags, layout.dense_len, -1)
        )

    def check(kjt_out, expected, expected_w):
        got, got_w = kjt_view(kjt_out)
        assert got == expected
        if layout.weighted:
            assert got_w == expected_w

    check(
        out["permuted"], model_permute(bags, layout.indices), model_permute(wbags, layout.indices)
    )
    for part, exp, exp_w in zip(
        out["parts"], model_split(bags, layout.segments), model_split(wbags, layout.segments)
    ):
        assert part.stride() == layout.stride
        check(part, exp, exp_w)
    covered = sum(layout.segments)
    check(out["concat"], bags[:covered], wbags[:covered])
    check(out["from_dict"], bags, wbags)


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(st.lists(st.lists(st.integers(-50, 50), max_size=6), min_size=1, max_size=6))
def test_jagged_tensor_from_dense_roundtrip(bag_list):
    # Host constructor -> capacity bucket; to_dense / to_padded_dense reproduce the bags.
    jt = JaggedTensor.from_dense([np.asarray(b, np.int32) for b in bag_list])
    total = sum(map(len, bag_list))
    assert jt.capacity == max(8, 1 << (max(total, 1) - 1).bit_length())
    assert [b.tolist() for b in jt.to_dense()] == bag_list
    longest = max(map(len, bag_list))
    np.testing.assert_array_equal(
        jt.to_padded_dense(padding_value=-99).reshape(len(bag_list), longest),
        np.asarray(model_padded(bag_list, longest, -99)).reshape(len(bag_list), longest),
    )
