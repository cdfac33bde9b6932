"""``jaxrec export CHECKPOINT OUT``: a ``jaxrec train`` run's model, restored from its
checkpoint, quantized (``quantize``) and written as a serving folder (``export``) that
``jaxrec.serving.load`` serves in another process.

::

    jaxrec train --checkpoint-dir ckpt --out-dir run
    jaxrec export run served                          # int8 tables, the model that was tested
    jaxrec export ckpt served --precision t_C1=int4,*=int8 --batch-sizes 1,256
    jaxrec export ckpt/2500 served --precision fp32   # one step folder: that checkpoint

CHECKPOINT is the run's ``--out-dir`` (its metrics.json names the checkpoint of the best
validation model, the one whose test metrics the run reported), its ``--checkpoint-dir``
(the best validation evaluation's checkpoint when it is still there, else the newest) or
one step folder of it. The model is rebuilt as ``--resume`` rebuilds it: from the config
saved in the checkpoint (``build_task``), so the run's data must be readable where the
command runs. Every array is checked against its checksum, and the restored float model's
validation metrics must match those the run recorded at that step: a model rebuilt from
changed data or code is refused, not served.

Served: click-through models (``--task ctr``: dlrm, dcn) with dense tables. Refused,
naming the fix: other tasks (ratings and retrieval: their models take no dense features
and are not what ``export`` traces), TT-compressed tables (quantizing would materialize
them), a folder that is not a jaxrec run, an ``OUT`` holding other files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxrec.checkpoint import all_steps, read_metadata, restore_checkpoint
from jaxrec.nn import EmbeddingBagCollection
from jaxrec.serving import PRECISIONS, export, quantize, quantize_rows
from jaxrec.serving._export import BATCH_SIZES, FORMAT
from jaxrec.train._config import TrainConfig
from jaxrec.train._loop import (  # what jaxrec train saves and resumes
    DENSE_OPTIMIZERS,
    checkpoint_state,
    load_checkpoint_state,
)
from jaxrec.train._task_base import Task
from jaxrec.train._tasks import best_evaluation, build_task

SERVED_TASKS = {"ctr": ("dlrm", "dcn")}
AUC_TOLERANCE = 1e-3
"""How far the restored model's validation AUC may be from the one the run recorded at that
step: the same model on another device or backend moves it by ~1e-6; another model (data
or code changed since the run) by far more."""


@dataclasses.dataclass
class RestoredRun:
    """A ``jaxrec train`` run's model at one checkpoint (``restore_run``)."""

    config: TrainConfig
    task: Task  # ``task.model`` holds the restored state
    checkpoint_dir: Path
    step: int
    chosen: str  # why this step: "the best validation model", ...
    recorded: dict | None  # the run's validation evaluation at this step, if it made one

    @property
    def model(self) -> nnx.Module:
        return self.task.model

    @property
    def tables(self) -> dict[str, int]:
        """``{table name: embedding_dim}`` of the model's collections."""
        return {t.name: t.embedding_dim for c in self.collections for t in c.embedding_bag_configs()}

    @property
    def collections(self) -> list[EmbeddingBagCollection]:
        return [m for _, m in nnx.iter_modules(self.task.model) if isinstance(m, EmbeddingBagCollection)]


def restore_run(path: str | Path, *, step: int | None = None) -> RestoredRun:
    """The model of the run at ``path`` (module doc), restored and verified."""
    directory, found_step, chosen = _locate(Path(path))
    if step is not None:
        if step not in all_steps(directory):
            raise ValueError(f"--step {step}: {directory} holds the checkpoints of steps "
                             f"{all_steps(directory)}; pass one of them, or no --step")
        found_step, chosen = step, f"--step {step}"
    meta = read_metadata(directory, step=found_step)
    config = _config(meta, directory)
    history = meta.get("history") or {}
    evaluations = history.get("eval") or []
    if found_step is None:
        best = best_evaluation(config.task, evaluations)
        if best and best["step"] in all_steps(directory):
            found_step, chosen = best["step"], "the best validation model"
        else:
            found_step, chosen = meta.step, "the newest checkpoint (no better evaluation is kept)"
    task = _build(config)
    tx = DENSE_OPTIMIZERS[config.dense_optimizer](config.dense_learning_rate)
    target = checkpoint_state(task.model, nnx.Optimizer(task.model, tx, wrt=nnx.Param))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # orbax's notes; a corrupt checkpoint raises below
        state, meta = restore_checkpoint(directory, target, step=found_step)
    load_checkpoint_state(task.model, state)
    recorded = next((e for e in (meta.get("history") or {}).get("eval", []) if e["step"] == meta.step), None)
    return RestoredRun(config, task, directory, meta.step, chosen, recorded)


