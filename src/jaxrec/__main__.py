"""The ``jaxrec`` command (also ``python -m jaxrec``).

    jaxrec train  trains a model end to end (the default command: DLRM on synthetic data;
                  jaxrec train --help)
    jaxrec export a trained run's model, quantized, as a serving folder (jaxrec export
                  CHECKPOINT OUT; --help)
    jaxrec launch a program as N processes joined by jax.distributed (jaxrec launch -n 2
                  --cpu-devices 4 -- python train.py; --help)
    jaxrec bench  the TBE lookup benchmark (GPU when there is one, else CPU; --help)
    jaxrec demo   a short tour: the build, a KeyedJaggedTensor, bounds checking and a
                  table-batched lookup with its gradient
    jaxrec info   what was built, as JSON
"""

from __future__ import annotations

import argparse
import json
import sys


def demo() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxrec
    from jaxrec.ops import (
        BoundsCheckMode,
        PoolingMode,
        TableLayout,
        bounds_check_indices,
        embedding_bag_lookup_kjt,
        init_weights,
    )
    from jaxrec.sparse import KeyedJaggedTensor

    info = jaxrec.build_info()
    print(f"jaxrec {jaxrec.__version__} on {jax.devices()[0].platform}: CPU kernels "
          f"{'built' if info['cpu'] else 'missing'}, CUDA kernels {'built' if info['cuda'] else 'not built'} "
          f"(FFI headers of jaxlib {info['jaxlib_headers_version']}, running jaxlib "
          f"{info['runtime_jaxlib_version']})\n")

    print("A batch of 3 samples with two sparse features:")
    print('  #              0        1      2   <-- batch')
    print('  # "user"       [3, 7]   []     [1]')
    print('  # "item"       [2]      [9]    [4, 4, 0]')
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["user", "item"], [3, 7, 1, 2, 9, 4, 4, 0], [2, 0, 1, 1, 1, 3], capacity=16)
    print(f"  offsets {np.asarray(kjt.offsets()).tolist()}, length per key "
          f"{np.asarray(kjt.length_per_key()).tolist()}, capacity {kjt.values().shape[0]} (padded)\n")

    layout = TableLayout.from_embedding_specs([(8, 4), (6, 4)])  # users: 8 rows; items: 6 rows
    offsets = kjt.offsets().astype(jnp.int32)
    checked = bounds_check_indices(layout.feature_rows, kjt.values(), offsets,
                                   BoundsCheckMode.WARNING, feature_names=kjt.keys())
    print(f"Bounds check (WARNING): item id 9 is past its 6-row table -> corrected "
          f"{int(checked.num_corrected)} id(s) to row 0: {np.asarray(checked.indices).tolist()}\n")

    weights = init_weights(jax.random.key(0), layout)

    @jax.jit
    def loss(weights, features):
        pooled = embedding_bag_lookup_kjt(weights, features, layout=layout,
                                          pooling=PoolingMode.SUM, bounds_check_mode="IGNORE")
        return jnp.sum(pooled.values() ** 2), pooled

    (value, pooled), grads = jax.value_and_grad(loss, has_aux=True)(weights, kjt)
    print(f"Pooled embeddings (KeyedTensor {pooled.keys()}, shape {tuple(pooled.values().shape)}):")
    print(np.array2string(np.asarray(pooled.values()), precision=3, suppress_small=True))
    touched = np.flatnonzero(np.abs(np.asarray(grads).reshape(-1, 4)).sum(1))
    print(f"\nloss {float(value):.4f}; the dense gradient touches flat rows {touched.tolist()} "
          "(user rows 1, 3, 7 and item rows 0, 2, 4 + 8)")


COMMANDS = ("train", "export", "launch", "bench", "demo", "info")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="jaxrec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="train", choices=COMMANDS)
    # The sub-command parses its own arguments, --help included; options without a
    # command go to the default command (`jaxrec --steps 100` trains).
    if argv and argv[0] in COMMANDS:
        command, rest = argv[0], argv[1:]
    elif argv and (argv[0] in ("-h", "--help") or not argv[0].startswith("-")):
        parser.parse_args(argv[:1])  # prints the help, or names the unknown command; exits
        return 2
    else:
        command, rest = "train", argv
    if command == "train":
        from jaxrec.train import main as train_main

        return train_main(rest)
    if command == "export":
        from jaxrec.serving._command import main as export_main

        return export_main(rest)
    if command == "launch":
        from jaxrec.parallel._multiprocess import main as launch_main

        return launch_main(rest)
    if command == "bench":
        from jaxrec.benchmark import main as bench_main

        return bench_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if command == "info":
        from jaxrec import build_info

        print(json.dumps(build_info(), indent=2))
    else:
        demo()
    return 0


if __name__ == "__main__":
    sys.exit(main())
