"""What the lookup's bounds check costs on the GPU, as users call it, side by side in one
process with the unchecked lookup and plain XLA:

    python benchmarks/bounds_check_gpu.py --out benchmarks/results/bounds_check_gpu_<device>_<date>.json [--quick]

Two shapes of issue 20 (fp32, D=128, L=20 uniform ids with duplicates): FBGEMM's
benchmark default (T=32, E=1e5, B=512) and T=32, E=1e6, B=4096. For each: the forward
(``embedding_bag_lookup``) in every bounds-check mode and XLA's ``jnp.take`` + sum, and
a training step (``fused_lookup`` with rowwise Adagrad, a dense layer by optax, donated)
under the default mode and NONE, on tables of at most 1e5 rows (the step of a 16 GB table
does not fit an H100 beside its forward's tables). The peers of a shape run in interleaved
rounds (the forwards together, then the two steps), 50 (step: 20) back-to-back calls each a
round, rotating among 4 id sets; the median of 11 rounds after a warm-up. At FBGEMM's
default shape a call is about 70 µs, so rounds that are not interleaved drift by more than
the differences measured.
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrec.benchmark._environment import environment
from jaxrec.benchmark._measure import interleaved_by_name
from jaxrec.fused import FusedEmbeddingTables, fused_lookup, make_functional_train_step
from jaxrec.ops import TableLayout, embedding_bag_lookup, init_weights
from jaxrec.optim import RowWiseAdagrad

SHAPES = {"fbgemm_default": dict(T=32, E=10**5, D=128, B=512, L=20),
          "T32_E1e6_B4096": dict(T=32, E=10**6, D=128, B=4096, L=20)}
QUICK_SHAPES = {"quick": dict(T=4, E=1000, D=16, B=64, L=5)}  # a smoke test, on any device
MODES = ("WARNING", "IGNORE", "FATAL", "NONE")
STEP_ROWS = 10**5
ROUNDS = 11


def timed(calls, iters):
    """{name: median seconds per ``call(k)``}, k rotating over the 4 id sets, the calls in
    interleaved rounds after a warm-up (jaxrec.benchmark's timing)."""
    return interleaved_by_name({name: (call, range(4)) for name, call in calls.items()}, iters, ROUNDS,
                               jax.block_until_ready)


def measure(shape):
    t, e, d, b, l = (shape[k] for k in "TEDBL")
    layout = TableLayout.from_embedding_specs([(e, d)] * t)
    weights = init_weights(jax.random.key(0), layout, jnp.float32)
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, e, size=(t, b, l)).astype(np.int32) for _ in range(4)]
    flat = [jnp.asarray(i.reshape(-1)) for i in ids]
    grouped = [jnp.asarray(i) for i in ids]
    offsets = jnp.arange(0, t * b * l + 1, l, dtype=jnp.int32)
    forwards = {}
    for mode in MODES:
        lookup = jax.jit(lambda w, i, mode=mode: embedding_bag_lookup(w, i, offsets, layout=layout,
                                                                      bounds_check_mode=mode))
        forwards[f"forward_{mode}"] = lambda k, f=lookup, w=weights: f(w, flat[k % 4])

    def xla_take_sum(w, i):
        pooled = jax.vmap(lambda table, x: jnp.take(table, x, axis=0).sum(1))(w.reshape(t, e, d), i)
        return pooled.transpose(1, 0, 2).reshape(b, t * d)

    xla = jax.jit(xla_take_sum)
    forwards["forward_xla_take_sum"] = lambda k, w=weights: xla(w, grouped[k % 4])
    np.testing.assert_allclose(embedding_bag_lookup(weights, flat[0], offsets, layout=layout), xla(weights, grouped[0]),
                               rtol=1e-5, atol=1e-5)
    ms = {name: s * 1e3 for name, s in timed(forwards, 50).items()}

    dense = optax.sgd(0.01)
    v0 = jax.random.normal(jax.random.key(1), (t * d, 1)) / np.sqrt(t * d)
    del weights, forwards
    step_e = min(e, STEP_ROWS)
    step_layout = TableLayout.from_embedding_specs([(step_e, d)] * t)
    step_ids = [jnp.asarray((i % step_e).reshape(-1)) for i in ids]
    steps = {}
    for mode in ("WARNING", "NONE"):
        def loss_fn(v, tables, i, mode=mode):
            acts = fused_lookup(tables, i, offsets, bounds_check_mode=mode)
            return jnp.mean((acts @ v) ** 2)

        step = make_functional_train_step(loss_fn, dense)
        v = jnp.copy(v0)  # donated
        carry = [v, dense.init(v), FusedEmbeddingTables.create(
            step_layout, RowWiseAdagrad(learning_rate=0.01),
            weights=init_weights(jax.random.key(0), step_layout, jnp.float32))]

        def call(k, carry=carry, step=step):
            carry[:] = step(*carry, step_ids[k % 4])[:3]
            return carry[2].weights

        steps[f"step_{mode}"] = call
    ms.update({name: s * 1e3 for name, s in timed(steps, 20).items()})
    ratios = {"forward_WARNING / forward_NONE": ms["forward_NONE"] / ms["forward_WARNING"],
              "forward_WARNING / xla_take_sum": ms["forward_xla_take_sum"] / ms["forward_WARNING"],
              "step_WARNING / step_NONE": ms["step_NONE"] / ms["step_WARNING"]}
    return dict(shape, step_rows=step_e, ms=ms, speed_ratios=ratios)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="one small shape (smoke test)")
    args = parser.parse_args()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    result = dict(environment("bounds_check_gpu", jax.devices()[0].device_kind, {}, {}),
                  method="median of 11 interleaved rounds of back-to-back calls; speed ratios > 1: the first "
                  "is faster (WARNING is the default mode)",
                  results={name: measure(shape) for name, shape in shapes.items()})
    print(json.dumps(result["results"], indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
