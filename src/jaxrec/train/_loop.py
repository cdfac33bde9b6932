"""The training loop of ``jaxrec train``: steps, evaluations, checkpoints, resume, outputs."""

from __future__ import annotations

import dataclasses
import itertools
import json
import platform
import time
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

import jaxrec
from jaxrec.checkpoint import latest_step, restore_checkpoint, save_checkpoint
from jaxrec.data import Prefetcher
from jaxrec.nn import PartitionedOptimizer, make_train_step
from jaxrec.train._config import TrainConfig
from jaxrec.train._plot import plot_curves
from jaxrec.train._progress import Progress
from jaxrec.train._tasks import build_task

_DENSE = {"adam": optax.adam, "adagrad": optax.adagrad, "sgd": optax.sgd}
_LOG_EVERY = 50  # steps between training-loss points (and progress lines off a terminal)


def train(config: TrainConfig) -> dict:
    """Runs ``config``; returns (and writes to ``out_dir/metrics.json``) the run's record."""
    task = build_task(config)
    model = task.model
    optimizer = PartitionedOptimizer(model, _DENSE[config.dense_optimizer](config.dense_learning_rate))
    train_step = make_train_step(task.loss_fn)
    predict = nnx.jit(task.predict)
    history: dict = {"train": [], "eval": []}
    step = 0
    if config.resume:
        step, history = _resume(config, model, optimizer)
    total = config.steps or (config.epochs * task.steps_per_epoch if task.steps_per_epoch else None)
    checkpoint_every = config.checkpoint_every or config.eval_every
    progress = Progress(total, every=_LOG_EVERY)
    status = {"loss": "-", **_last_eval(history)}
    losses, timed_steps, timed_s = [], 0, 0.0
    tick = time.perf_counter()
    batches = task.train_batches(step)
    if total is not None:
        batches = itertools.islice(batches, max(total - step, 0))
    with Prefetcher(batches, buffer_size=4) as stream:
        for batch in stream:
            losses.append(train_step(model, optimizer, batch))
            step += 1
            if step % _LOG_EVERY == 0 or step == total:
                loss = float(np.mean(jax.device_get(losses)))  # waits for the device
                now = time.perf_counter()
                if history["train"] or len(losses) < step:  # not the interval that compiled
                    timed_steps, timed_s = timed_steps + len(losses), timed_s + now - tick
                history["train"].append({"step": step, "loss": loss})
                losses, tick = [], now
                status["loss"] = f"{loss:.4f}"
                if timed_s:
                    status["samples/s"] = f"{config.batch_size * timed_steps / timed_s:,.0f}"
            if step % config.eval_every == 0 or step == total:
                history["eval"].append({"step": step, **task.evaluate(predict)})
                status.update(_last_eval(history))
                tick = time.perf_counter()  # evaluation time is not training time
            if config.checkpoint_dir and (step % checkpoint_every == 0 or step == total):
                _save(config, model, optimizer, step, history)
                tick = time.perf_counter()
            progress.update(step, status)
    if not history["eval"] or history["eval"][-1]["step"] != step:
        history["eval"].append({"step": step, **task.evaluate(predict)})
    if config.checkpoint_dir and latest_step(config.checkpoint_dir) != step:
        _save(config, model, optimizer, step, history)
    progress.update(step, {**status, **_last_eval(history)}, force=True)
    progress.close()
    record = {
        "config": dataclasses.asdict(config),
        "device": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "versions": {"jaxrec": jaxrec.__version__, "jax": jax.__version__,
                     "python": platform.python_version()},
        "data": task.info,
        "steps": step,
        "train_samples_per_s": config.batch_size * timed_steps / timed_s if timed_s else None,
        "final": {k: v for k, v in history["eval"][-1].items() if k != "step"},
        "history": history,
    }
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(record, indent=2) + "\n")
    plot_curves(history, out / "curves.png", f"{config.model} on {config.data}")
    return record


def _last_eval(history: dict) -> dict[str, str]:
    if not history["eval"]:
        return {}
    return {k.upper() if k == "auc" else k: f"{v:.4f}"
            for k, v in history["eval"][-1].items() if k != "step"}


def _state(model, optimizer):
    return {"model": nnx.state(model), "opt_state": optimizer.opt_state}


def _save(config, model, optimizer, step, history) -> None:
    # One batch per step, so the data position is the step; both are saved, so that a
    # future loader with other batch accounting can still find its place.
    save_checkpoint(config.checkpoint_dir, step, _state(model, optimizer), keep=3,
                    metadata={"step": step, "data_position": step, "history": history,
                              "config": dataclasses.asdict(config)})


def _resume(config, model, optimizer) -> tuple[int, dict]:
    if latest_step(config.checkpoint_dir) is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {config.checkpoint_dir!r}; run without "
                                "--resume to start a new run there")
    state, meta = restore_checkpoint(config.checkpoint_dir, _state(model, optimizer))
    nnx.update(model, state["model"])
    optimizer.opt_state = state["opt_state"]
    optimizer.step = meta["step"]
    return meta["data_position"], meta["history"]