def parse_precisions(text: str) -> dict[str, str]:
    """``"int8"`` -> ``{"*": "int8"}``; ``"t_C1=int4,*=int8"`` -> ``{"t_C1": "int4", "*": "int8"}``."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        name, _, precision = part.rpartition("=")
        name = name.strip() or "*"
        if precision not in PRECISIONS:
            raise ValueError(f"--precision {text!r}: {precision!r} is not one of {', '.join(PRECISIONS)}; "
                             "pass one for every table (--precision int8) or per table "
                             "(--precision t_C1=int4,*=int8)")
        if name in out:
            raise ValueError(f"--precision {text!r} gives table {name!r} twice; name each table once")
        out[name] = precision
    return out


def quantize_run(run: RestoredRun, precisions: dict[str, str], text: str = ""):
    """``quantize(run.model, precisions)``, its errors naming ``--precision`` and the table."""
    text = text or ",".join(f"{k}={v}" for k, v in precisions.items())
    unknown = sorted(set(precisions) - set(run.tables) - {"*"})
    if unknown:
        raise ValueError(f"--precision {text!r} names {', '.join(unknown)}, which this model lacks; "
                         f"its tables are {', '.join(run.tables)}")
    try:
        return quantize(run.model, precisions)
    except ValueError as e:
        error = e
    weights = {k: v for c in run.collections for k, v in c.split_embedding_weights().items()}
    for name in run.tables:  # which table: the row format's errors do not say
        precision = precisions.get(name, precisions.get("*", "fp32"))
        try:
            if precision not in ("fp32", "fp16"):
                quantize_rows(np.asarray(weights[name], np.float32), precision)
        except ValueError as e:
            raise ValueError(f"--precision {text!r}: table {name}: {e}; e.g. --precision "
                             f"{name}=fp32,*={precisions.get('*', 'int8')}") from None
    raise ValueError(f"--precision {text!r}: {error}") from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    try:
        _check_out(out)
        run = restore_run(args.checkpoint, step=args.step)
        served, report = quantize_run(run, args.precision, args.precision.text)
        fp32 = _verified(run)
        quantized = run.task.evaluate(served_predict(served), run.task.val_batches)
        batch = run.task.val_batches[0]
        ids_per_sample = math.ceil(batch.sparse.values().shape[0] / batch.dense.shape[0])
        _clear(out)
        export(served, out, num_dense=int(batch.dense.shape[1]), keys=batch.sparse.keys(),
               ids_per_sample=ids_per_sample, batch_sizes=args.batch_sizes)
    except KeyboardInterrupt:
        print("jaxrec export: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 (bad paths, refused runs, corrupt checkpoints, ...)
        print(f"jaxrec export: {_one_line(e)}", file=sys.stderr)
        return 1
    samples = sum(int(np.asarray(b.mask).sum()) for b in run.task.val_batches)
    recorded = f" (the run recorded {run.recorded['auc']:.5f})" if run.recorded else ""
    print(f"exported {run.config.model} from checkpoint step {run.step} of {run.checkpoint_dir} "
          f"({run.chosen}) to {out}")
    print(f"  tables: {_tables_line(report.precisions)}; {report.bytes_before:,} -> "
          f"{report.bytes_after:,} bytes ({report.ratio:.1f}x)")
    print(f"  validation AUC ({samples:,} samples): {fp32['auc']:.5f} float32{recorded}, "
          f"{quantized['auc']:.5f} served")
    keys = batch.sparse.keys()
    print(f"  buckets of {', '.join(map(str, sorted(set(args.batch_sizes))))} samples, {ids_per_sample} "
          f"ids per sample, keys {keys[0]}..{keys[-1]}; load it with jaxrec.serving.load({str(out)!r})")
    return 0


def _tables_line(precisions: dict[str, str]) -> str:
    """``"25 int8, int4 t_C1"``: the most common precision counted, the others' tables named."""
    by_precision: dict[str, list[str]] = {}
    for name, p in precisions.items():
        by_precision.setdefault(p, []).append(name)
    most = max(by_precision, key=lambda p: len(by_precision[p]))
    return ", ".join([f"{len(by_precision[most])} {most}"] + [
        f"{p} {', '.join(sorted(names))}" if len(names) <= 4 else f"{len(names)} {p}"
        for p, names in by_precision.items() if p != most])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxrec export", description="Quantize the model of a jaxrec train run and write it as a "
        "serving folder (jax.export artifacts and weights) for jaxrec.serving.load; see docs/serving.md.")
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="the run's --out-dir (the model it tested), its --checkpoint-dir (the best "
                        "validation model kept there, else the newest) or one step folder of it")
    p.add_argument("out", metavar="OUT", help="the serving folder to write (new, empty, or an earlier export)")
    p.add_argument("--precision", default="int8", type=_precision_arg,
                   help=f"the tables' precision, one of {', '.join(PRECISIONS)}, or per table: "
                        "t_C1=int4,*=int8 (* for the rest) (default: int8)")
    p.add_argument("--batch-sizes", type=_batch_sizes_arg, default=BATCH_SIZES, metavar="B1,B2,...",
                   help="the batch-size buckets to export (default: "
                        f"{','.join(map(str, BATCH_SIZES))})")
    p.add_argument("--step", type=int, help="export this checkpoint step of the run instead")
    return p


