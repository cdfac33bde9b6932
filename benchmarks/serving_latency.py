"""Serving latency: the README quick-start DLRM quantized, exported, loaded and called.

    python benchmarks/serving_latency.py --out benchmarks/results/serving_latency_<device>_<date>.json [--quick]

Also an example of the serving path, in one process on JAX's default backend (CPU here,
CUDA on a GPU machine):

1. the README quick-start model: DLRM over the synthetic click log (26 tables of at most
   20,000 rows, dim 16, fused rowwise Adagrad, Adam on the dense part), trained ``--steps``
   steps of 1,024 samples (default 300);
2. ``jaxrec.serving.quantize`` to fp32, int8 and int4 tables, ``export`` (batch-size
   buckets 1, 64, 1,024 and 4,096, lowered for CPU and CUDA) into a temporary folder and
   ``load`` back: ``predict(dense, kjt)``, what users of a folder get;
3. per precision and batch size B in (1, 64, 1024, 4096), the latency of one call:
   ``loaded``: ``predict(dense, KeyedJaggedTensor(keys, values, lengths=lengths,
   capacity=B * 26))``; ``arrays``: ``predict.predict_arrays(dense, lengths, values)``, the
   same folder from the host arrays without a KJT; and ``jit``: the same quantized model in memory, split once with
   ``nnx.split`` and called through ``jax.jit`` on the same KJT; for reference,
   ``trained_fp32 / jit``: the trained model itself (the float tables' lookup kernels).

A call starts from a request's host arrays (dense float32 [B, 13], int64 ids key-major,
int32 lengths [26, B]: fresh synthetic click-log samples, held out from training; 4
distinct requests per B, cycled), builds the KJT, runs the model and ends with the scores
on the host (``np.asarray``). Each case is warmed up (its first call, which compiles, is
reported apart), then timed call by call in ``--rounds`` blocks of back-to-back calls, the
cases of a batch size taking turns block by block so that a drift of the machine touches
all alike. p50 / p99 over all timed calls; throughput = B / mean latency.

Also in the result: the held-out AUC of the trained model and of every loaded folder
(trained, so not a random model), the largest difference between the loaded and the
in-memory scores, each folder's files and custom calls (``jaxrec_quantized_lookup``
where the lookup is a kernel, none where it is plain XLA), and the commit and the
uncommitted files of src/ and csrc/ the run used. Compiles are not in the timings: each
case's first call (which compiles its bucket) is ``first_call_ms``; the sanity checks
above have already run the loaded buckets of 64 and 1,024, whose first calls are warm.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

from jaxrec import serving
from jaxrec.benchmark._environment import cpu_model, environment, machine_info, nvidia_driver
from jaxrec.benchmark._measure import NUM_ID_SETS
from jaxrec.benchmark._report import write_json
from jaxrec.data import SyntheticClickLog
from jaxrec.metrics import auc
from jaxrec.models import DLRM
from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig, make_train_step
from jaxrec.optim import RowWiseAdagrad
from jaxrec.sparse import KeyedJaggedTensor

BATCH_SIZES = (1, 64, 1024, 4096)
PRECISIONS = ("fp32", "int8", "int4")
TRAIN_BATCH = 1024
HELD_OUT = 1_000_000  # sample indices from here on are never trained on
METHOD = ("per call: KeyedJaggedTensor(keys, values, lengths=lengths, capacity=B * ids_per_sample) "
          "from the request's host arrays, the model call, np.asarray(scores) (ends with the scores "
          "on the host); path 'arrays': Served.predict_arrays on the host arrays, no KJT; "
          "time.perf_counter around each call; first call (compile) excluded and reported as "
          "first_call_ms")


def train(steps: int) -> tuple[SyntheticClickLog, DLRM, dict]:
    """The README quick-start model trained ``steps`` steps; its training record."""
    log = SyntheticClickLog(max_rows=20_000)
    tables = [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=n, embedding_dim=16, feature_names=[k])
              for k, n in zip(log.keys, log.table_sizes)]
    ebc = EmbeddingBagCollection(tables, optimizer=RowWiseAdagrad(learning_rate=0.1), rngs=nnx.Rngs(0))
    model = DLRM(ebc, log.num_dense, [64, 16], [64, 32, 1], rngs=nnx.Rngs(1))
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    def loss_fn(model, batch):
        logits = model(batch.dense, batch.sparse)[:, 0]
        return optax.sigmoid_binary_cross_entropy(logits, batch.labels).mean()

    train_step = make_train_step(loss_fn)
    start, losses = time.perf_counter(), []
    for batch in log.batches(TRAIN_BATCH, steps):
        losses.append(train_step(model, optimizer, batch))
    losses = [float(x) for x in losses]
    record = {"steps": steps, "batch_size": TRAIN_BATCH, "seconds": round(time.perf_counter() - start, 1),
              "first_loss": losses[0], "last_loss": float(np.mean(losses[-20:]))}
    return log, model, record


def requests(log: SyntheticClickLog, batch: int, count: int, start: int) -> list[tuple]:
    """``count`` distinct held-out requests of ``batch`` samples: (dense, values, lengths) on
    the host, as a serving front end would receive them."""
    out = []
    for k in range(count):
        s = log.sample(batch, index=HELD_OUT + start + k)
        out.append((s.dense, s.values, s.lengths, s.labels))
    return out


def kjt(keys, values, lengths, capacity: int) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(list(keys), values, lengths=lengths.reshape(-1), capacity=capacity)


def loaded_call(predict: serving.Served, keys, capacity: int):
    """One request through the loaded folder, scores on the host."""
    def call(request):
        dense, values, lengths = request[:3]
        return np.asarray(predict(dense, kjt(keys, values, lengths, capacity)))
    return call


def arrays_call(predict: serving.Served):
    """One request through the loaded folder from its host arrays (``predict_arrays``: no KJT)."""
    def call(request):
        dense, values, lengths = request[:3]
        return np.asarray(predict.predict_arrays(dense, lengths, values))
    return call


def jit_call(model: nnx.Module, keys, capacity: int):
    """One request through ``model`` in memory under ``jax.jit`` (split once), scores on the host."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, dense, sparse: nnx.merge(graphdef, state)(dense, sparse))

    def call(request):
        dense, values, lengths = request[:3]
        return np.asarray(forward(state, dense, kjt(keys, values, lengths, capacity)))
    return call


