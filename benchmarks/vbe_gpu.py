"""Variable batch per feature (VBE) on a user-tower shape: a batch of impressions where
each user's features repeat across the user's impressions, looked up once per user (VBE)
against the same batch expanded by hand (every impression carries its user's ids).

    python benchmarks/vbe_gpu.py --out benchmarks/results/vbe_gpu_<device>_<date>.json [--quick]

Shape: B impressions of U distinct users (B/U impressions each); user features: T_u
tables of E rows, L ids a bag (the user's history); item features: T_i tables, one id
a bag; D=128, fp32. Both inputs go through one ``EmbeddingBagCollection`` (fused rowwise
Adagrad), timed as the forward and as a train step (``make_train_step``, donated), in one
process, median of 5 repeats of back-to-back calls, 4 id sets rotating. The outputs of the
two inputs are checked equal first.
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrec.benchmark._environment import environment
from jaxrec.benchmark._measure import timed
from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig, make_train_step
from jaxrec.optim import RowWiseAdagrad
from jaxrec.sparse import KeyedJaggedTensor

SHAPE = dict(B=8192, U=512, T_u=8, T_i=4, E=1_000_000, D=128, L=20)
QUICK = dict(B=64, U=8, T_u=2, T_i=2, E=1000, D=16, L=5)


def batches(rng, s, sets=4):
    """[(vbe, expanded)] KJT pairs."""
    user_keys = [f"u{k}" for k in range(s["T_u"])]
    item_keys = [f"i{k}" for k in range(s["T_i"])]
    keys = user_keys + item_keys
    out = []
    for _ in range(sets):
        user_of = np.sort(rng.integers(0, s["U"], size=s["B"]))  # impressions grouped by user
        user_of[: s["U"]] = np.arange(s["U"])
        user_of.sort()
        user_ids = [rng.integers(0, s["E"], size=(s["U"], s["L"])) for _ in user_keys]
        item_ids = [rng.integers(0, s["E"], size=s["B"]) for _ in item_keys]
        vbe_values = np.concatenate([u.ravel() for u in user_ids] + item_ids).astype(np.int32)
        items = [np.ones(s["B"], int)] * len(item_keys)
        vbe_lengths = np.concatenate([np.full(s["U"], s["L"])] * len(user_keys) + items)
        inverse = np.stack([user_of] * len(user_keys) + [np.arange(s["B"])] * len(item_keys)).astype(np.int32)
        vbe = KeyedJaggedTensor(keys, vbe_values, lengths=vbe_lengths, capacity=vbe_values.size,
                                stride_per_key_per_rank=[[s["U"]]] * len(user_keys) + [[s["B"]]] * len(item_keys),
                                inverse_indices=(keys, inverse))
        full_values = np.concatenate([u[user_of].ravel() for u in user_ids] + item_ids).astype(np.int32)
        full_lengths = np.concatenate([np.full(s["B"], s["L"])] * len(user_keys) + items)
        full = KeyedJaggedTensor(keys, full_values, lengths=full_lengths, stride=s["B"], capacity=full_values.size)
        out.append((vbe, full))
    return keys, user_keys, item_keys, out


def timed_ms(call, iters):
    """Milliseconds per ``call(k)``, k rotating over the 4 id sets (jaxrec.benchmark's timing)."""
    return timed(call, [(k,) for k in range(4)], iters, jax.block_until_ready) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="a small shape (smoke test, any device)")
    args = parser.parse_args()
    s = QUICK if args.quick else SHAPE
    keys, user_keys, item_keys, pairs = batches(np.random.default_rng(0), s)
    tables = [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=s["E"], embedding_dim=s["D"], feature_names=[k])
              for k in keys]
    ms = {}
    model = EmbeddingBagCollection(tables, optimizer=RowWiseAdagrad(learning_rate=0.01), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)  # split once: the forward timed is the lookup, not the graph walk
    forward = jax.jit(lambda state, kjt: nnx.merge(graphdef, state)(kjt).values())
    np.testing.assert_allclose(forward(state, pairs[0][0]), forward(state, pairs[0][1]), rtol=1e-5, atol=1e-5)
    for which, name in ((0, "vbe"), (1, "expanded")):
        ms[f"forward_{name}"] = timed_ms(lambda k, w=which, st=state: forward(st, pairs[k][w]), 50)
    del model, state

    def loss_fn(model, kjt):
        return jnp.mean(model(kjt).values() ** 2)

    for which, name in ((0, "vbe"), (1, "expanded")):
        model = EmbeddingBagCollection(tables, optimizer=RowWiseAdagrad(learning_rate=0.01), rngs=nnx.Rngs(0))
        dense = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
        step = make_train_step(loss_fn)
        ms[f"step_{name}"] = timed_ms(lambda k, w=which, m=model, d=dense, st=step: st(m, d, pairs[k][w]), 20)
        del model, dense
    ids = {name: int(sum(int(np.asarray(p[w].lengths()).sum()) for p in pairs) / len(pairs))
           for w, name in ((0, "vbe"), (1, "expanded"))}
    result = dict(environment("vbe_gpu", jax.devices()[0].device_kind, {}, {}), shape=s, ids_per_batch=ids, ms=ms,
                  speedup_of_vbe={"forward": ms["forward_expanded"] / ms["forward_vbe"],
                                  "step": ms["step_expanded"] / ms["step_vbe"]},
                  method="median of 5 repeats of back-to-back calls (forward 50, step 20), 4 id sets; "
                  "fused rowwise Adagrad; outputs of the two inputs checked equal")
    print(json.dumps({k: result[k] for k in ("ids_per_batch", "ms", "speedup_of_vbe")}, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