def _precision_arg(text: str):
    try:
        return _Precision(parse_precisions(text), text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--precision {text!r}: ")) from None


class _Precision(dict):
    """Parsed ``--precision``, with the text it came from (for messages)."""

    def __init__(self, value: dict, text: str):
        super().__init__(value)
        self.text = text


def _batch_sizes_arg(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1 (e.g. 1,64,1024), got {text!r}")
    return sizes


def _locate(path: Path) -> tuple[Path, int | None, str]:
    """``(checkpoint directory, step or None: choose, why)`` of CHECKPOINT."""
    usage = ("pass the --out-dir of a jaxrec train run that had a --checkpoint-dir, the "
             "--checkpoint-dir itself, or one step folder of it")
    if not path.exists():
        raise FileNotFoundError(f"CHECKPOINT {str(path)!r} does not exist: {usage}")
    record_path = path / "metrics.json"
    if record_path.is_file():
        try:
            record = json.loads(record_path.read_text())
            config, test = record["config"], record.get("test") or {}
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"CHECKPOINT {str(path)!r}: {record_path} is not the metrics.json of "
                             f"jaxrec train; {usage}") from None
        if test.get("checkpoint") and Path(test["checkpoint"]).is_dir():
            tested = Path(test["checkpoint"])
            return tested.parent, int(tested.name), "the best validation model, which the run tested"
        if not config.get("checkpoint_dir"):
            raise ValueError(f"CHECKPOINT {str(path)!r}: this run saved no checkpoint (it ran without "
                             "--checkpoint-dir), so there is no model to export: train again with "
                             "--checkpoint-dir DIR, then jaxrec export DIR OUT")
        directory = Path(config["checkpoint_dir"])
        if not all_steps(directory):
            raise FileNotFoundError(f"CHECKPOINT {str(path)!r}: the run's --checkpoint-dir "
                                    f"{str(directory)!r} holds no checkpoint (moved, deleted, or relative "
                                    "to another folder): pass the checkpoint directory itself")
        return directory, None, ""
    if all_steps(path):
        return path, None, ""
    if path.name.isdigit() and int(path.name) in all_steps(path.parent):
        return path.parent, int(path.name), "the step folder given"
    raise ValueError(f"CHECKPOINT {str(path)!r} is not a jaxrec run (no metrics.json, no checkpoint "
                     f"step folders): {usage}")


def _config(meta, directory: Path) -> TrainConfig:
    """The run's ``TrainConfig`` from a checkpoint's metadata; refuses what export cannot serve."""
    saved = meta.get("config")
    where = f"checkpoint step {meta.step} in {directory}"
    if not isinstance(saved, dict):
        raise ValueError(f"{where} was not written by jaxrec train (its metadata has no 'config'): "
                         "jaxrec export rebuilds the model from a run's settings; export a model built "
                         "in Python with jaxrec.serving.quantize and jaxrec.serving.export")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    try:
        # The saved backend may be one this machine lacks (a GPU run): the lookup is the same.
        config = TrainConfig(**{k: v for k, v in saved.items() if k in fields and k not in ("resume", "backend")})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: its settings are not a valid jaxrec train config ({e}); was it "
                         "written by another jaxrec version?") from None
    if config.task not in SERVED_TASKS or config.model not in SERVED_TASKS[config.task]:
        raise ValueError(f"{where} is a --task {config.task} run of --model {config.model}; jaxrec export "
                         "serves click-through models: --task ctr with --model "
                         f"{' or '.join(SERVED_TASKS['ctr'])} (dense features and ids in, a logit out). "
                         "Quantize other models in Python: jaxrec.serving.quantize")
    if config.vocab == "dynamic":
        raise ValueError(f"{where} trained dynamic-vocabulary tables (--vocab dynamic), which serving does "
                         "not support yet (a quantized table would lose its hash index): train with "
                         "--vocab modulo to export the model")
    if config.tt_ranks:
        raise ValueError(f"{where} TT-compressed its tables of >= {config.tt_min_rows} rows (--tt-ranks "
                         f"{','.join(map(str, config.tt_ranks))}); jaxrec export quantizes dense rows and "
                         "would materialize them: train without --tt-ranks to export the model")
    return config