def latencies(cases: dict, reqs: list, calls: int, rounds: int, warmup: int) -> tuple[dict, dict]:
    """{case: seconds of each timed call}, {case: seconds of its first call}.

    Every case is warmed up, then the cases take turns, ``rounds`` blocks of ``calls //
    rounds`` back-to-back calls each; call i of a case takes ``reqs[i % len(reqs)]``.
    """
    first, times, count = {}, {name: [] for name in cases}, dict.fromkeys(cases, 0)
    for name, fn in cases.items():
        start = time.perf_counter()
        fn(reqs[0])
        first[name] = time.perf_counter() - start
        for i in range(1, warmup + 1):
            fn(reqs[i % len(reqs)])
    per_round = max(1, calls // rounds)
    for r in range(rounds):
        names = list(cases)
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = cases[name]
            for _ in range(per_round):
                request = reqs[count[name] % len(reqs)]
                start = time.perf_counter()
                fn(request)
                times[name].append(time.perf_counter() - start)
                count[name] += 1
    return times, first


def summary(seconds: list[float], batch: int) -> dict:
    ms = np.asarray(seconds) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()), "min_ms": float(ms.min()), "max_ms": float(ms.max()),
            "samples_per_s": float(batch / (ms.mean() / 1e3)), "calls": len(ms)}


def folder_bytes(path: Path) -> dict:
    return {f.name: f.stat().st_size for f in sorted(path.iterdir())}


def custom_calls(path: Path) -> list[str]:
    """The custom-call targets of the folder's smallest artifact (kernels vs plain XLA)."""
    blob = bytearray(min(path.glob("serve_*.bin"), key=lambda f: int(f.stem[6:])).read_bytes())
    return sorted(set(re.findall(r"custom_call @(\w+)", jax.export.deserialize(blob).mlir_module())))


def source_state() -> dict:
    """The commit the run's jaxrec comes from and its uncommitted files (src, csrc)."""
    def git(*args):
        run = subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent)
        return run.stdout.strip() if run.returncode == 0 else None
    status = git("status", "--porcelain", "--", "src", "csrc")
    return {"commit": git("rev-parse", "HEAD"), "uncommitted": status.splitlines() if status else []}


def heldout_auc(call, reqs: list) -> float:
    scores = np.concatenate([call(r)[:, 0] for r in reqs])
    return float(auc(np.concatenate([r[3] for r in reqs]), scores))


