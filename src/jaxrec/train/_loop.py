"""The training loop of ``jaxrec train``: steps, evaluations, checkpoints, resume, outputs.

Evaluations during training read the validation set (the test set when there is none:
ratings with ``val_fraction=0``). With ``patience`` > 0 the run stops early once that many
evaluations in a row have not beaten the best one. At the end the test set is evaluated
once, with the model of the best validation evaluation: restored from its checkpoint,
which the rotation of ``checkpoint_dir`` (the newest ``_KEEP``) never deletes, or, without
a checkpoint directory, from a copy on the host taken at each new best. Without a
validation set the test metric is that of the last model (choosing by the test set would
make it a validation set).

How a run ends (``status`` in metrics.json):

- ``completed``: every step ran, or early stopping ended the run (``early_stop`` in
  metrics.json); the last state is evaluated and checkpointed, the best model tested.
- ``nonfinite``: a step's loss or gradient was NaN/Inf under ``on_nonfinite="stop"``, or
  the held-out predictions were (under either policy). The step's update was skipped,
  nothing is saved after it, so the newest checkpoint holds the last finite state;
  ``TrainingStopped`` says which step and which checkpoint.
- ``error``: an error while training (a bad record further on in a file, a FATAL bounds
  check, a state that cannot be saved); ``TrainingStopped`` chains it.
- ``interrupted``: Ctrl-C; the ``KeyboardInterrupt`` goes on after metrics.json is written.

In every case metrics.json and curves.png are written first. Errors before the first step
(the config, the data, the checkpoint lock, a refused resume) write nothing, so that the
outputs of an earlier run in ``out_dir`` stay as they are.

A run holds ``CheckpointLock(checkpoint_dir)`` from start to end: a second run on the same
directory is refused at start.

Checkpoints hold the plan-free form of the state (``checkpoint_state``: each table whole,
``jaxrec.parallel.portable_state``), so a run resumes on another number of processes
(``_processes.py``); models with TT tables, which have no such form, save their NNX state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import platform
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxrec
from jaxrec import NonFiniteError
from jaxrec._mesh import replicate
from jaxrec.checkpoint import (
    CheckpointLock,
    NonFiniteStateError,
    all_steps,
    latest_step,
    read_metadata,
    restore_checkpoint,
    save_checkpoint,
)
from jaxrec.data import Prefetcher
from jaxrec.nn import EmbeddingBagCollection, make_train_step, set_learning_rate
from jaxrec.ops.host_cache import in_host_memory
from jaxrec.parallel import ShardedEmbeddingBagCollection, load_portable_state, make_forward, portable_state
from jaxrec.train import _processes, _vocab
from jaxrec.train._config import NONFINITE_POLICIES, TrainConfig
from jaxrec.train._plot import plot_curves
from jaxrec.train._progress import Progress
from jaxrec.train._tasks import best_evaluation, build_task, evaluations_since_best

DENSE_OPTIMIZERS = {"adam": optax.adam, "adagrad": optax.adagrad, "sgd": optax.sgd}
_LOG_EVERY = 50  # steps between training-loss points (and progress lines off a terminal)
_EVAL_EVERY = 250  # steps between evaluations of a run counted in steps (--eval-every)
_KEEP = 3  # newest checkpoints kept in checkpoint_dir (the best one is kept besides)


class TrainingStopped(RuntimeError):
    """A run stopped before its end. ``record`` is what it wrote to metrics.json (its
    ``status`` says why: ``nonfinite`` or ``error``); the cause is chained."""

    def __init__(self, message: str, record: dict):
        super().__init__(message)
        self.record = record


def train(config: TrainConfig) -> dict:
    """Runs ``config``; returns (and writes to ``out_dir/metrics.json``) the run's record.

    Raises ``TrainingStopped`` when the run stops early (module doc), after writing the
    outputs; ``CheckpointLockedError`` when another run uses ``checkpoint_dir``. With
    several processes (``_processes.py``) every process calls it; process 0 writes the
    outputs and holds the lock.
    """
    if _processes.several():
        _processes.check(config)
    first = jax.process_index() == 0
    lock = CheckpointLock(config.checkpoint_dir) if config.checkpoint_dir and first else (
        contextlib.nullcontext())
    with lock, _vocab.ids_width(config):  # int64 ids: before the data and the model exist
        return _Run(config).run()


class _Run:
    """One run's state: the task, the model and optimizer, the history, the step."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self.task = build_task(config)
        self.model = self.task.model
        self.plan = None  # the tables' sharding plan, with several processes
        if _processes.several():
            self.model, self.plan = _processes.shard_model(self.model, config)
            self.task.model = self.model
        self.optimizer = nnx.Optimizer(
            self.model, DENSE_OPTIMIZERS[config.dense_optimizer](config.dense_learning_rate), wrt=nnx.Param)
        if self.plan is not None:  # on the mesh before a restore takes its shardings
            replicate(self.optimizer, _processes.mesh())
        self.history: dict = {"train": [], "eval": []}
        self.step = 0
        self.resumed: dict | None = None
        self.validates = self.task.val_batches is not None
        self.best_state = None  # the best model's state, without checkpoint_dir
        self.saved_step = None  # the newest checkpoint this run wrote or resumed
        self.early_stop: dict | None = None
        self.test: dict = {}
        self.test_unknown: dict | None = None  # dynamic tables: the test's unknown ids
        if config.resume:
            self._resume()
        if self.plan is None:
            # Committed to the device from the first step on, fresh or resumed: restored
            # arrays come back committed, and a step whose inputs are committed compiles to
            # another program than one whose are not. Without this a resumed run compiled
            # its step twice (some inputs restored, then all committed by the first step)
            # and never the fresh run's program.
            # Each array keeps its memory (tables in host memory stay there).
            device = jax.devices()[0]
            for holder in (self.model, self.optimizer):
                nnx.update(holder, jax.tree.map(lambda x: jax.device_put(x, jax.sharding.SingleDeviceSharding(
                    device, memory_kind=x.sharding.memory_kind)), nnx.state(holder)))
        self.start = self.step
        self.train_step = make_train_step(self.task.loss_fn,
                                          on_nonfinite=NONFINITE_POLICIES[config.on_nonfinite])
        # Donated: nnx.jit returns the model's state, which undonated means a copy of every
        # table per call (2M-row tables on 2 CPU cores: 234 ms a batch instead of 4.2 ms;
        # host-cached, whose evaluation updates its cache: 704 instead of 23 ms).
        self.predict = nnx.jit(self.task.predict, donate_argnums=0)
        if self.plan is not None:  # this process's rows of the sharded model's predictions
            forward, mesh = make_forward(self.task.predict), _processes.mesh()
            self.predict = lambda model, batch: _processes.local_rows(
                forward(model, _processes.place(batch, mesh)))
        self.timed_steps, self.timed_s = 0, 0.0
        total = config.steps or (config.epochs * self.task.steps_per_epoch
                                 if self.task.steps_per_epoch else None)
        self.total = total
        self.progress = Progress(total, every=_LOG_EVERY,
                                 stream=sys.stderr if jax.process_index() == 0 else None)
        self.status = {"loss": "-", **self._last_eval()}

    def run(self) -> dict:
        try:
            self._loop()
            self.train_step.check()  # what the issued steps found
            if not self.history["eval"] or self.history["eval"][-1]["step"] != self.step:
                self._evaluate()
            if self.config.checkpoint_dir:
                self._save()
            self._test()
        except NonFiniteError as e:
            self._stop("nonfinite", self._nonfinite_message(e), e)
        except KeyboardInterrupt:
            self._write("interrupted", f"interrupted at step {self.step}")
            raise
        except Exception as e:  # noqa: BLE001 (any error: the outputs first, then say it)
            self._stop("error", f"after step {self.step}: {e}; stopped. "
                                f"{self._last_checkpoint('checkpoint')}", e)
        return self._write("completed", None)

    # --- the steps -------------------------------------------------------------------

    def _loop(self) -> None:
        config, total, per_epoch = self.config, self.total, self.task.steps_per_epoch
        eval_every = config.eval_every or per_epoch or _EVAL_EVERY  # per_epoch: ratings
        checkpoint_every = config.checkpoint_every or eval_every
        losses = []
        tick = time.perf_counter()
        if self._patience_ran_out():  # a resumed run that had stopped early, same patience
            return
        batches = self.task.train_batches(self.step)
        if total is not None:
            batches = itertools.islice(batches, max(total - self.step, 0))
        if self.plan is not None:  # placed on the mesh in the data thread
            mesh = _processes.mesh()
            batches = (_processes.place(b, mesh) for b in batches)
        # Placed batches are global arrays already (device=False: no device_put of its own).
        with Prefetcher(batches, buffer_size=4, device=False if self.plan else None) as stream:
            for batch in stream:
                losses.append(self.train_step(self.model, self.optimizer, batch))
                self.step += 1
                step = self.step
                if step % _LOG_EVERY == 0 or step == total:
                    now = time.perf_counter()
                    self._log(losses, now - tick)
                    losses, tick = [], now
                if per_epoch:
                    self.status["epoch"] = f"{step / per_epoch:.2f}"
                if step % eval_every == 0 or step == total:
                    self._evaluate()
                    tick = time.perf_counter()  # evaluation time is not training time
                if config.checkpoint_dir and (step % checkpoint_every == 0 or step == total):
                    self._save()
                    tick = time.perf_counter()
                self.progress.update(step, self.status)
                if step % eval_every == 0 and step != total and self._patience_ran_out():
                    break

    def _patience_ran_out(self) -> bool:
        """Whether early stopping ends the run now; records why in ``early_stop``."""
        patience, evals = self.config.patience, self.history["eval"]
        since = evaluations_since_best(self.task.info["task"], evals)
        if not (patience and self.validates and evals and since >= patience):
            return False
        best = best_evaluation(self.task.info["task"], evals)
        self.early_stop = {"step": self.step, "patience": patience, "best_step": best["step"]}
        return True

    def _log(self, losses: list, seconds: float) -> None:
        loss = _mean_finite(losses)  # waits for the device
        if self.history["train"] or len(losses) < self.step - self.start:
            # not the interval that compiled
            self.timed_steps, self.timed_s = self.timed_steps + len(losses), self.timed_s + seconds
        self.history["train"].append({"step": self.step, "loss": loss})
        self.status["loss"] = "nan" if loss is None else f"{loss:.4f}"
        if self.timed_s:
            speed = self.config.batch_size * self.timed_steps / self.timed_s
            self.status["samples/s"] = f"{speed:,.0f}"
        stats = self.train_step.stats()
        for key, name in (("nonfinite_steps", "skipped"), ("nonfinite_rows", "rows kept"),
                          ("ids_corrected", "ids corrected")):
            if stats[key]:
                self.status[name] = f"{stats[key]:,}"

    def _evaluate(self) -> None:
        """Evaluates on the validation set (else the test set) and keeps a new best model."""
        task = self.task
        result = self._metrics(task.val_batches if self.validates else task.test_batches)
        point = {"step": self.step, **result}
        if task.steps_per_epoch:
            point["epoch"] = round(self.step / task.steps_per_epoch, 4)
        self.history["eval"].append(point)
        self.status.update(self._last_eval())
        if self.validates and best_evaluation(task.info["task"], self.history["eval"]) is point:
            if self.config.checkpoint_dir:
                self._save()  # kept by the rotation while it is the best
            elif self.plan is not None:  # the tables span processes: a copy on the devices
                self.best_state = jax.tree.map(jnp.copy, nnx.state(self.model))
            else:
                self.best_state = jax.tree.map(_host_copy, nnx.state(self.model))

    def _metrics(self, batches) -> dict[str, float]:
        """The task's metrics on ``batches``, the model in evaluation mode (flax's
        ``model.eval()``: a dynamic table looks ids up without inserting them), then back in
        training mode."""
        self.train_step.check()  # a step's own finding first: it is the cause
        self.model.eval()
        try:
            return self.task.evaluate(self.predict, batches)
        except FloatingPointError as e:  # non-finite predictions: stopped as a non-finite step
            raise NonFiniteError(f"evaluation: {e}", self.step - self.start - 1) from e
        finally:
            self.model.train()

    def _test(self) -> None:
        """The test metrics of the best model (``self.test``); the model is left as the best."""
        best = best_evaluation(self.task.info["task"], self.history["eval"])
        if not self.validates:  # the last evaluation read the test set, at this step
            self.test = {**self.history["eval"][-1], "model": "last"}
            return
        if best["step"] != self.step:
            self._restore_best(best["step"])
        dynamic = self.config.vocab == "dynamic"
        before = _vocab.unknown_lookups(self.model) if dynamic else 0
        result = self._metrics(self.task.test_batches)
        if dynamic:
            self.test_unknown = _vocab.unknown_ids(self.task.test_batches,
                                                   _vocab.unknown_lookups(self.model) - before)
        self.test = {**{k: v for k, v in best.items() if k in ("step", "epoch")},
                     "model": "best", **result}
        if self.config.checkpoint_dir:
            self.test["checkpoint"] = str(Path(self.config.checkpoint_dir).absolute()
                                          / str(best["step"]))

    def _restore_best(self, step: int) -> None:
        if self.best_state is not None:
            nnx.update(self.model, self.best_state)
            return
        # With a checkpoint directory (no copy on the host is taken, and a resumed run has
        # none of its first part's bests).
        directory = self.config.checkpoint_dir
        if step not in all_steps(directory):
            raise FileNotFoundError(
                f"the checkpoint of the best validation evaluation, step {step}, is not in "
                f"{directory} (deleted, or set aside as corrupt), so the best model cannot be "
                f"tested; the newest checkpoint, step {latest_step(directory)}, is the last "
                "model")
        state, _ = restore_checkpoint(directory, checkpoint_state(self.model, self.optimizer), step=step)
        load_checkpoint_state(self.model, state)

    def _save(self) -> None:
        """Checkpoints this step (once), then deletes all but the newest ``_KEEP`` and the
        best evaluation's checkpoint."""
        directory = self.config.checkpoint_dir
        if self.saved_step == self.step:
            return
        self.train_step.check()  # never save after a non-finite step (or a FATAL bounds check)
        # One batch per step, so the data position is the step; both are saved, so that a
        # future loader with other batch accounting can still find its place.
        try:
            save_checkpoint(directory, self.step, checkpoint_state(self.model, self.optimizer), keep=_KEEP,
                            keep_steps=self._best_steps(),
                            metadata={"step": self.step, "data_position": self.step,
                                      "history": self.history,
                                      "config": dataclasses.asdict(self.config)})
            self.saved_step = self.step
        except NonFiniteStateError as e:
            # No update writes a non-finite value (jaxrec/_step_guard.py), but a value set
            # from outside the step can hold one; stopped as a non-finite step all the same.
            raise NonFiniteError(str(e), self.step - self.start - 1) from e

    def _best_steps(self) -> tuple[int, ...]:
        """The step of the best validation evaluation, which the rotation keeps."""
        if not self.validates or not self.history["eval"]:
            return ()
        return (best_evaluation(self.task.info["task"], self.history["eval"])["step"],)

    def _last_eval(self) -> dict[str, str]:
        return _last_eval(self.history, "val " if self.validates else "test ")

    # --- how it ends -----------------------------------------------------------------

    def _nonfinite_message(self, error: NonFiniteError) -> str:
        config = self.config
        return (f"step {self.start + error.step + 1}: non-finite loss, gradient or model value "
                f"(NaN or Inf); "
                f"stopped. {self._last_checkpoint('finite checkpoint')} Lower --table-lr/"
                f"--dense-lr (now {config.table_learning_rate:g}/{config.dense_learning_rate:g}), "
                "or pass --on-nonfinite skip to skip such steps")

    def _last_checkpoint(self, what: str) -> str:
        directory = self.config.checkpoint_dir
        if not directory:
            return "No checkpoint was saved (no --checkpoint-dir)."
        step = latest_step(directory)
        if step is None:
            return f"No checkpoint was saved in {directory} before it."
        return f"The last {what} is step {step} in {directory} (--resume continues it)."

    def _stats(self) -> dict | None:
        """``train_step.stats()``, or None when the steps failed to run (they are read here)."""
        try:
            return self.train_step.stats()
        except Exception:  # noqa: BLE001 (the step's own error is being reported)
            return None

    def _dynamic_statistics(self) -> dict | None:
        """The dynamic tables' statistics (``_vocab.statistics``) and the test's unknown ids;
        None without dynamic tables, or when the state cannot be read (the run's own error
        is being reported)."""
        if self.config.vocab != "dynamic":
            return None
        try:
            stats = _vocab.statistics(self.model)
        except Exception:  # noqa: BLE001 (a failed step's state)
            return None
        return {**stats, "test": self.test_unknown}

    def _cache_statistics(self) -> dict | None:
        """The host-cached tables' statistics (``cache_statistics()``: rows cached now, rows
        loaded and written back since the model was created) per table and summed; None
        without such tables, or when the state cannot be read."""
        if self.config.placement != "host_cached":
            return None
        try:
            tables = {name: {k: v.item() for k, v in jax.device_get(stats).items()}
                      for _, m in nnx.iter_modules(self.model)
                      if isinstance(m, (EmbeddingBagCollection, ShardedEmbeddingBagCollection))
                      for name, stats in m.cache_statistics().items()}
        except Exception:  # noqa: BLE001 (a failed step's state)
            return None
        if not tables:
            return None
        return {"total": {k: sum(t[k] for t in tables.values()) for k in ("size", "inserted", "evicted")},
                "tables": tables}

    def _stop(self, status: str, message: str, error: Exception):
        record = self._write(status, message)
        raise TrainingStopped(message, record) from error

    def _write(self, status: str, message: str | None) -> dict:
        """Writes metrics.json and curves.png; returns the record."""
        self.progress.update(self.step, {**self.status, **self._last_eval()}, force=True)
        self.progress.close()
        config, timed_s = self.config, self.timed_s
        record = {
            "status": status,
            "stopped": message,
            "config": dataclasses.asdict(config),
            "device": jax.devices()[0].device_kind,
            "platform": jax.devices()[0].platform,
            "processes": jax.process_count(),
            "process": jax.process_index(),
            "devices": jax.device_count() if self.plan is not None else 1,
            "plan": None if self.plan is None else self.plan.to_json(),
            "versions": {"jaxrec": jaxrec.__version__, "jax": jax.__version__,
                         "python": platform.python_version()},
            "data": self.task.info,
            "steps": self.step,
            "step_stats": self._stats(),
            "resumed": self.resumed,
            "train_samples_per_s": config.batch_size * self.timed_steps / timed_s if timed_s
            else None,
            "eval_set": "validation" if self.validates else "test",
            "best": best_evaluation(self.task.info["task"], self.history["eval"]),
            "early_stop": self.early_stop,
            "test": self.test,
            "final": {k: v for k, v in self.test.items()
                      if k not in ("step", "epoch", "model", "checkpoint")},
            "dynamic_vocab": self._dynamic_statistics(),
            "host_cache": self._cache_statistics(),
            "history": self.history,
        }
        if jax.process_index() != 0:  # one run, one set of outputs: process 0's
            return record
        out = Path(config.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(_finite(record), indent=2) + "\n")
        plot_curves(self.history, out / "curves.png", f"{config.model} on {config.data}",
                    record["best"], record["eval_set"], self.test)
        return record

    # --- resume ----------------------------------------------------------------------

    def _resume(self) -> None:
        directory = self.config.checkpoint_dir
        if latest_step(directory) is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {directory!r}; run without "
                                    "--resume to start a new run there")
        with warnings.catch_warnings():  # a skipped corrupt checkpoint is said below
            warnings.simplefilter("ignore")
            # The settings first (cheap, and clearer than a state that does not fit), then
            # the state: its arrays may be corrupt where the metadata was not.
            self._check_settings(read_metadata(directory), directory)
            state, meta = restore_checkpoint(directory, checkpoint_state(self.model, self.optimizer))
        applied = self._check_settings(meta, directory)
        load_checkpoint_state(self.model, state, self.optimizer)  # optax keeps no rate
        if any(isinstance(m, EmbeddingBagCollection) and m.fused
               for _, m in nnx.iter_modules(self.model)):  # the tables' rate was restored: set it
            set_learning_rate(self.model, self.config.table_learning_rate)
        self.step, self.history = meta["data_position"], _history(meta)
        self.saved_step = meta.step
        set_aside = _set_aside_newer(Path(directory), meta.step) if jax.process_index() == 0 else {}
        _processes.barrier("jaxrec train: resumed")  # the set-aside folders are gone for all
        self.resumed = {"from_step": meta.step, "applied": applied,
                        "corrupt_set_aside": list(set_aside.values())}
        note = f"jaxrec train: resuming checkpoint step {meta.step} in {directory}"
        if applied:
            note += f"; applied {', '.join(applied)}"
        for step, path in set_aside.items():
            note += f"\n  skipped corrupt checkpoint step {step} (moved to {path}): " \
                    f"{meta.corrupt.get(step, '')}"
        if jax.process_index() == 0:
            print(note, file=sys.stderr)

    def _check_settings(self, meta, directory) -> list[str]:
        """The learning rates this run changes; refuses any other change that matters."""
        _check_metadata(meta, directory)
        refused, applied = self.config.resume_differences(meta["config"])
        if refused:
            raise ValueError(
                f"--resume: checkpoint step={meta.step} in {directory} was written with other "
                f"settings: {'; '.join(refused)}. They change the model or the data it trains "
                "on: pass the same flags to continue that run, or another --checkpoint-dir to "
                "start a new one")
        return applied