def _build(config: TrainConfig) -> Task:
    try:
        return build_task(config)
    except (OSError, ValueError) as e:
        raise ValueError(f"the run's data {config.data!r} cannot be read ({e}); jaxrec export rebuilds "
                         "the model and its validation batches from it: run it where that path "
                         "exists (the folder jaxrec train ran in)") from None


def served_predict(served: nnx.Module):
    """``predict(_, batch)`` for ``Task.evaluate``: the click probabilities of ``served``
    (in place of the task's model), from the logits of the function ``export`` writes."""
    return lambda _, batch: jax.nn.sigmoid(_logits(served, batch.dense, batch.sparse)[:, 0])


@jax.jit
def _logits(model, dense, sparse):
    return model(dense, sparse)


def _verified(run: RestoredRun) -> dict[str, float]:
    """The restored float model's validation metrics, checked against the run's record."""
    result = run.task.evaluate(nnx.jit(run.task.predict), run.task.val_batches)
    if run.recorded and abs(result["auc"] - run.recorded["auc"]) > AUC_TOLERANCE:
        raise ValueError(f"checkpoint step {run.step} in {run.checkpoint_dir}: the restored model's "
                         f"validation AUC is {result['auc']:.5f}, the run recorded {run.recorded['auc']:.5f} "
                         f"at that step: the rebuilt model is not the one trained (was the data "
                         f"{run.config.data!r} or jaxrec changed since?); export it where the run was "
                         "trained, or train again")
    return result


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT {str(out)!r} is a file; pass a new folder")
    if out.is_dir() and any(out.iterdir()) and _manifest(out) is None:
        raise ValueError(f"OUT {str(out)!r} holds files and is not a serving folder: pass a new or empty "
                         "folder (an earlier jaxrec export's folder is replaced)")


def _manifest(out: Path) -> dict | None:
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def _clear(out: Path) -> None:
    """Deletes an earlier export's files from ``out`` (its buckets may differ)."""
    manifest = _manifest(out) if out.is_dir() else None
    if manifest:
        for name in [*manifest.get("sha256", {}), "manifest.json"]:
            if Path(name).name == name:  # a file of the folder, never a path out of it
                (out / name).unlink(missing_ok=True)


def _one_line(error: Exception) -> str:
    text = str(error) or type(error).__name__
    return text if isinstance(error, (ValueError, TypeError, OSError, RuntimeError)) else (
        f"{type(error).__name__}: {text}")