def device_name() -> str:
    device = jax.devices()[0]
    return cpu_model() if device.platform == "cpu" else device.device_kind


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the result here (JSON)")
    p.add_argument("--quick", action="store_true", help="fewer calls and training steps: a smoke run")
    p.add_argument("--steps", type=int, help="training steps of 1,024 samples (default 300, --quick 100)")
    p.add_argument("--calls", type=int, help="timed calls per case (default 200, --quick 20)")
    p.add_argument("--rounds", type=int, default=5, help="blocks the timed calls are cut into")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per case after the first")
    args = p.parse_args(argv)
    steps = args.steps or (100 if args.quick else 300)
    calls = args.calls or (20 if args.quick else 200)
    if steps < 1 or calls < 1:
        raise SystemExit(f"--steps and --calls must be >= 1, got {steps} and {calls}")

    result = environment("serving_latency", device_name(), {}, {})
    result["source"] = source_state()
    result.update(backend=jax.default_backend(), method=METHOD, calls_per_case=calls, rounds=args.rounds,
                  warmup_calls=args.warmup, requests_per_batch_size=NUM_ID_SETS, batch_sizes=list(BATCH_SIZES))
    if jax.default_backend() == "gpu":
        result["nvidia_driver"] = nvidia_driver()
    load_at_start = os.getloadavg()
    print(f"{result['backend']}: {result['device']}; training {steps} steps", flush=True)
    log, model, result["training"] = train(steps)
    ids_per_sample = log.capacity_per_sample
    result["model"] = {"readme_quick_start": "DLRM(ebc, 13, [64, 16], [64, 32, 1]), 26 tables of dim 16",
                       "table_rows": list(log.table_sizes), "ids_per_sample": ids_per_sample}
    reqs = {b: requests(log, b, NUM_ID_SETS, start=10 * b) for b in BATCH_SIZES}
    eval_reqs = requests(log, 1024, 4 if args.quick else 16, start=0)  # held-out AUC
    result["training"]["heldout_auc"] = heldout_auc(jit_call(model, log.keys, 1024 * ids_per_sample),
                                                    eval_reqs)
    print("training:", result["training"], flush=True)

    result["precisions"], result["results"] = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        served, predicts = {}, {}
        for precision in PRECISIONS:
            served[precision], report = serving.quantize(model, precision)
            start = time.perf_counter()
            path = serving.export(served[precision], Path(tmp) / precision, num_dense=log.num_dense,
                                  keys=log.keys, ids_per_sample=ids_per_sample)
            export_s = time.perf_counter() - start
            start = time.perf_counter()
            predicts[precision] = serving.load(path)
            load_s = time.perf_counter() - start
            predict = loaded_call(predicts[precision], log.keys, 1024 * ids_per_sample)
            check = reqs[64][0]
            in_memory = jit_call(served[precision], log.keys, 64 * ids_per_sample)(check)
            result["precisions"][precision] = {
                "table_bytes_before": report.bytes_before, "table_bytes_after": report.bytes_after,
                "ratio": report.ratio, "export_s": export_s, "load_s": load_s,
                "platforms": predicts[precision].manifest["platforms"], "folder_bytes": folder_bytes(path),
                "custom_calls": custom_calls(path),
                "heldout_auc_loaded": heldout_auc(predict, eval_reqs),
                "max_abs_loaded_vs_jit_b64": float(np.abs(predict(check) - in_memory).max())}
            print(precision, result["precisions"][precision], flush=True)

        for b in BATCH_SIZES:
            capacity = b * ids_per_sample
            cases = {("trained_fp32", "jit"): jit_call(model, log.keys, capacity)}
            for precision in PRECISIONS:
                cases[(precision, "loaded")] = loaded_call(predicts[precision], log.keys, capacity)
                cases[(precision, "arrays")] = arrays_call(predicts[precision])
                cases[(precision, "jit")] = jit_call(served[precision], log.keys, capacity)
            times, first = latencies(cases, reqs[b], calls, args.rounds, args.warmup)
            for (precision, path), seconds in times.items():
                row = {"precision": precision, "path": path, "batch_size": b, **summary(seconds, b),
                       "first_call_ms": first[(precision, path)] * 1e3}
                result["results"].append(row)
                print(f"B={b:<5} {precision:<12} {path:<6} p50 {row['p50_ms']:9.3f} ms  p99 "
                      f"{row['p99_ms']:9.3f} ms  {row['samples_per_s']:12,.0f} samples/s", flush=True)
    if jax.default_backend() == "cpu":
        result["machine"] = dict(machine_info(), load_average_at_start=load_at_start)
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