def checkpoint_state(model, optimizer):
    """What a run's checkpoint holds (``jaxrec export`` restores into it too): the
    plan-free form (module doc), or the NNX state of a model with TT tables."""
    if _has_tt(model):
        return {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    return portable_state(model, optimizer)


def load_checkpoint_state(model, state, optimizer=None) -> None:
    """Sets ``model`` (and ``optimizer``) from ``checkpoint_state``'s form, restored."""
    if _has_tt(model):
        nnx.update(model, state["model"])
        if optimizer is not None:
            nnx.update(optimizer, state["optimizer"])
    else:
        load_portable_state(model, state, optimizer)


def _has_tt(model) -> bool:
    return any(isinstance(m, EmbeddingBagCollection) and any(g.tt for g in m.groups)
               for _, m in nnx.iter_modules(model))


def _check_metadata(meta, directory) -> None:
    """Refuses, naming every problem, metadata that ``_Run._save`` did not write."""
    problems = []
    for key in ("step", "data_position"):
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            problems.append(f"{key!r} is {value!r}, not an int >= 0")
    if meta.get("step") != meta.step:
        problems.append(f"'step' is {meta.get('step')!r} in checkpoint folder {meta.step}")
    history = meta.get("history")
    if not (isinstance(history, dict) and all(
            isinstance(history.get(k), list) and all(_is_point(p) for p in history[k])
            for k in ("train", "eval"))):
        problems.append("'history' is not {'train': [...], 'eval': [...]} of {'step': int, "
                        "name: number} points")
    if not isinstance(meta.get("config"), dict):
        problems.append("'config' (the run's settings) is missing")
    if problems:
        raise ValueError(f"--resume: checkpoint step={meta.step} in {directory} cannot be resumed: "
                         f"its metadata is not what jaxrec train writes ({'; '.join(problems)}); "
                         "start a new run with another --checkpoint-dir")


def _history(meta) -> dict:
    return {"train": meta["history"]["train"], "eval": meta["history"]["eval"]}


def _is_point(point) -> bool:
    return (isinstance(point, dict) and isinstance(point.get("step"), int)
            and all(v is None or isinstance(v, (int, float)) for v in point.values()))


def _set_aside_newer(directory: Path, step: int) -> dict[int, str]:
    """Renames the checkpoints newer than ``step`` (found corrupt: the restore skipped them)
    to ``<step>.corrupt``, so that the resumed run can save those steps again."""
    moved = {}
    for newer in [s for s in all_steps(directory) if s > step]:
        target = directory / f"{newer}.corrupt"
        for n in itertools.count(1):
            if not target.exists():
                break
            target = directory / f"{newer}.corrupt{n}"
        (directory / str(newer)).rename(target)
        moved[newer] = str(target)
    return moved


def _mean_finite(losses: list) -> float | None:
    """The mean of the finite losses (a skipped step's loss is NaN); None when none is."""
    values = np.asarray(jax.device_get(losses), np.float64)
    values = values[np.isfinite(values)]
    return float(values.mean()) if values.size else None


def _finite(value):
    """``value`` with NaN/Inf floats as None: metrics.json stays strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _last_eval(history: dict, prefix: str) -> dict[str, str]:
    if not history["eval"]:
        return {}
    return {prefix + (k.upper() if k == "auc" else k): f"{v:.4f}"
            for k, v in history["eval"][-1].items() if k not in ("step", "epoch") and v is not None}


def _host_copy(x):
    """A copy of ``x`` in host memory: NumPy, or for an array in host memory a copy there (a
    NumPy view of it would keep the next step from donating it, and the copy keeps its
    memory kind when it is restored)."""
    if isinstance(x, jax.Array) and in_host_memory(x):
        return jax.device_put(x, x.sharding, may_alias=False)
    return np.array(x)
