"""Configs, traced hyperparameters, state layout and input validation of jaxrec.optim."""

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optim_testing import (
    LAYOUT,
    jitted_update,
    make,
    merged_grads,
    random_batch,
    random_tables,
    sparse_grad,
    to_jax,
)

from jaxrec import fused, optim
from jaxrec.ops import TableLayout


@pytest.mark.parametrize("cls", [optim.RowWiseAdagrad, optim.Adam])
def test_learning_rate_is_traced_one_compile(cls):
    config = make(cls)
    rng = np.random.default_rng(1)
    weights, state = to_jax(config, *random_tables(config, rng), step=1)
    grad = sparse_grad(random_batch(rng))
    traces = []

    @jax.jit
    def step(weights, state, grad, hparams):
        traces.append(1)
        return fused.fused_update_reference(weights, state, grad, layout=LAYOUT, config=config,
                                            hparams=hparams)

    hparams = config.hyperparams()
    results = [step(weights, state, grad, hparams._replace(learning_rate=jnp.float32(lr))) for lr in (0.01, 0.3)]
    other = step(weights, state, grad, hparams._replace(momentum=jnp.float32(0.5),
                                                        beta1=jnp.float32(0.5)))
    assert len(traces) == 1 and step._cache_size() == 1
    assert not np.allclose(results[0][0], results[1][0])
    # Each equals the update of a config that holds those numbers as its defaults.
    changed = {k: 0.5 for k in ("momentum", "beta1") if hasattr(config, k)}
    for got, numbers in zip(results + [other], [{"learning_rate": 0.01}, {"learning_rate": 0.3}, changed]):
        c = dataclasses.replace(config, **numbers)
        want = jitted_update(c)(weights, state, grad, c.hyperparams())
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, want)


def test_hyperparams_carry_the_config_numbers():
    config = optim.LarsSGD(learning_rate=0.2, eta=0.03, momentum=0.4, weight_decay=0.01,
                           max_gradient=2.5, max_norm=3.0)
    hp = config.hyperparams()
    assert isinstance(hp, optim.OptimizerHyperparams)
    assert all(x.dtype == jnp.float32 and x.shape == () for x in hp)
    got = {k: float(v) for k, v in hp._asdict().items()}
    assert got == pytest.approx(dict(learning_rate=0.2, eps=0.0, beta1=0.0, beta2=0.0,
                                     weight_decay=0.01, momentum=0.4, eta=0.03, max_gradient=2.5,
                                     max_norm=3.0))
    assert all(float(x) == 0.0 for x in optim.NoOptimizer().hyperparams())


def test_configs_are_hashable_and_keep_fbgemm_defaults():
    assert {optim.RowWiseAdagrad(), optim.RowWiseAdagrad()} == {optim.RowWiseAdagrad()}
    c = optim.Adam()
    assert (c.learning_rate, c.eps, c.beta1, c.beta2, c.weight_decay) == (0.01, 1e-8, 0.9, 0.999, 0.0)
    assert (c.gradient_clipping, c.max_gradient, c.max_norm) == (False, 1.0, 0.0)
    assert c.state_dtype == jnp.float32
    assert [cls.fbgemm_name for cls in optim.ALL_OPTIMIZERS] == [
        "EXACT_SGD", "EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD", "ADAM", "PARTIAL_ROWWISE_ADAM",
        "LAMB", "PARTIAL_ROWWISE_LAMB", "LARS_SGD", "NONE"]


@pytest.mark.parametrize("spelling, mode", [
    ("L2", "l2"), ("DECOUPLE", "decoupled"), ("NONE", "none"), (1, "l2"), (2, "decoupled"), (0, "none"),
    ("decoupled", "decoupled"), (enum.Enum("WeightDecayMode", {"L2": 1}).L2, "l2"),
])
def test_weight_decay_mode_accepts_fbgemm_spellings(spelling, mode):
    config = optim.RowWiseAdagrad(weight_decay=0.1, weight_decay_mode=spelling)
    assert config.weight_decay_mode == mode
    assert config == optim.RowWiseAdagrad(weight_decay=0.1, weight_decay_mode=mode)  # one compiled program


