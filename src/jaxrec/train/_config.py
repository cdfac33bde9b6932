"""``TrainConfig``: everything ``jaxrec train`` can be told, checked before any work starts."""

from __future__ import annotations

import dataclasses
import json

from jaxrec import optim
from jaxrec.data import MOVIELENS_RATING_RANGE

MODELS = ("dlrm", "dcn", "mf", "two_tower")
NONFINITE_POLICIES = {"stop": "raise", "skip": "skip"}  # -> the train step's on_nonfinite
CTR_MODELS, RATING_MODELS = ("dlrm", "dcn"), ("mf", "two_tower")
TASKS = ("ctr", "ratings", "retrieval")  # ctr: click data; ratings, retrieval: movielens
RETRIEVAL_LOSSES = ("softmax", "bpr")
PLACEMENTS = ("device", "host", "host_cached")  # where the tables live (jaxrec.nn.EmbeddingBagConfig.placement)
VOCABS = ("modulo", "dynamic")  # click data's values: hashed modulo the rows, or raw ids (_vocab.py)
DENSE_OPTIMIZERS = ("adam", "adagrad", "sgd")
# Table optimizers by FBGEMM's names (lower case, without EXACT_); "plain" keeps the tables
# as nnx.Param and lets the dense optax optimizer train them from dense gradients.
TABLE_OPTIMIZERS = {
    "rowwise_adagrad": optim.RowWiseAdagrad,
    "adagrad": optim.Adagrad,
    "sgd": optim.SGD,
    "adam": optim.Adam,
    "partial_rowwise_adam": optim.PartialRowWiseAdam,
    "lamb": optim.LAMB,
    "partial_rowwise_lamb": optim.PartialRowWiseLAMB,
    "lars_sgd": optim.LarsSGD,
    "plain": None,
}
# What a resumed run may not change: the model's structure, or which data it trains on
# next (eval_batches too: Criteo's first eval_batches batches are held out, not trained).
# val_fraction too: it moves ratings between the training and the validation set.
# Retrieval: the task and positive_threshold change the training pairs, retrieval_loss
# the objective, top_k the metrics that the curve and early stopping compare.
RESUME_MUST_MATCH = ("data", "task", "model", "seed", "table_optimizer", "dense_optimizer",
                     "batch_size", "embedding_dim", "max_rows", "tt_ranks", "tt_min_rows",
                     "eval_batches", "val_fraction", "positive_threshold", "retrieval_loss",
                     "top_k", "side_features", "vocab", "placement", "cache_load_factor")
# A setting that a checkpoint written before its flag existed ran with (the one behaviour then).
RESUME_MISSING = {"vocab": "modulo", "placement": "device", "cache_load_factor": 0.2}
# Applied to the restored state (the rates), read by the loss each step (weight_decay,
# temperature), or by the loop at each evaluation (patience: the count restarts from the
# restored curve).
RESUME_APPLIED = ("table_learning_rate", "dense_learning_rate", "weight_decay", "temperature",
                  "patience")
