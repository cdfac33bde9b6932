"""Seeded fuzz of the modules in every bounds-check mode: EmbeddingBagCollection (plain and
fused tables, a table shared by two features, SUM and MEAN) on KeyedJaggedTensors with bad
ids (negative, == rows, huge), empty bags and per-sample weights. The oracle is a float64
NumPy loop over the bags with the documented correction: WARNING/IGNORE make a bad id row
0, NONE drops it (MEAN still divides by the bag's length), FATAL raises. A fused train
step under WARNING/IGNORE/NONE writes only rows its (corrected) ids name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig, make_train_step
from jaxrec.optim import SGD
from jaxrec.sparse import KeyedJaggedTensor

TABLES = [
    EmbeddingBagConfig(name="t_user", num_embeddings=29, embedding_dim=8, feature_names=["user"]),
    EmbeddingBagConfig(name="t_item", num_embeddings=17, embedding_dim=4, feature_names=["item", "last_item"],
                       pooling="MEAN"),
    EmbeddingBagConfig(name="t_geo", num_embeddings=5, embedding_dim=4, feature_names=["geo"]),
]
TABLE_OF = {f: t for t in TABLES for f in t.feature_names}
KEYS = ["user", "item", "last_item", "geo"]
B = 7
MODES = ["FATAL", "WARNING", "IGNORE", "NONE"]


def fuzz_batch(rng, weighted):
    """Bags of 0-5 ids, about one in five bad, as host arrays and as a KJT."""
    lengths = rng.integers(0, 6, size=len(KEYS) * B)
    values = []
    for i, key in enumerate(KEYS):
        rows = TABLE_OF[key].num_embeddings
        ids = rng.integers(0, rows, lengths[i * B:(i + 1) * B].sum())
        bad = rng.random(ids.shape) < 0.2
        ids[bad] = rng.choice([-1, -7, rows, rows + 3, 10**6], bad.sum())
        values.append(ids)
    values = np.concatenate(values).astype(np.int32)
    weights = rng.uniform(-2, 2, values.shape).astype(np.float32) if weighted else None
    kjt = KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths, weights=weights, capacity=160)
    return lengths, values, weights, kjt


def oracle(tables, lengths, values, weights, mode):
    """{feature: [B, dim] float64} as the documented correction defines it."""
    out, start = {}, 0
    for i, key in enumerate(KEYS):
        table = TABLE_OF[key]
        rows = np.asarray(tables[table.name], np.float64)
        pooled = np.zeros((B, table.embedding_dim))
        for b in range(B):
            n = lengths[i * B + b]
            for p in range(start, start + n):
                row = values[p]
                if not 0 <= row < table.num_embeddings:
                    if mode == "NONE":
                        continue
                    row = 0
                pooled[b] += (1.0 if weights is None else weights[p]) * rows[row]
            if getattr(table.pooling, "name", table.pooling) == "MEAN" and n:
                pooled[b] /= n
            start += n
        out[key] = pooled
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_ebc_fuzz_every_mode(platform, mode, fused):
    ebc = EmbeddingBagCollection(TABLES, optimizer=SGD(learning_rate=0.1) if fused else None,
                                 bounds_check_mode=mode, rngs=nnx.Rngs(0))
    tables = {k: np.asarray(v) for k, v in ebc.split_embedding_weights().items()}
    rng = np.random.default_rng(11)
    raised = 0
    for trial in range(6):
        lengths, values, weights, kjt = fuzz_batch(rng, weighted=trial % 2 == 1)
        if mode == "FATAL":
            with pytest.raises(Exception, match="out of range"):
                jax.block_until_ready(ebc(kjt).values())
            raised += 1
            continue
        got = ebc(kjt).to_dict()
        want = oracle(tables, lengths, values, weights, mode)
        for key in KEYS:
            np.testing.assert_allclose(np.asarray(got[key], np.float64), want[key], rtol=1e-5, atol=1e-5,
                                       err_msg=f"{mode} trial {trial} feature {key}")
    assert mode != "FATAL" or raised == 6


class _Model(nnx.Module):
    def __init__(self, ebc):
        self.ebc = ebc
        self.scale = nnx.Param(jnp.ones((20,)))

    def __call__(self, kjt):
        return self.ebc(kjt).values() @ self.scale[...]


@pytest.mark.parametrize("mode", ["WARNING", "IGNORE", "NONE"])
def test_fused_train_step_writes_only_the_rows_its_ids_name(platform, mode):
    model = _Model(EmbeddingBagCollection(TABLES, optimizer=SGD(learning_rate=0.5), bounds_check_mode=mode,
                                          rngs=nnx.Rngs(2)))
    optimizer = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    step = make_train_step(lambda m, kjt, y: jnp.mean((m(kjt) - y) ** 2))
    rng = np.random.default_rng(12)
    for trial in range(4):
        lengths, values, weights, kjt = fuzz_batch(rng, weighted=trial % 2 == 1)
        before = {k: np.asarray(v) for k, v in model.ebc.split_embedding_weights().items()}
        step(model, optimizer, kjt, jnp.asarray(rng.normal(size=B), jnp.float32))
        after = {k: np.asarray(v) for k, v in model.ebc.split_embedding_weights().items()}
        allowed = {t.name: set() for t in TABLES}
        start = 0
        for i, key in enumerate(KEYS):
            table = TABLE_OF[key]
            for row in values[start:start + lengths[i * B:(i + 1) * B].sum()]:
                if 0 <= row < table.num_embeddings:
                    allowed[table.name].add(int(row))
                elif mode != "NONE":
                    allowed[table.name].add(0)  # the correction's row
            start += lengths[i * B:(i + 1) * B].sum()
        for name in allowed:
            changed = set(np.flatnonzero(np.any(after[name] != before[name], axis=1)).tolist())
            assert changed <= allowed[name], (mode, trial, name, sorted(changed - allowed[name]))
            assert np.isfinite(after[name]).all()
