"""What the host-memory tests share: their loss, their train step and the comparison of
two models' tables and optimizer state."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrec.nn import make_train_step


def loss_fn(model, features, target):
    return jnp.mean((model(features) - target) ** 2)


def trainer(model):
    return make_train_step(loss_fn), nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def assert_same_tables(got, want, exact: bool):
    check = np.testing.assert_array_equal if exact else (
        lambda a, b, err_msg="": np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=err_msg))
    w_got, w_want = got.ebc.split_embedding_weights(), want.ebc.split_embedding_weights()
    for name in w_want:
        check(np.asarray(w_got[name]), np.asarray(w_want[name]), err_msg=name)
    s_got, s_want = got.ebc.split_optimizer_states(), want.ebc.split_optimizer_states()
    for name in s_want:
        for k in s_want[name]:
            check(np.asarray(s_got[name][k]), np.asarray(s_want[name][k]), err_msg=f"{name} {k}")