RATINGS_WEIGHT_DECAY = 0.1  # measured: benchmarks/movielens_defaults.py, docs/nn.md
RATINGS_VAL_FRACTION = 0.1  # of the training ratings
PATIENCE = 10  # measured: benchmarks/movielens_defaults.py, docs/nn.md
DATA_KINDS = ("synthetic", "criteo", "movielens", "clicks")
USER_ITEM_KINDS = ("movielens", "clicks")  # data with user and item ids
POSITIVE_THRESHOLD = 4.0  # stars: 4 and 5 are positives, as in most MovieLens retrieval papers
TEMPERATURE = 1.0  # measured: benchmarks/movielens_retrieval.py, docs/nn.md
TOP_K = 10
TABLE_LEARNING_RATE = {"retrieval": 0.02}  # else 0.1; measured: benchmarks/movielens_retrieval.py
RETRIEVAL_WEIGHT_DECAY = 0.0  # measured: benchmarks/movielens_retrieval.py, docs/nn.md


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run (the defaults: DLRM on the synthetic click log, < 2 min on a CPU)."""

    task: str | None = None
    """ctr (click data, the only task there), ratings (movielens: rating prediction, the
    default) or retrieval (movielens: top-K items per user from implicit feedback)."""
    model: str | None = None
    """dlrm, dcn (click data) or mf, two_tower (ratings, retrieval); default dlrm, or mf
    for movielens. Retrieval: mf is the dot product of the id embeddings (no biases),
    two_tower adds an MLP tower on each side."""
    data: str = "synthetic"
    """synthetic, criteo:PATH (a TSV file or a folder of them) or movielens:PATH (a ratings
    file, or the ml-100k folder: split u1)."""
    table_optimizer: str = "rowwise_adagrad"
    """The fused optimizer of the tables (TABLE_OPTIMIZERS), or plain."""
    table_learning_rate: float | None = None
    """Default 0.1 (retrieval: 0.02)."""
    dense_optimizer: str = "adam"
    dense_learning_rate: float = 3e-3
    weight_decay: float | None = None
    """Movielens only (ratings: default 0.1; retrieval: default 0): L2 on the embeddings
    each rating (or positive pair) uses (mf: its user's and item's rows, factors and bias),
    added to its loss; a resumed run takes a new value. Refused for click data, whose
    models train without it."""
    batch_size: int = 1024
    steps: int | None = 2500
    """Training steps; None: ``epochs`` passes over a file (synthetic data needs steps)."""
    epochs: int | None = None
    embedding_dim: int = 16
    max_rows: int = 20_000
    """Caps every table (Criteo ids are hashed modulo the table size; MovieLens dense ids
    fold, ``i % max_rows``)."""
    vocab: str = "modulo"
    """Click data: ``modulo`` (each value hashed modulo its table's rows) or ``dynamic``
    (each value its own raw int64 id, the tables dynamic vocabularies of the same rows
    rounded down to buckets of 128, at least one, LRU eviction; the run turns on ``jax_enable_x64``).
    ``_vocab.py``."""
    placement: str = "device"
    """``device``, ``host`` or ``host_cached`` (docs/host_memory.md, ``_task_base.placed``):
    ``host`` places each dense (not TT, not dynamic) table of at least two batches' ids of
    rows in host memory, each batch's rows read over PCIe; ``host_cached`` places each dense
    table whose cache of ``cache_load_factor`` of its rows is smaller than the table and
    holds two batches of ids in host memory, with that cache in device memory. The other
    tables stay on the device."""
    cache_load_factor: float = 0.2
    tt_ranks: tuple[int, ...] = ()
    """TT-compress (FBTT) every table of at least ``tt_min_rows`` rows with these inner
    ranks, e.g. (8, 8) for three cores; () keeps all tables dense. A TT table trains with
    fused Adagrad (SGD when table_optimizer is sgd; plain optax when it is plain)."""
    tt_min_rows: int = 10_000
    eval_every: int | None = None
    """Steps between evaluations (on the validation set); None: at the end of every pass
    over the training ratings (movielens), else every 250 steps (click data)."""
    eval_batches: int = 4
    """Click data: batches of the validation set and of the test set (each); ratings use
    all of both sets."""
    val_fraction: float | None = None
    """Ratings only (default 0.1): the share of the training ratings held out, by seed, as
    the validation set that the evaluations during training and early stopping read; 0:
    none (the evaluations read the test set, and there is no early stopping). Click data
    always holds out ``eval_batches`` validation batches; refused there."""
    patience: int | None = None
    """Evaluations without a better validation metric before the run stops (default 10,
    or 0 without a validation set); 0: never stop early. The test set is evaluated once, at
    the end, with the model of the best validation evaluation."""
    positive_threshold: float | None = None
    """Retrieval only (default 4): a rating of at least this many stars is a positive
    (user, item) pair; the other ratings are dropped from every split."""
    retrieval_loss: str | None = None
    """Retrieval only: "softmax" (default: in-batch sampled softmax with the logQ
    correction by the items' frequency in the training positives) or "bpr" (the batch's
    candidates shifted by one row are the negatives)."""
    temperature: float | None = None
    """Retrieval with the softmax loss (default 1): the logits are the dot products
    divided by it; a resumed run takes a new value."""
    top_k: int | None = None
    """Retrieval only (default 10): K of Recall@K, NDCG@K, HitRate@K and MRR@K; early
    stopping and the best model follow Recall@K."""
    side_features: bool | None = None
    """Retrieval only (default False): the towers also embed the users' and movies' fields
    (``jaxrec.data.load_movielens_side_features``: ML-100K's u.user and u.item, or ML-1M's
    users.dat and movies.dat, beside the ratings)."""
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    """Steps between checkpoints; default: at each evaluation."""
    resume: bool = False
    """Continue from the newest checkpoint in ``checkpoint_dir``."""
    out_dir: str = "jaxrec-run"
    """Where metrics.json and curves.png go."""
    seed: int = 0
    backend: str = "auto"
    on_nonfinite: str = "stop"
    """A step whose loss or gradient is NaN/Inf: "stop" the run (the model and the last
    checkpoint keep the finite state from before it), or "skip" its update and count it."""

    def __post_init__(self):
        kind = self.data.split(":", 1)[0]
        if kind not in DATA_KINDS or (kind != "synthetic") != (":" in self.data):
            raise ValueError(f"data must be 'synthetic', 'criteo:PATH', 'movielens:PATH' or "
                             f"'clicks:PATH', got {self.data!r}")
        user_item = kind in USER_ITEM_KINDS
        task = self.task or {"movielens": "ratings", "clicks": "retrieval"}.get(kind, "ctr")
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        fits = {"movielens": ("ratings", "retrieval"), "clicks": ("retrieval",)}.get(kind, ("ctr",))
        if task not in fits:
            labels = {"movielens": "ratings", "clicks": "clicks of users on items"}.get(
                kind, "clicks, without user and item ids")
            raise ValueError(f"task {task!r} does not fit data {kind!r} (its labels are {labels}); "
                             f"pass --task {' or '.join(fits)}, or drop --task")
        object.__setattr__(self, "task", task)
        model = self.model or ("mf" if user_item else "dlrm")
        if model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        if user_item != (model in RATING_MODELS):
            fit = RATING_MODELS if user_item else CTR_MODELS
            raise ValueError(f"model {model!r} does not fit data {kind!r} (labels are "
                             f"{'of users on items' if user_item else 'clicks'}); use one of {fit}")
        object.__setattr__(self, "model", model)
        if self.table_optimizer not in TABLE_OPTIMIZERS:
            raise ValueError(f"table_optimizer must be one of {list(TABLE_OPTIMIZERS)}, got "
                             f"{self.table_optimizer!r}")
        if self.dense_optimizer not in DENSE_OPTIMIZERS:
            raise ValueError(f"dense_optimizer must be one of {DENSE_OPTIMIZERS}, got "
                             f"{self.dense_optimizer!r}")
        object.__setattr__(self, "tt_ranks", tuple(self.tt_ranks))
        if not 0 <= len(self.tt_ranks) <= 3 or not all(
                isinstance(r, int) and r >= 1 for r in self.tt_ranks):
            raise ValueError(f"tt_ranks must be () or 1 to 3 ints >= 1, got {self.tt_ranks!r}")
        for name in ("batch_size", "embedding_dim", "max_rows", "eval_batches", "tt_min_rows"):
            _int_at_least(name, getattr(self, name))
        for name in ("steps", "epochs", "checkpoint_every", "eval_every"):
            if getattr(self, name) is not None:
                _int_at_least(name, getattr(self, name))
        if self.steps is None and self.epochs is None:
            raise ValueError("give steps or epochs (how long to train)")
        if self.steps is None and kind == "synthetic":
            raise ValueError("the synthetic log is endless: give steps, not epochs")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs checkpoint_dir (where the checkpoints are)")
        if self.table_learning_rate is None:
            object.__setattr__(self, "table_learning_rate", TABLE_LEARNING_RATE.get(task, 0.1))
        for name in ("table_learning_rate", "dense_learning_rate"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        if self.weight_decay is not None and not user_item:
            raise ValueError(f"weight_decay applies to ratings (movielens data); the click "
                             f"models train without it, so {self.weight_decay} would do nothing. "
                             "Drop --weight-decay")
        if self.weight_decay is None and user_item:
            object.__setattr__(self, "weight_decay",
                               RATINGS_WEIGHT_DECAY if task == "ratings" else RETRIEVAL_WEIGHT_DECAY)
        if self.weight_decay is not None and not 0 <= self.weight_decay < float("inf"):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.val_fraction is not None and not user_item:
            raise ValueError(f"val_fraction applies to ratings (movielens data); click data holds "
                             f"out --eval-batches batches for validation instead, so "
                             f"{self.val_fraction} would do nothing. Drop --val-fraction")
        if self.val_fraction is None and user_item:
            object.__setattr__(self, "val_fraction", RATINGS_VAL_FRACTION)
        if self.val_fraction is not None and not (
                isinstance(self.val_fraction, (int, float)) and 0 <= self.val_fraction < 1):
            raise ValueError(f"val_fraction must be a number in [0, 1), got {self.val_fraction!r}: "
                             "pass e.g. --val-fraction 0.1 (a tenth of the training ratings), or "
                             "0 for no validation set")
        if self.patience is not None:
            _int_at_least("patience", self.patience, 0, "pass the number of evaluations without "
                          "improvement before the run stops (e.g. --patience 3), or 0 to never "
                          "stop early")
        if self.patience and not self.has_validation:
            raise ValueError(f"patience {self.patience} needs a validation set, and val_fraction "
                             "is 0: pass --val-fraction > 0 (e.g. 0.1), or --patience 0")
        if self.patience is None:
            object.__setattr__(self, "patience", PATIENCE if self.has_validation else 0)
        self._check_retrieval()
        self._check_vocab()
        self._check_placement()
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite must be one of {tuple(NONFINITE_POLICIES)}, got "
                             f"{self.on_nonfinite!r}")

    def _check_retrieval(self) -> None:
        """The retrieval flags: refused for the other tasks, defaulted and checked here."""
        names = ("positive_threshold", "retrieval_loss", "temperature", "top_k", "side_features")
        if self.task != "retrieval":
            given = [flag(n) for n in names if getattr(self, n) is not None]
            if given:
                verb = "apply" if len(given) > 1 else "applies"
                raise ValueError(f"{', '.join(given)} {verb} to --task retrieval (movielens "
                                 f"data), and this run's task is {self.task}: drop them, or "
                                 "pass --task retrieval")
            return
        threshold = self.positive_threshold
        if self.data_kind == "clicks":
            if threshold is not None:
                raise ValueError("--positive-threshold applies to ratings; a click log's positives "
                                 "are its clicks (clicked = 1): drop --positive-threshold")
            threshold = 1.0
        if threshold is None:
            threshold = POSITIVE_THRESHOLD
        low, high = MOVIELENS_RATING_RANGE
        if not (isinstance(threshold, (int, float)) and low < threshold <= high):
            raise ValueError(f"positive_threshold must be a number of stars in ({low}, {high}], "
                             f"got {threshold!r}: pass e.g. --positive-threshold 4 (ratings of 4 "
                             "and 5 are positives)")
        loss = self.retrieval_loss or "softmax"
        if loss not in RETRIEVAL_LOSSES:
            raise ValueError(f"retrieval_loss must be one of {RETRIEVAL_LOSSES}, got {loss!r}")
        temperature = self.temperature
        if temperature is not None and loss != "softmax":
            raise ValueError(f"temperature applies to --retrieval-loss softmax, and the loss is "
                             f"{loss}, whose margins have no temperature: drop --temperature")
        if temperature is None and loss == "softmax":
            temperature = TEMPERATURE
        if temperature is not None and not 0 < temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}: "
                             f"pass e.g. --temperature {TEMPERATURE}")
        top_k = TOP_K if self.top_k is None else self.top_k
        _int_at_least("top_k", top_k, 1, "pass e.g. --top-k 10")
        for name, value in (("positive_threshold", float(threshold)), ("retrieval_loss", loss),
                            ("temperature", temperature), ("top_k", top_k),
                            ("side_features", bool(self.side_features))):
            object.__setattr__(self, name, value)

    def _check_vocab(self) -> None:
        """``vocab``: one of ``VOCABS``; dynamic tables need click data, fused dense tables."""
        if self.vocab not in VOCABS:
            raise ValueError(f"vocab must be one of {VOCABS}, got {self.vocab!r}")
        if self.vocab == "modulo":
            return
        why = None
        if self.data_kind not in ("synthetic", "criteo"):
            why = (f"applies to click data (criteo:PATH, synthetic); {self.data_kind} ids are "
                   "re-indexed densely, each its own row up to --max-rows: drop --vocab")
        elif self.table_optimizer == "plain":
            why = ("needs a fused table optimizer (a new id's row and optimizer state are reset "
                   "inside the step, which optax's state cannot follow): drop --table-optimizer "
                   "plain (the default is rowwise_adagrad)")
        elif self.tt_ranks:
            why = "makes every table a dynamic vocabulary, and a table is either TT or dynamic: drop --tt-ranks"
        if why:
            raise ValueError(f"--vocab dynamic {why}")

    def _check_placement(self) -> None:
        """``placement``: one of ``PLACEMENTS``; host-cached tables need a fused optimizer."""
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        factor = self.cache_load_factor
        if not (isinstance(factor, (int, float)) and 0 < factor <= 1):
            raise ValueError(f"cache_load_factor must lie in (0, 1], got {factor!r}: pass e.g. "
                             "--cache-load-factor 0.2")
        if self.placement == "device":
            return
        if self.table_optimizer == "plain":
            raise ValueError(f"--placement {self.placement} needs a fused table optimizer (a row's "
                             "optimizer state moves with it between host and device): drop "
                             "--table-optimizer plain (the default is rowwise_adagrad)")
        if self.vocab == "dynamic":
            raise ValueError(f"--placement {self.placement} places dense tables, and --vocab dynamic makes "
                             "every table a dynamic vocabulary: drop one of them")

    def resume_differences(self, saved: dict) -> tuple[list[str], list[str]]:
        """``(refused, applied)``: this config's differences from a checkpoint's ``saved``
        config (``dataclasses.asdict`` of a ``TrainConfig``), as ``"--flag old -> new"``.

        A field that shapes the model or the data stream (``RESUME_MUST_MATCH``) cannot
        change in a resumed run (refused); a learning rate can (applied); the rest (how
        long, how often to evaluate, where to write) is free. A field missing from
        ``saved`` counts as a difference, unless ``RESUME_MISSING`` gives the value that
        checkpoints written before it existed ran with.
        """
        mine = json.loads(json.dumps(dataclasses.asdict(self)))  # tuples -> lists, as saved
        missing = object()
        refused, applied = [], []
        for names, out in ((RESUME_MUST_MATCH, refused), (RESUME_APPLIED, applied)):
            for name in names:
                old = saved.get(name, RESUME_MISSING.get(name, missing))
                if old != mine[name]:
                    old = "(not recorded)" if old is missing else _show(old)
                    out.append(f"{flag(name)} {old} -> {_show(mine[name])}")
        return refused, applied

    @property
    def has_validation(self) -> bool:
        """Whether evaluations during training read a validation set (else the test set)."""
        return self.data_kind not in USER_ITEM_KINDS or self.val_fraction != 0

    @property
    def data_kind(self) -> str:
        return self.data.split(":", 1)[0]

    @property
    def data_path(self) -> str | None:
        return self.data.split(":", 1)[1] if ":" in self.data else None


def flag(name: str) -> str:
    """The ``jaxrec train`` flag of a ``TrainConfig`` field."""
    return {"table_learning_rate": "--table-lr", "dense_learning_rate": "--dense-lr"}.get(
        name, "--" + name.replace("_", "-"))


def _show(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _int_at_least(name: str, value, minimum: int = 1, fix: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}" + (f": {fix}" if fix else ""))
