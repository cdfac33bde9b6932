"""Does the default ``jaxrec train`` model keep its held-out AUC when served with int8 or
int4 tables? (Issue "Serving": int8 within 0.001 of the float32 AUC, int4 within 0.003.)

    python benchmarks/serving_default_auc.py --out benchmarks/results/serving_default_auc_cpu.json

1. ``jaxrec train --out-dir WORK/run --checkpoint-dir WORK/run/checkpoints``: the defaults
   (DLRM on the synthetic click log, 2,500 steps of 1,024, 26 tables of 20,000 x 16), with
   checkpoints, which export reads and which change nothing in what is trained.
2. ``jaxrec export WORK/run WORK/served-<p> --precision <p> --batch-sizes 1024`` for int8
   and int4 (the command under test: restore, verify, quantize, export).
3. In this process: the run's model restored as the command restores it, and the AUC of
   the float32 model, of each exported folder loaded with ``jaxrec.serving.load`` and of
   the in-memory quantized model (``jaxrec.serving.quantize``: the same numbers) on the
   run's own held-out test batches (``--eval-batches`` 4 x 1,024 samples), computed as the
   CLI computes its test metrics (``Task.evaluate``: ``jaxrec.metrics.auc`` of the masked
   rows). The float32 AUC must equal the one the run reported (its best validation model).

Writes the JSON given by ``--out``: date, device, versions, the run, the AUCs, their
differences from float32 against the criteria, and the tables' bytes before and after.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import jaxrec
from jaxrec import serving
from jaxrec.serving._command import restore_run, served_predict

CRITERIA = {"int8": 0.001, "int4": 0.003}  # |AUC - float32 AUC| at most


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the JSON to write")
    p.add_argument("--work", help="folder for the run and the exports (default: a temporary one)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.work or scratch)
        result = measure(work)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for name, entry in result["auc"].items():
        print(f"{name}: test AUC {entry['test']:.5f}" + (
            f" ({entry['difference']:+.5f}; criterion {entry['criterion']}: "
            f"{'met' if entry['within_criterion'] else 'NOT met'})" if "difference" in entry else ""))
    print(f"wrote {args.out}")


def measure(work: Path) -> dict:
    run_dir = work / "run"
    train_cmd = ["train", "--out-dir", str(run_dir), "--checkpoint-dir", str(run_dir / "checkpoints")]
    train_s = _jaxrec(train_cmd)
    record = json.loads((run_dir / "metrics.json").read_text())
    exports = {}
    for precision in CRITERIA:
        folder = work / f"served-{precision}"
        cmd = ["export", str(run_dir), str(folder), "--precision", precision, "--batch-sizes", "1024"]
        exports[precision] = {"command": _shown(cmd, work), "seconds": round(_jaxrec(cmd), 1),
                              "folder_bytes": sum(f.stat().st_size for f in folder.iterdir())}

    run = restore_run(run_dir)
    task, test, val = run.task, run.task.test_batches, run.task.val_batches
    fp32 = {"test": task.evaluate(nnx.jit(task.predict), test)["auc"],
            "validation": task.evaluate(nnx.jit(task.predict), val)["auc"]}
    if abs(fp32["test"] - record["final"]["auc"]) > 1e-6:
        raise RuntimeError(f"the restored model's test AUC {fp32['test']} is not the run's "
                           f"{record['final']['auc']}: not the model the run tested")
    auc, sizes = {"fp32": fp32}, {}
    for precision, criterion in CRITERIA.items():
        loaded = serving.load(work / f"served-{precision}")
        from_folder = lambda _, batch, loaded=loaded: jax.nn.sigmoid(loaded(batch.dense, batch.sparse)[:, 0])
        served, report = serving.quantize(run.model, precision)
        entry = {"test": task.evaluate(from_folder, test)["auc"],
                 "validation": task.evaluate(from_folder, val)["auc"],
                 "test_in_memory": task.evaluate(served_predict(served), test)["auc"]}
        entry["difference"] = entry["test"] - fp32["test"]
        entry["criterion"] = criterion
        entry["within_criterion"] = bool(abs(entry["difference"]) <= criterion)
        auc[precision] = entry
        sizes[precision] = {"tables_bytes_before": report.bytes_before, "tables_bytes_after": report.bytes_after,
                            "ratio": round(report.ratio, 3), **exports[precision]}
    samples = sum(int(np.asarray(b.mask).sum()) for b in test)
    return {
        "benchmark": "serving_default_auc",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform,
        "cpu_count": os.cpu_count(),
        "versions": {"jaxrec": jaxrec.__version__, "jax": jax.__version__, "jaxlib": version("jaxlib"),
                     "python": platform.python_version()},
        "train": {"command": _shown(train_cmd, work), "seconds": round(train_s, 1),
                  "config": {k: v.replace(str(work), "WORK") if isinstance(v, str) else v
                             for k, v in record["config"].items()},  # no paths of this machine
                  "steps": record["steps"],
                  "train_samples_per_s": record["train_samples_per_s"], "device": record["device"],
                  "reported_test": record["final"], "checkpoint_step": run.step,
                  "checkpoint_chosen": run.chosen},
        "held_out": {"set": "the run's test batches", "samples": samples},
        "auc": auc,
        "bytes": sizes,
    }


def _shown(argv: list[str], work: Path) -> str:
    return "jaxrec " + " ".join(argv).replace(str(work), "WORK")


def _jaxrec(argv: list[str]) -> float:
    """Runs ``python -m jaxrec ARGV``; its seconds. Its output goes to this one's."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "jaxrec", *argv], check=True)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
