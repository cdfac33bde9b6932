"""A train step never loses the model: FATAL bad ids, NaN/Inf losses and gradients.

Each test builds a small model, takes a snapshot of every array it holds (tables, their
optimizer slots, dense parameters, optax state), feeds one bad batch and checks that the
error comes (at a call once the device has finished the bad step, or at ``check()``), that
the snapshot is unchanged and still readable (the step donated its buffers), and that training then goes on.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrec import NonFiniteError, fused, optim
from jaxrec.models import DLRM
from jaxrec.nn import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    TTConfig,
    make_train_step,
)
from jaxrec.optim import Adam, RowWiseAdagrad
from jaxrec.sparse import KeyedJaggedTensor

KEYS = ["user", "item", "geo"]
ROWS = {"user": 40, "item": 90, "geo": 7}
B = 6


def tables(mode="WARNING", tt=False):
    return [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=ROWS[k], embedding_dim=8,
                               feature_names=[k],
                               tt=TTConfig(tt_ranks=(4,)) if tt and k == "item" else None)
            for k in KEYS]


def model_of(optimizer, mode="WARNING", tt=False, seed=0):
    ebc = EmbeddingBagCollection(tables(tt=tt), optimizer=optimizer, bounds_check_mode=mode,
                                 rngs=nnx.Rngs(seed))
    return DLRM(ebc, 4, [16, 8], [16, 1], rngs=nnx.Rngs(seed + 1))


def batch_of(rng, *, bad_id=None, weights=False, nan_weight=False, nan_dense=False):
    lengths = rng.integers(0, 4, size=len(KEYS) * B)
    lengths[2] = 0  # an empty bag
    values = np.concatenate([rng.integers(0, ROWS[k], lengths[i * B:(i + 1) * B].sum())
                             for i, k in enumerate(KEYS)]).astype(np.int32)
    if bad_id is not None:
        lengths[0] += 1  # one more id in user's first bag
        values = np.insert(values, 0, bad_id)
    w = rng.uniform(0.5, 2.0, values.shape[0]).astype(np.float32) if weights or nan_weight else None
    if nan_weight:
        w[len(w) // 2] = np.nan
    kjt = KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths, weights=w, capacity=64)
    dense = rng.normal(size=(B, 4)).astype(np.float32)
    if nan_dense:
        dense[1, 2] = np.inf
    labels = rng.integers(0, 2, B).astype(np.float32)
    return dense, kjt, labels


def bce(model, dense, kjt, labels):
    logits = model(dense, kjt)[:, 0]
    return optax.sigmoid_binary_cross_entropy(logits, labels).mean()


def snapshot(model, optimizer):
    """Every array of the model and the optax state, as host copies."""
    state = jax.tree.leaves((nnx.state(model), optimizer.opt_state))
    return [np.array(x) for x in state if hasattr(x, "shape")]


def assert_unchanged(before, model, optimizer):
    after = snapshot(model, optimizer)  # reading raises if a buffer was donated and lost
    assert len(before) == len(after)
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)


def assert_finite(model):
    for x in jax.tree.leaves(nnx.state(model)):
        if jnp.issubdtype(x.dtype, jnp.floating):
            assert np.isfinite(np.asarray(x)).all()


OPTIMIZERS = {"rowwise_adagrad": RowWiseAdagrad(learning_rate=0.1),
              "adam": Adam(learning_rate=0.01), "plain": None}


@pytest.mark.parametrize("platform", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fatal_bad_id_leaves_model_usable(platform, name):
    with jax.default_device(jax.devices(platform)[0]):
        rng = np.random.default_rng(1)
        model = model_of(OPTIMIZERS[name], mode="FATAL")
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        step = make_train_step(bce)
        step(model, optimizer, *batch_of(rng))
        step.check()
        before = snapshot(model, optimizer)
        step(model, optimizer, *batch_of(rng, bad_id=ROWS["user"]))  # id == rows
        with pytest.raises(ValueError, match=r"train step 1: .*feature 'user'.*indices\[0\]=40 "
                                             r"is out of range for a table of 40 rows"):
            step.check()
        assert_unchanged(before, model, optimizer)
        step(model, optimizer, *batch_of(rng))  # training goes on
        step.check()
        assert not all(np.array_equal(a, b) for a, b in zip(before, snapshot(model, optimizer)))


def after_a_bad_step():
    """``(rng, model, optimizer, step, before)``: step 0 of ``step`` had a FATAL bad id;
    ``before`` is the snapshot from before it."""
    rng = np.random.default_rng(2)
    model = model_of(RowWiseAdagrad(learning_rate=0.1), mode="FATAL")
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = make_train_step(bce)
    before = snapshot(model, optimizer)
    step(model, optimizer, *batch_of(rng, bad_id=-7))
    return rng, model, optimizer, step, before


def test_steps_issued_after_a_bad_one_update_nothing_until_it_is_raised():
    rng, model, optimizer, step, before = after_a_bad_step()
    with pytest.raises(ValueError, match=r"train step 0: .*indices\[0\]=-7.*Steps 1-3, issued "
                                         r"before this was seen, were skipped too\.$"):
        for _ in range(3):  # fewer than 16 calls read nothing: check() raises
            step(model, optimizer, *batch_of(rng))
        step.check()
    assert step.stats()["steps"] == 4
    assert_unchanged(before, model, optimizer)  # the latch skipped steps 1-3
    jax.block_until_ready(nnx.state(model))
    step(model, optimizer, *batch_of(rng))  # re-armed: training goes on
    step.check()
    assert not all(np.array_equal(a, b) for a, b in zip(before, snapshot(model, optimizer)))


def test_a_later_call_raises_without_waiting_and_before_issuing_its_own():
    """Findings are read every 16 calls, of the steps the device has finished."""
    rng, model, optimizer, step, before = after_a_bad_step()
    good = batch_of(rng)
    with pytest.raises(ValueError, match=r"train step 0: .*Steps 1-15, issued before this was "
                                         r"seen, were skipped too\.$"):
        for _ in range(16):
            jax.block_until_ready(nnx.state(model))  # the device is done before each call
            step(model, optimizer, *good)
    assert step.stats()["steps"] == 16  # the raising call issued nothing
    assert_unchanged(before, model, optimizer)


@pytest.mark.parametrize("platform", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("tt", [False, True])
@pytest.mark.parametrize("name", ["rowwise_adagrad", "adam"])
def test_nan_per_sample_weight_skips_the_whole_update(platform, tt, name):
    if tt and name == "adam":
        pytest.skip("TT tables train with SGD or Adagrad")
    with jax.default_device(jax.devices(platform)[0]):
        rng = np.random.default_rng(3)
        config = (optim.Adagrad(learning_rate=0.1) if tt else OPTIMIZERS[name])
        model = model_of(config, tt=tt)
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        step = make_train_step(bce)
        step(model, optimizer, *batch_of(rng, weights=True))
        step.check()
        before = snapshot(model, optimizer)
        step(model, optimizer, *batch_of(rng, nan_weight=True))
        with pytest.raises(NonFiniteError, match="train step 1: the loss, a gradient or an updated dense value") as err:
            step.check()
        assert err.value.step == 1
        assert_unchanged(before, model, optimizer)
        assert_finite(model)


def test_skip_counts_and_goes_on():
    rng = np.random.default_rng(4)
    model = model_of(RowWiseAdagrad(learning_rate=0.1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = make_train_step(bce, on_nonfinite="skip")
    step(model, optimizer, *batch_of(rng))
    step.check()
    before = snapshot(model, optimizer)
    step(model, optimizer, *batch_of(rng, nan_dense=True))
    step.check()  # skip never raises
    assert_unchanged(before, model, optimizer)
    for _ in range(2):
        step(model, optimizer, *batch_of(rng))
    assert step.stats() == {"steps": 4, "nonfinite_steps": 1, "ids_corrected": 0, "nonfinite_rows": 0}
    assert_finite(model)


def test_ignore_applies_the_nan():
    rng = np.random.default_rng(5)
    model = model_of(RowWiseAdagrad(learning_rate=0.1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = make_train_step(bce, on_nonfinite="ignore")
    step(model, optimizer, *batch_of(rng, nan_dense=True))
    step.check()  # ignore never checks: the NaN reaches the parameters
    dense = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert any(not np.isfinite(np.asarray(x)).all() for x in dense)


def test_huge_learning_rate_stops_with_finite_model():
    rng = np.random.default_rng(6)
    model = model_of(RowWiseAdagrad(learning_rate=1e25))
    optimizer = nnx.Optimizer(model, optax.sgd(1e25), wrt=nnx.Param)
    step = make_train_step(bce)
    with pytest.raises(NonFiniteError):
        for _ in range(20):
            step(model, optimizer, *batch_of(rng))
        step.check()
    assert_finite(model)


def scaled_bce(model, dense, kjt, labels):
    return 1e6 * bce(model, dense, kjt, labels)  # finite, with gradients far above 1


def test_an_overflowing_dense_update_is_skipped():
    """Plain tables: every update comes after the check (fused ones update in the backward)."""
    rng = np.random.default_rng(9)
    model = model_of(None)
    optimizer = nnx.Optimizer(model, optax.sgd(1e38), wrt=nnx.Param)  # rate x gradient > max float
    step = make_train_step(scaled_bce)
    before = snapshot(model, optimizer)
    step(model, optimizer, *batch_of(rng))
    with pytest.raises(NonFiniteError, match="train step 0: the loss, a gradient or an updated "
                                             "dense value is not finite"):
        step.check()
    assert_unchanged(before, model, optimizer)


def dense_snapshot(model, optimizer):
    return [np.array(x) for x in jax.tree.leaves((nnx.state(model, nnx.Param), optimizer.opt_state))
            if hasattr(x, "shape")]


@pytest.mark.parametrize("platform", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("tt", [False, True])
def test_an_overflowing_fused_table_update_is_kept_and_the_step_raises(platform, tt):
    """A finite gradient times a huge rate: the kernels keep each row whose update would
    overflow (a TT table keeps its whole update), and the step raises, saying so."""
    with jax.default_device(jax.devices(platform)[0]):
        rng = np.random.default_rng(10)
        model = model_of(optim.SGD(learning_rate=1e38), tt=tt)
        optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
        step = make_train_step(scaled_bce)
        dense_before = dense_snapshot(model, optimizer)
        step(model, optimizer, *batch_of(rng))
        with pytest.raises(NonFiniteError, match=r"train step 0: the update of \d+ fused table "
                                                 r"row\(s\) would not have been finite") as err:
            step.check()
        assert err.value.step == 0
        assert_finite(model)
        for b, a in zip(dense_before, dense_snapshot(model, optimizer), strict=True):
            np.testing.assert_array_equal(a, b)


def test_under_skip_overflowing_rows_are_counted_and_training_goes_on():
    rng = np.random.default_rng(12)
    model = model_of(optim.SGD(learning_rate=1e38))
    optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
    step = make_train_step(scaled_bce, on_nonfinite="skip")
    for _ in range(3):
        step(model, optimizer, *batch_of(rng))
    stats = step.stats()
    assert stats["steps"] == 3 and stats["nonfinite_steps"] == 3
    assert stats["nonfinite_rows"] >= 3  # every step touches rows, and every row overflows
    assert_finite(model)


def test_warning_corrections_are_counted():
    rng = np.random.default_rng(7)
    model = model_of(RowWiseAdagrad(learning_rate=0.1), mode="WARNING")
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = make_train_step(bce)
    step(model, optimizer, *batch_of(rng, bad_id=ROWS["user"] + 3))
    step(model, optimizer, *batch_of(rng, bad_id=-1))
    step(model, optimizer, *batch_of(rng))
    step.check()
    assert step.stats() == {"steps": 3, "nonfinite_steps": 0, "ids_corrected": 2, "nonfinite_rows": 0}


def test_functional_step_fatal_and_nan():
    """jaxrec.fused.make_functional_train_step: the pytree form keeps the donated tables usable."""
    from jaxrec.ops import TableLayout

    layout = TableLayout.from_embedding_specs([(30, 8), (11, 4)])
    tables = fused.FusedEmbeddingTables.create(layout, Adam(learning_rate=0.01),
                                               key=jax.random.key(0))
    params = {"w": jax.random.normal(jax.random.key(1), (12,))}
    dense = optax.sgd(0.1)
    rng = np.random.default_rng(8)

    def loss_fn(params, tables, indices, offsets, psw):
        acts = fused.fused_lookup(tables, indices, offsets, per_sample_weights=psw,
                                  bounds_check_mode="FATAL")
        return jnp.mean((acts @ params["w"]) ** 2)

    def batch(bad=None, nan=False):
        lengths = rng.integers(0, 4, 2 * 5)
        values = np.concatenate([rng.integers(0, 30, lengths[:5].sum()),
                                 rng.integers(0, 11, lengths[5:].sum())]).astype(np.int32)
        if bad is not None:
            values[-1] = bad
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        psw = rng.uniform(0.5, 2, values.shape[0]).astype(np.float32)
        if nan:
            psw[0] = np.nan
        return values, offsets, psw

    step = fused.make_functional_train_step(loss_fn, dense)
    opt_state = dense.init(params)
    params, opt_state, tables, _ = step(params, opt_state, tables, *batch())
    step.check()
    snap = [np.array(x) for x in jax.tree.leaves((params, opt_state, tables))]
    values, offsets, psw = batch(bad=11)  # the last id belongs to the 11-row table
    params, opt_state, tables, _ = step(params, opt_state, tables, values, offsets, psw)
    with pytest.raises(ValueError, match=r"train step 1: .*=11 is out of range for a table of 11"):
        step.check()
    for a, b in zip(snap, jax.tree.leaves((params, opt_state, tables))):
        np.testing.assert_array_equal(a, np.asarray(b))
    params, opt_state, tables, _ = step(params, opt_state, tables, *batch(nan=True))
    with pytest.raises(NonFiniteError):
        step.check()
    for a, b in zip(snap, jax.tree.leaves((params, opt_state, tables))):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert int(tables.step) == 1  # only the first step advanced the tables


def test_bad_policy_is_named():
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        make_train_step(bce, on_nonfinite="stop")


def test_monitor_counts_through_the_latch_wraparound():
    # The latch counts modulo 2**32 (int32 on the device); the host adds the differences
    # between two reads, so a long run's totals stay exact.
    from jaxrec import _step_guard
    monitor = _step_guard.StepMonitor()
    latch = lambda step, nonfinite, corrected, rows: jnp.asarray(
        [step, 0, 0, nonfinite, corrected, rows], jnp.int32)
    monitor.issued((), latch(1, 1, 2**31 - 5, 2**31 - 1), [])
    assert monitor.stats() == {"steps": 1, "nonfinite_steps": 1, "ids_corrected": 2**31 - 5,
                               "nonfinite_rows": 2**31 - 1}
    monitor.issued((), latch(2, 1, -2**31 + 4, -2**31), [])  # 9 more ids: the counter wrapped
    monitor.issued((), latch(3, 2, -2**31 + 4, -2**31 + 2), [])
    assert monitor.stats() == {"steps": 3, "nonfinite_steps": 2, "ids_corrected": 2**31 + 4,
                               "nonfinite_rows": 2**31 + 2}


@pytest.mark.parametrize("donate", [True, False])
def test_the_latch_keeps_one_buffer_and_its_counts(donate):
    # The steps donate the latch whatever `donate` says: a new buffer every step makes XLA
    # re-record each command buffer (CUDA graph) that reads or writes it (_step_guard).
    rng = np.random.default_rng(5)
    model = model_of(RowWiseAdagrad(learning_rate=0.1))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = make_train_step(bce, donate=donate, on_nonfinite="skip")
    step(model, optimizer, *batch_of(rng))
    pointer = step._monitor.latch().unsafe_buffer_pointer()
    for i in range(20):  # past a read (every 16th step) of a copy of the latch
        step(model, optimizer, *batch_of(rng, nan_dense=i in (3, 17)))
        assert step._monitor.latch().unsafe_buffer_pointer() == pointer
    assert step.stats() == {"steps": 21, "nonfinite_steps": 2, "ids_corrected": 0,
                            "nonfinite_rows": 0}


def test_the_copies_read_on_the_host_reuse_one_buffer():
    # A new array every 16th step moved the step's temporary buffer now and then, and XLA
    # re-recorded a command buffer for it (StepMonitor).
    rng = np.random.default_rng(6)
    model = model_of(RowWiseAdagrad(learning_rate=0.1))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = make_train_step(bce, on_nonfinite="skip")
    copies = set()
    for i in range(64):
        jax.block_until_ready(nnx.state(model))  # each copy is read before the next is taken
        step(model, optimizer, *batch_of(rng, nan_dense=i in (20, 40)))
        if step._monitor._copying:
            copies.add(step._monitor._copying[-1].latch.unsafe_buffer_pointer())
    assert len(copies) == 1  # every copy in the first one's buffer
    assert step.stats()["nonfinite_steps"] == 2


def test_a_latch_lost_with_a_failed_step_is_replaced():
    # A step that fails after donating its latch raises to the caller; the monitor then
    # neither reads the deleted latch nor hands it to the next step.
    from jaxrec import _step_guard
    monitor = _step_guard.StepMonitor()
    monitor.issued((), jnp.asarray([0, 0, 0, 1, 2, 0], jnp.int32), [])
    assert monitor.stats()["nonfinite_steps"] == 1
    lost = jnp.asarray([1, 0, 0, 1, 2, 0], jnp.int32)
    monitor.issued((), lost, [])
    lost.delete()
    monitor.check()
    fresh = monitor.latch()
    np.testing.assert_array_equal(fresh, [2, 0, 0, 1, 2, 0])  # the counts last read


def test_the_finiteness_checks_reduce_the_small_leaves_once():
    """XLA's simplifier splits the reduction of a concatenation into one per operand (a
    kernel each on the GPU, launched every step); the barrier of the GPU's form keeps it
    whole (compiled here for the CPU: the simplifier is the same). The CPU's form joins the
    small leaves the same way (a reduction is a function to compile) and reduces each
    large one alone."""
    from jaxrec._step_guard import _finite_joined, _finite_per_leaf
    leaves = [jnp.ones(shape) for shape in [(64, 48), (7,), (), (3, 5, 2), *[(33, 17)] * 8]]
    for form, extra, most in [(_finite_joined, [], 2), (_finite_per_leaf, [jnp.ones((300, 250))] * 3, 5)]:
        hlo = jax.jit(form).lower(*leaves, *extra).compile().as_text()
        reductions = re.findall(r"\n\s*(?:ROOT )?\S+ = \S+ reduce\(", hlo)
        assert 1 <= len(reductions) <= most, f"{form.__name__}: {len(reductions)} reductions"


@pytest.mark.parametrize("form", ["all_finite", "_finite_joined", "_finite_per_leaf"])
def test_the_finiteness_check_finds_a_nan_or_inf_in_any_leaf(form):
    from jaxrec import _step_guard
    check = jax.jit(lambda leaves: (getattr(_step_guard, form)(leaves) if form == "all_finite"
                                    else getattr(_step_guard, form)(*leaves)))
    rng = np.random.default_rng(3)
    leaves = [jnp.asarray(rng.normal(size=shape).astype(dtype)) for shape, dtype in
              [((64, 48), np.float32), ((7,), jnp.bfloat16), ((), np.float32),
               ((3, 5, 2), np.float16), *[((33, 17), np.float32)] * 4,
               ((300, 250), np.float32), ((260, 260), jnp.bfloat16)]]  # past _SMALL_LEAF
    leaves[0] = jnp.sign(leaves[0]) * 3e38  # large finite values: no sum may overflow into a false alarm
    assert bool(check(leaves))
    for i, leaf in enumerate(leaves):
        for value in (np.nan, np.inf, -np.inf):
            bad = list(leaves)
            flat = leaf.reshape(-1)
            bad[i] = flat.at[int(rng.integers(leaf.size))].set(value).reshape(leaf.shape)
            assert not bool(check(bad)), (i, value)
    if form == "all_finite":
        assert bool(check([jnp.arange(3), jnp.zeros((0, 4))]))  # no float values to check
