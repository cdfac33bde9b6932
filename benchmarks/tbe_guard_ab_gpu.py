"""What NONE's memory guard costs the GPU lookup: the guarded CUDA forward against the
forward as it was before bad ids were guarded, in one process, call by call.

    git apply benchmarks/patches/unguarded_forward.patch   # adds the unguarded kernel
    JAXREC_CUDA=ON pip install --no-build-isolation --no-deps .
    python benchmarks/tbe_guard_ab_gpu.py --out benchmarks/results/tbe_guard_ab_<device>.json
    git apply -R benchmarks/patches/unguarded_forward.patch

The patch is for measuring only (the unguarded kernel reads outside a table on a bad
id); with it applied, ``JAXREC_UNGUARDED_FORWARD=1`` makes each call of the lookup run the
unguarded kernel. The two run interleaved (the same compiled lookup, the variable set
before each call), on valid ids, and must agree bit for bit. Reported: milliseconds per
lookup and guarded / unguarded (1.0 = no cost).
"""

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Plain launches: the FFI handler picks its kernel on every call.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrec.benchmark._environment import environment, nvidia_driver  # noqa: E402
from jaxrec.benchmark._measure import NUM_ID_SETS, interleaved_timed  # noqa: E402
from jaxrec.benchmark._report import write_json  # noqa: E402
from jaxrec.benchmark._tbe_gpu import CRITEO_ROWS, fixed_bag_case  # noqa: E402
from jaxrec.ops import TableLayout, embedding_bag_lookup, init_weights  # noqa: E402

BIG = dict(T=32, E=1_000_000, D=128, B=4096, L=20)


def compare(name, layout, arg_sets, record):
    lookup = jax.jit(lambda w, i, o: embedding_bag_lookup(w, i, o, layout=layout, bounds_check_mode="NONE"))

    def variant(unguarded):
        def call(args):
            os.environ["JAXREC_UNGUARDED_FORWARD"] = "1" if unguarded else "0"
            return lookup(*args)
        return call

    guarded, unguarded = variant(False), variant(True)
    for args in arg_sets:  # compiles (jagged id sets differ in length) and checks
        got, want = jax.block_until_ready(guarded(args)), jax.block_until_ready(unguarded(args))
        if not np.array_equal(np.asarray(got), np.asarray(want)):
            raise SystemExit(f"{name}: guarded and unguarded lookups differ; is the patch applied?")
    (t_guarded, t_unguarded), _ = interleaved_timed([(guarded, arg_sets), (unguarded, arg_sets)],
                                                    50, 21, jax.block_until_ready)
    record(dict(case=name, ms={"guarded": t_guarded * 1e3, "unguarded": t_unguarded * 1e3},
                guarded_over_unguarded=t_guarded / t_unguarded))


def fixed(rng, name, cfg, record, dtype=jnp.float32, dist="uniform"):
    layout, weights, sets = fixed_bag_case(rng, cfg, dtype, dist)
    offsets = jnp.arange(0, cfg["T"] * cfg["B"] * cfg["L"] + 1, cfg["L"], dtype=jnp.int32)
    compare(name, layout, [(weights, jnp.asarray(s.reshape(-1)), offsets) for s in sets], record)


def jagged(rng, name, rows, dims, batch, max_len, record):
    layout = TableLayout.from_embedding_specs(list(zip(rows, dims)))
    weights = init_weights(jax.random.key(1), layout)
    arg_sets = []
    for _ in range(NUM_ID_SETS):
        lengths = rng.integers(0, max_len + 1, size=(len(rows), batch))
        ids = [rng.integers(0, r, size=int(n.sum())).astype(np.int32) for r, n in zip(rows, lengths)]
        offsets = np.concatenate([[0], np.cumsum(lengths.reshape(-1))]).astype(np.int32)
        arg_sets.append((weights, jnp.asarray(np.concatenate(ids)), jnp.asarray(offsets)))
    compare(name, layout, arg_sets, record)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args(argv)
    if not jaxrec_cuda():
        raise SystemExit("needs jaxrec's CUDA library and a GPU")
    info = dict(environment("tbe_guard_ab_gpu", jax.devices()[0].device_kind, {}, {}),
                driver=nvidia_driver(), results=[])

    def record(row):
        info["results"].append(row)
        print(f"{row['case']:24s} guarded {row['ms']['guarded']:.4f} ms, unguarded "
              f"{row['ms']['unguarded']:.4f} ms: x{row['guarded_over_unguarded']:.3f}", flush=True)
        if args.out:
            write_json(args.out, info)

    rng = np.random.default_rng(0)
    fixed(rng, "fbgemm_default", dict(T=32, E=100_000, D=128, B=512, L=20), record)
    fixed(rng, "T32_E1e6_B4096", BIG, record)
    fixed(rng, "T32_E1e6_B4096_zipf", BIG, record, dist="zipf")
    fixed(rng, "T32_E1e6_B4096_bf16", BIG, record, dtype=jnp.bfloat16)
    fixed(rng, "T32_E1e6_B4096_fp16", BIG, record, dtype=jnp.float16)
    fixed(rng, "T32_E1e6_D16_L8", dict(T=32, E=1_000_000, D=16, B=4096, L=8), record)
    fixed(rng, "T64_E1e6_D64_L1", dict(T=64, E=1_000_000, D=64, B=4096, L=1), record)
    jagged(rng, "criteo_26_mixed_dims", [min(r, 2_000_000) for r in CRITEO_ROWS],
           [(16, 32, 64, 128, 256)[i % 5] for i in range(26)], 4096, 40, record)
    jagged(rng, "jagged_T32_E1e6_D128", [1_000_000] * 32, [128] * 32, 4096, 40, record)
    return 0


def jaxrec_cuda() -> bool:
    import jaxrec
    return bool(jaxrec.build_info().get("cuda")) and jax.default_backend() == "gpu"


if __name__ == "__main__":
    sys.exit(main())
