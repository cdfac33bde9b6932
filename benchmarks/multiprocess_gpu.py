"""Two processes of one GPU each against one process of two GPUs: the same sharded DLRM
steps, their losses and step times.

    python benchmarks/multiprocess_gpu.py --out benchmarks/results/multiprocess_<device>.json
    python benchmarks/multiprocess_gpu.py --cpu --out /tmp/x.json      # CPU stand-ins, to try it

Runs ``--role one`` (one process, a mesh of 2 GPUs) and then ``jaxrec.parallel.launch`` of 2
processes with ``--role two`` (one GPU each, joined by ``initialize_distributed``), each
training the same DLRM (26 tables of 100,000 rows, D=64, half TABLE_WISE and half ROW_WISE
over the 2 devices, fused rowwise Adagrad, dense Adam; one id per bag) for ``--steps``
steps on the same batches, each process feeding its own rows
(``shard_batch(process_local=True)``), at each ``--batch-per-device`` (a fresh model for
each). A step's time: ``--steps - 10`` back-to-back steps after 10 of warm-up, divided by
their count (process 0's clock). Small batches measure how fast a process issues steps
(one process issues both GPUs' work), large ones the GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROLE = sys.argv[sys.argv.index("--role") + 1] if "--role" in sys.argv else None
if "--cpu" in sys.argv and ROLE == "one":  # before JAX starts
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

TABLES, ROWS, DIM, DENSE = 26, 100_000, 64, 13
BATCHES = (2048, 16384, 65536)  # samples per device


def run(role: str, steps: int, sizes: list[int], out: str) -> None:
    import jaxrec.parallel as par

    if role == "two":
        par.initialize_distributed(timeout_s=120)
    import jax

    devices = jax.devices()[:2]
    mesh = jax.make_mesh((2,), ("data",), devices=devices)
    results = {}
    for batch in sizes:
        results[batch] = one_size(mesh, steps, batch)
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump({"role": role, "processes": jax.process_count(), "devices": [str(d) for d in devices],
                       "device_kind": devices[0].device_kind, "per_batch": results}, f)


def one_size(mesh, steps: int, batch: int) -> dict:
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import jaxrec.parallel as par
    from jaxrec.models import DLRM
    from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig, make_train_step
    from jaxrec.optim import RowWiseAdagrad
    from jaxrec.sparse import KeyedJaggedTensor

    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=ROWS, embedding_dim=DIM, feature_names=[f"f{i}"])
              for i in range(TABLES)]
    ebc = EmbeddingBagCollection(tables, optimizer=RowWiseAdagrad(learning_rate=0.05), rngs=nnx.Rngs(0))
    model = DLRM(ebc, DENSE, [128, DIM], [256, 128, 1], rngs=nnx.Rngs(1))
    plan = par.construct_plan(tables, {t.name: par.table_wise(i % 2) if i % 2 else par.row_wise()
                                       for i, t in enumerate(tables)}, 2, local_world_size=1)
    model = par.shard(model, plan, mesh)
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def loss_fn(m, batch):
        logits = m(batch["dense"], batch["sparse"])[:, 0]
        return optax.sigmoid_binary_cross_entropy(logits, batch["labels"]).mean()

    step = make_train_step(loss_fn)
    mine = [k for k, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()]

    def local_batch(i):  # this process's rows of global batch i (the same in every process)
        rng = np.random.default_rng(i)
        dense = rng.normal(size=(2 * batch, DENSE)).astype(np.float32)
        ids = rng.integers(0, ROWS, (TABLES, 2 * batch))
        labels = (rng.random(2 * batch) < 0.3).astype(np.float32)
        rows = np.concatenate([np.arange(k * batch, (k + 1) * batch) for k in mine])
        kjt = KeyedJaggedTensor.from_lengths_sync([f"f{i}" for i in range(TABLES)], ids[:, rows].reshape(-1),
                                                  np.ones(TABLES * len(rows), np.int32))
        return {"dense": dense[rows], "sparse": kjt, "labels": labels[rows]}

    batches = [par.shard_batch(local_batch(i), mesh, process_local=True) for i in range(steps)]
    losses = [float(step(model, optimizer, batches[i])) for i in range(10)]
    start = time.perf_counter()
    timed = [step(model, optimizer, batches[i]) for i in range(10, steps)]
    jax.block_until_ready(timed)
    seconds = (time.perf_counter() - start) / (steps - 10)
    losses += [float(x) for x in timed]
    return {"step_ms": seconds * 1e3, "losses": losses}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--batch-per-device", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--role", choices=("one", "two"))
    parser.add_argument("--result")
    args = parser.parse_args(argv)
    if args.role:
        run(args.role, args.steps, args.batch_per_device, args.result)
        return 0
    import jax
    import numpy as np

    import jaxrec
    import jaxrec.parallel as par

    with tempfile.TemporaryDirectory() as tmp:
        one, two = os.path.join(tmp, "one.json"), os.path.join(tmp, "two.json")
        common = [*(["--cpu"] if args.cpu else []), "--steps", str(args.steps),
                  "--batch-per-device", *map(str, args.batch_per_device)]
        subprocess.run([sys.executable, __file__, "--role", "one", "--result", one, *common], check=True)
        code = par.launch(["python", __file__, "--role", "two", "--result", two, *common], 2,
                          cpu_devices=1 if args.cpu else None, gpus_per_process=None if args.cpu else 1,
                          timeout_s=480)
        if code:
            return code
        one, two = (json.load(open(p)) for p in (one, two))
    per_batch = {}
    for batch in args.batch_per_device:
        a, b = one["per_batch"][str(batch)], two["per_batch"][str(batch)]
        losses_a, losses_b = np.asarray(a["losses"]), np.asarray(b["losses"])
        per_batch[batch] = {
            "one_process_two_devices_ms": a["step_ms"], "two_processes_one_device_each_ms": b["step_ms"],
            "step_time_ratio_two_over_one": b["step_ms"] / a["step_ms"],
            "max_relative_loss_difference_first_10": float(np.max(np.abs(losses_b - losses_a)[:10] / losses_a[:10])),
            "max_relative_loss_difference": float(np.max(np.abs(losses_b - losses_a) / losses_a)),
            "losses_one": a["losses"], "losses_two": b["losses"]}
        print(f"{batch} per device: 1 x 2 {a['step_ms']:.3f} ms/step, 2 x 1 {b['step_ms']:.3f} ms/step "
              f"(x{b['step_ms'] / a['step_ms']:.3f}); losses differ by at most "
              f"{per_batch[batch]['max_relative_loss_difference']:.1e} (relative)")
    result = {"benchmark": "multiprocess_gpu", "date": time.strftime("%Y-%m-%d"), "device": one["device_kind"],
              "jax": jax.__version__, "jaxrec": jaxrec.__version__, "jaxrec_build": jaxrec.build_info(),
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "shape": dict(tables=TABLES, rows=ROWS, dim=DIM, steps=args.steps), "per_batch": per_batch}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