@pytest.mark.parametrize("build, error, match", [
    (lambda: optim.RowWiseAdagrad(weight_decay_mode="l1"), ValueError, "weight_decay_mode"),
    (lambda: optim.RowWiseAdagrad(weight_decay_mode="COWCLIP"), ValueError, "COWCLIP .* not supported"),
    (lambda: optim.RowWiseAdagrad(weight_decay_mode=3), ValueError, "weight_decay_mode"),
    (lambda: optim.Adam(beta1=1.0), ValueError, "beta1"),
    (lambda: optim.SGD(learning_rate=-0.1), ValueError, "learning_rate"),
    (lambda: optim.SGD(max_gradient=0.0), ValueError, "max_gradient"),
    (lambda: optim.Adagrad(eps=float("nan")), ValueError, "finite"),
    (lambda: optim.Adagrad(state_dtype=jnp.int32), TypeError, "state_dtype"),
    (lambda: optim.Adagrad(0.1), TypeError, "positional"),
])
def test_bad_configs_raise(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_traced_number_in_config_points_to_hyperparams():
    @jax.jit
    def f(lr):
        return optim.SGD(learning_rate=lr).hyperparams().learning_rate

    with pytest.raises(TypeError, match="hyperparams"):
        f(0.1)


@pytest.mark.parametrize("cls", optim.ALL_OPTIMIZERS)
def test_init_state_shapes_and_dtypes(cls):
    config = cls()
    state = optim.init_state(config, LAYOUT)
    assert type(state) is cls.state_type
    assert state.step.dtype == jnp.int32 and int(state.step) == 0
    for name in state._fields[1:]:
        buf = getattr(state, name)
        per_row = name in cls.state_type.row_fields
        assert buf.shape == ((sum(LAYOUT.rows),) if per_row else (LAYOUT.num_weights,))
        assert buf.dtype == jnp.float32
        assert optim._state.state_offsets(config, LAYOUT, name) == (
            LAYOUT.row_offsets if per_row else LAYOUT.table_offsets)
    half = optim.init_state(config, LAYOUT, jnp.bfloat16)
    assert all(getattr(half, n).dtype == jnp.bfloat16 for n in half._fields[1:])
    if hasattr(config, "state_dtype"):
        bf = optim.init_state(dataclasses.replace(config, state_dtype=jnp.bfloat16), LAYOUT)
        assert all(getattr(bf, n).dtype == jnp.bfloat16 for n in bf._fields[1:])


@pytest.mark.parametrize("cls", [optim.Adagrad, optim.RowWiseAdagrad, optim.PartialRowWiseAdam])
def test_split_optimizer_states_finds_each_row(cls):
    """From zero state, one step writes g² (or mean g², or (1-b2)·mean g²) at the touched rows only."""
    config = cls(learning_rate=0.1, beta2=0.5) if cls is optim.PartialRowWiseAdam else cls()
    rng = np.random.default_rng(2)
    batch = random_batch(rng)
    weights = jnp.asarray(rng.normal(size=LAYOUT.num_weights), jnp.float32)
    _, state = jitted_update(config)(weights, optim.init_state(config, LAYOUT), sparse_grad(batch),
                                     config.hyperparams())
    name = "exp_avg_sq" if cls is optim.PartialRowWiseAdam else "momentum1"
    scale = 0.5 if cls is optim.PartialRowWiseAdam else 1.0
    tables = optim.split_optimizer_states(config, LAYOUT, state)
    grads = merged_grads(batch)
    for t, table in enumerate(tables):
        got = np.asarray(table[name])
        want = np.zeros(got.shape)
        for (tt, r), g in grads.items():
            if tt == t:
                want[r] = scale * (np.mean(g * g) if got.ndim == 1 else g * g)
        assert got.shape[0] == LAYOUT.rows[t] and want.any()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
def test_tables_past_2_31_elements_split_out_whole():
    """A table that starts 2**31 elements or more into the flat buffer splits out whole,
    weights and optimizer state (an eager slice of a JAX array has int32 bounds)."""
    layout = TableLayout.from_embedding_specs([(2**24 + 3, 128), (1000, 64)])
    assert layout.table_offsets[1] >= 2**31
    tail = np.random.default_rng(5).normal(size=(1000, 64)).astype(jnp.bfloat16)
    with jax.default_device(jax.devices("cuda")[0]):
        flat = jnp.concatenate([jnp.full(layout.table_offsets[1], 0.5, jnp.bfloat16), jnp.asarray(tail).ravel()])
        first, second = layout.split_embedding_weights(flat)
        assert first.shape == (2**24 + 3, 128) and float(first[-1, -1]) == 0.5
        del first
        np.testing.assert_array_equal(np.asarray(second), tail)
        config = optim.Adagrad()
        state = optim.init_state(config, layout, jnp.bfloat16)._replace(momentum1=flat)
        tables = optim.split_optimizer_states(config, layout, state)
        np.testing.assert_array_equal(np.asarray(tables[1]["momentum1"]), tail)


def test_fused_update_rejects_bad_inputs():
    config = optim.RowWiseAdagrad()
    rng = np.random.default_rng(4)
    weights, state = to_jax(config, *random_tables(config, rng), step=0)
    grad = sparse_grad(random_batch(rng))

    def call(w=weights, s=state, g=grad, c=config):
        return fused.fused_update_reference(w, s, g, layout=LAYOUT, config=c)

    with pytest.raises(TypeError, match="RowWiseAdagradState"):
        call(s=optim.init_state(optim.Adagrad(), LAYOUT))
    with pytest.raises(ValueError, match="one per row"):
        call(s=state._replace(momentum1=jnp.ones(LAYOUT.num_weights)))
    with pytest.raises(ValueError, match="flat buffer"):
        call(w=weights[:-1])
    with pytest.raises(ValueError, match="NoOptimizer"):
        call(c=optim.NoOptimizer(), s=optim.init_state(optim.NoOptimizer(), LAYOUT))
    with pytest.raises(TypeError, match="SparseRowGrad"):
        call(g=tuple(grad))
    with pytest.raises(ValueError, match="grads"):
        call(g=grad._replace(grads=grad.grads[:, :3]))
    with pytest.raises(ValueError, match="NoOptimizer has no update"):
        optim.update_rows(optim.NoOptimizer(), config.hyperparams(), jnp.ones((1, 2)),
                          jnp.ones((1, 2)), optim.NoOptimizerState(step=jnp.int32(0)))
