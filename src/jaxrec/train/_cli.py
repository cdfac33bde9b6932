"""``jaxrec train`` arguments -> ``TrainConfig`` -> ``train``."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jaxrec.train._config import DENSE_OPTIMIZERS, MODELS, TABLE_OPTIMIZERS, TrainConfig


def _parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="jaxrec train", description="Train a recommendation model "
                                "end to end; writes OUT_DIR/metrics.json and OUT_DIR/curves.png.")
    p.add_argument("--model", choices=MODELS, help="default: dlrm (click data), mf (movielens)")
    p.add_argument("--data", default=d.data,
                   help="synthetic | criteo:PATH (TSV file or folder) | movielens:PATH (ratings "
                        "file or ml-100k folder) (default: %(default)s)")
    p.add_argument("--table-optimizer", choices=list(TABLE_OPTIMIZERS), default=d.table_optimizer,
                   help="fused optimizer of the tables, or plain (optax) (default: %(default)s)")
    p.add_argument("--table-lr", type=float, default=d.table_learning_rate, dest="table_learning_rate")
    p.add_argument("--dense-optimizer", choices=DENSE_OPTIMIZERS, default=d.dense_optimizer)
    p.add_argument("--dense-lr", type=float, default=d.dense_learning_rate, dest="dense_learning_rate")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--steps", type=int, default=None, help=f"default {d.steps} unless --epochs")
    p.add_argument("--epochs", type=int, help="passes over a file (criteo, movielens)")
    p.add_argument("--embedding-dim", type=int, default=d.embedding_dim)
    p.add_argument("--max-rows", type=int, default=d.max_rows, help="cap on every table's rows")
    p.add_argument("--tt-ranks", type=_ints, default=d.tt_ranks, metavar="R1,R2",
                   help="TT-compress the tables of >= --tt-min-rows rows with these ranks")
    p.add_argument("--tt-min-rows", type=int, default=d.tt_min_rows)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--checkpoint-dir")
    p.add_argument("--checkpoint-every", type=int, help="default: at each evaluation")
    p.add_argument("--resume", action="store_true", help="continue the newest checkpoint")
    p.add_argument("--out-dir", default=d.out_dir)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--backend", choices=("auto", "kernel", "reference"), default=d.backend)
    return p


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    args = vars(_parser().parse_args(argv))
    if args["steps"] is None and args["epochs"] is None:
        args["steps"] = TrainConfig().steps
    try:
        config = TrainConfig(**args)
    except ValueError as e:
        print(f"jaxrec train: {e}", file=sys.stderr)
        return 2
    from jaxrec.train._loop import train

    try:
        record = train(config)
    except (FileNotFoundError, ValueError) as e:  # bad paths, files in the wrong format, ...
        print(f"jaxrec train: {e}", file=sys.stderr)
        return 1
    final = ", ".join(f"{k} {v:.4f}" for k, v in record["final"].items())
    extra = record["data"].get("teacher_auc")
    ceiling = f" (the synthetic log's teacher reaches AUC {extra:.4f})" if extra else ""
    speed = record["train_samples_per_s"]
    print(f"{config.model} on {config.data}: {record['steps']} steps, held-out {final}{ceiling}"
          + (f"; {speed:,.0f} samples/s on {record['device']}" if speed else ""))
    print(f"wrote {config.out_dir}/metrics.json and {config.out_dir}/curves.png")
    return 0

