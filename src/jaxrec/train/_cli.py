"""``jaxrec train`` arguments -> ``TrainConfig`` -> ``train``."""

from __future__ import annotations

import argparse
import os
import sys

from jaxrec.parallel._multiprocess import ENV_NUM_PROCESSES
from jaxrec.train._config import (
    DENSE_OPTIMIZERS,
    MODELS,
    PATIENCE,
    PLACEMENTS,
    POSITIVE_THRESHOLD,
    RATINGS_VAL_FRACTION,
    RATINGS_WEIGHT_DECAY,
    RETRIEVAL_LOSSES,
    RETRIEVAL_WEIGHT_DECAY,
    TABLE_OPTIMIZERS,
    TASKS,
    TEMPERATURE,
    TOP_K,
    VOCABS,
    TrainConfig,
)


def _parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="jaxrec train", description="Train a recommendation model "
                                "end to end; writes OUT_DIR/metrics.json and OUT_DIR/curves.png.")
    p.add_argument("--task", choices=TASKS,
                   help="ctr (click data), ratings (movielens: rating prediction, the default) "
                        "or retrieval (movielens: top-K items per user from ratings >= "
                        "--positive-threshold; clicks: from the clicks, the default there)")
    p.add_argument("--model", choices=MODELS,
                   help="default: dlrm (click data), mf (movielens, clicks)")
    p.add_argument("--data", default=d.data,
                   help="synthetic | criteo:PATH (TSV file or folder) | movielens:PATH (ratings "
                        "file or ml-100k folder) | clicks:PATH (user, item, clicked 0/1, timestamp "
                        "lines: retrieval from the clicks) (default: %(default)s)")
    p.add_argument("--table-optimizer", choices=list(TABLE_OPTIMIZERS), default=d.table_optimizer,
                   help="fused optimizer of the tables, or plain (optax) (default: %(default)s)")
    p.add_argument("--table-lr", type=float, dest="table_learning_rate",
                   help="the tables' learning rate (default 0.1; retrieval 0.02)")
    p.add_argument("--dense-optimizer", choices=DENSE_OPTIMIZERS, default=d.dense_optimizer)
    p.add_argument("--dense-lr", type=float, default=d.dense_learning_rate, dest="dense_learning_rate")
    p.add_argument("--weight-decay", type=float,
                   help=f"movielens only: L2 on the embeddings each rating uses, per rating "
                        f"(default {RATINGS_WEIGHT_DECAY}; retrieval {RETRIEVAL_WEIGHT_DECAY})")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--steps", type=int, default=None, help=f"default {d.steps} unless --epochs")
    p.add_argument("--epochs", type=int, help="passes over a file (criteo, movielens)")
    p.add_argument("--embedding-dim", type=int, default=d.embedding_dim)
    p.add_argument("--max-rows", type=int, default=d.max_rows,
                   help="cap on every table's rows (Criteo: ids hashed modulo it; "
                   "MovieLens: dense ids folded, i %% max_rows)")
    p.add_argument("--vocab", choices=VOCABS, default=d.vocab,
                   help="click data: modulo hashes each categorical value to a row, value %% rows "
                        "(the default); dynamic gives each value its own raw id (Criteo: the hex "
                        "value itself, no modulo) and makes the 26 tables dynamic vocabularies of "
                        "the same rows (rounded down to buckets of 128, at least one bucket), inserting new ids while "
                        "training and evicting the least recently used; evaluation looks ids up "
                        "only (an unknown id embeds as zeros). Ids are int64 (a 32-bit Criteo "
                        "value bit-cast to int32 would turn half the values negative, which the "
                        "readers use for 'no id'), so the run turns on jax_enable_x64; the model "
                        "still computes in float32. A value of 2**63 or more is an error, never "
                        "folded (default: %(default)s)")
    p.add_argument("--placement", choices=PLACEMENTS, default=d.placement,
                   help="device keeps every table in device memory; host keeps each dense table "
                        "of at least two batches of ids of rows in host memory, each batch's rows "
                        "read over PCIe; host_cached keeps each dense table whose cache "
                        "(--cache-load-factor of its rows, in buckets of 128) is smaller than the "
                        "table and holds at least two batches of ids in host memory, with that "
                        "cache of its most recently used rows in device memory (default: %(default)s)")
    p.add_argument("--cache-load-factor", type=float, default=d.cache_load_factor,
                   help="--placement host_cached: each cache's rows as a share of its table's "
                        "(default: %(default)s)")
    p.add_argument("--tt-ranks", type=_ints, default=d.tt_ranks, metavar="R1,R2",
                   help="TT-compress the tables of >= --tt-min-rows rows with these ranks")
    p.add_argument("--tt-min-rows", type=int, default=d.tt_min_rows)
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="steps between evaluations; default: every epoch for movielens, else 250")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches,
                   help="click data: batches of the validation set and of the test set, each "
                        "(default: %(default)s)")
    p.add_argument("--val-fraction", type=float,
                   help=f"ratings only: share of the training ratings held out (by --seed) for "
                        f"validation, which the evaluations during training and early stopping "
                        f"read; 0: none (default {RATINGS_VAL_FRACTION})")
    p.add_argument("--patience", type=int,
                   help=f"stop after this many evaluations without a better validation metric; "
                        f"0: never stop early. The test set is evaluated once, at the end, with "
                        f"the best model (default {PATIENCE}; 0 with --val-fraction 0)")
    p.add_argument("--positive-threshold", type=float,
                   help=f"retrieval: ratings of at least this many stars are positives "
                        f"(default {POSITIVE_THRESHOLD:g})")
    p.add_argument("--retrieval-loss", choices=RETRIEVAL_LOSSES,
                   help="retrieval: in-batch sampled softmax with logQ correction (default), "
                        "or BPR against the batch's next row's item")
    p.add_argument("--temperature", type=float,
                   help=f"retrieval, softmax loss: logits = dot products / temperature "
                        f"(default {TEMPERATURE:g})")
    p.add_argument("--top-k", type=int,
                   help=f"retrieval: K of Recall@K (early stopping, best model), NDCG@K, "
                        f"HitRate@K, MRR@K (default {TOP_K})")
    p.add_argument("--side-features", action="store_const", const=True,
                   help="retrieval: the towers also embed the users' and movies' fields (age "
                        "group, gender, occupation; genres, decade) from u.user / u.item "
                        "(ML-100K) or users.dat / movies.dat (ML-1M) beside the ratings")
    p.add_argument("--checkpoint-dir")
    p.add_argument("--checkpoint-every", type=int, help="default: at each evaluation")
    p.add_argument("--resume", action="store_true", help="continue the newest checkpoint")
    p.add_argument("--out-dir", default=d.out_dir)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--backend", choices=("auto", "kernel", "reference"), default=d.backend)
    group = p.add_argument_group(
        "several processes", "one run over the devices of N processes (jax.distributed; "
        "docs/multiprocess.md): every process runs jaxrec train with the same flags. "
        "`jaxrec launch -n N -- train ...` starts them on one machine")
    group.add_argument("--distributed", action="store_true",
                       help="join the other processes of the run: JAX's cluster detection (SLURM, "
                            "Open MPI, Kubernetes-style environments) or the three flags below "
                            "(any of them implies --distributed)")
    group.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    group.add_argument("--num-processes", type=int, metavar="N")
    group.add_argument("--process-id", type=int, metavar="I")
    p.add_argument("--on-nonfinite", choices=("stop", "skip"), default=d.on_nonfinite,
                   help="a step with a NaN/Inf loss or gradient: stop the run (keeping the last "
                        "finite checkpoint), or skip its update and count it (default: "
                        "%(default)s)")
    return p


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    args = vars(_parser().parse_args(argv))
    distributed = args.pop("distributed")
    joining = {k: args.pop(k) for k in ("coordinator", "num_processes", "process_id")}
    if args["steps"] is None and args["epochs"] is None:
        args["steps"] = TrainConfig().steps
    try:
        config = TrainConfig(**args)
    except ValueError as e:
        print(f"jaxrec train: {e}", file=sys.stderr)
        return 2
    if distributed or any(v is not None for v in joining.values()) or ENV_NUM_PROCESSES in os.environ:
        from jaxrec.parallel import initialize_distributed

        initialize_distributed(joining["coordinator"], joining["num_processes"],
                               joining["process_id"])
    from jaxrec.train import _vocab
    from jaxrec.train._loop import TrainingStopped, train

    # Every way a run can fail ends in one clear message and a non-zero exit code.
    try:
        record = train(config)
    except TrainingStopped as e:  # metrics.json and curves.png are written (by process 0)
        print(f"jaxrec train: {e}", file=sys.stderr)
        if e.record["process"] == 0:
            print(f"wrote {config.out_dir}/metrics.json (status {e.record['status']}) and "
                  f"{config.out_dir}/curves.png", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"jaxrec train: interrupted; {config.out_dir}/metrics.json has the run so far",
              file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 (bad paths and files, the lock, a refused resume, ...)
        print(f"jaxrec train: {_one_line(e)}", file=sys.stderr)
        return 1
    import jax

    if jax.process_index() != 0:
        return 0  # process 0 says it
    final = ", ".join(f"{k} {v:.4f}" for k, v in record["final"].items())
    extra = record["data"].get("teacher_auc")
    ceiling = f" (the synthetic log's teacher reaches AUC {extra:.4f})" if extra else ""
    speed = record["train_samples_per_s"]
    test = record["test"]
    which = (f"the best validation model, step {test['step']}" if test["model"] == "best"
             else "the last model; no validation set")
    where = record["device"]
    if record["processes"] > 1:
        where = f"{record['devices']} devices ({where}) of {record['processes']} processes"
    print(f"{config.model} on {config.data}: {record['steps']} steps, test {final} ({which})"
          f"{ceiling}" + (f"; {speed:,.0f} samples/s on {where}" if speed else ""))
    popularity = record["data"].get("popularity_test")
    if popularity:
        print("popularity baseline (the most popular unseen items), test " + ", ".join(
            f"{k} {v:.4f}" for k, v in popularity.items()))
    if record["early_stop"]:
        stop = record["early_stop"]
        print(f"stopped early at step {stop['step']}: {stop['patience']} evaluations without a "
              f"better validation metric than step {stop['best_step']}'s (--patience)")
    if record.get("dynamic_vocab"):
        print(_vocab.summary(record["dynamic_vocab"]))
    if record.get("host_cache"):
        cache = record["host_cache"]
        print(f"host-cached tables ({len(cache['tables'])}): {cache['total']['size']:,} rows cached, "
              f"{cache['total']['inserted']:,} loaded (misses), {cache['total']['evicted']:,} written back")
    skipped = (record["step_stats"] or {}).get("nonfinite_steps")
    if skipped:
        print(f"skipped {skipped} non-finite steps (--on-nonfinite skip)")
    print(f"wrote {config.out_dir}/metrics.json and {config.out_dir}/curves.png")
    return 0


def _one_line(error: Exception) -> str:
    """The error's message; the type is named where the message alone would be unclear."""
    text = str(error) or type(error).__name__
    if isinstance(error, (ValueError, TypeError, OSError, RuntimeError)):
        return text
    return f"{type(error).__name__}: {text}"
