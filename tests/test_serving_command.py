"""``jaxrec export``: a small ``jaxrec train`` run exported, loaded in a fresh process, serves
what the in-memory quantized model computes; what it cannot export is refused naming the
argument, the value and the fix."""

import dataclasses
import json
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrec import serving
from jaxrec.__main__ import main
from jaxrec.checkpoint import save_checkpoint
from jaxrec.data import SyntheticClickLog
from jaxrec.serving._command import _verified, quantize_run, restore_run
from jaxrec.train import TrainConfig
from jaxrec.train._tasks import best_evaluation

# 6 steps of 64 samples, evaluated (and checkpointed) at steps 3 and 6.
TRAIN = ["train", "--steps", "6", "--batch-size", "64", "--max-rows", "200", "--embedding-dim", "8",
         "--eval-every", "3", "--eval-batches", "1"]
PRECISION = {"t_C1": "int4", "*": "int8"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = tmp_path_factory.mktemp("trained")
    assert main([*TRAIN, "--checkpoint-dir", str(base / "ckpt"), "--out-dir", str(base / "run")]) == 0
    return base


def test_a_fresh_process_serves_what_the_quantized_run_computes(trained, tmp_path, capsys):
    out = tmp_path / "served"
    out.mkdir()  # an earlier export, with a bucket this one does not have: replaced
    (out / "manifest.json").write_text(json.dumps({"format": "jaxrec-serving", "sha256": {"serve_8.bin": "0"}}))
    (out / "serve_8.bin").write_bytes(b"old")
    capsys.readouterr()
    assert main(["export", str(trained / "run"), str(out), "--precision", "t_C1=int4,*=int8",
                 "--batch-sizes", "64"]) == 0
    text = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "serve_64.bin", "weights.npz"]

    record = json.loads((trained / "run" / "metrics.json").read_text())
    run = restore_run(trained / "run")  # the model the run tested, as its test AUC says
    assert run.step == record["test"]["step"]
    test = run.task.evaluate(nnx.jit(run.task.predict), run.task.test_batches)
    assert test["auc"] == pytest.approx(record["final"]["auc"], abs=1e-6)
    served, report = serving.quantize(run.model, PRECISION)
    assert f"checkpoint step {run.step} of {trained / 'ckpt'}" in text
    assert f"25 int8, int4 t_C1; {report.bytes_before:,} -> {report.bytes_after:,} bytes" in text
    assert "26 ids per sample" in text

    script = f"""
import numpy as np
from jaxrec.data import SyntheticClickLog
from jaxrec.serving import load
batch = next(SyntheticClickLog(max_rows=200, seed=0).batches(64, 1, start=123))
np.save("{tmp_path / 'out.npy'}", np.asarray(load("{out}")(batch.dense, batch.sparse)))
"""
    subprocess.run([sys.executable, "-c", script], check=True)
    batch = next(SyntheticClickLog(max_rows=200, seed=0).batches(64, 1, start=123))
    got = np.load(tmp_path / "out.npy")
    expected = np.asarray(jax.jit(lambda m, d, s: m(d, s))(served, batch.dense, batch.sparse))
    if jax.default_backend() == "cpu":  # the same program on the same CPU: the same bits
        np.testing.assert_array_equal(got, expected)
    else:  # equal to rounding on a GPU (docs/serving.md)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_which_checkpoint_is_exported(trained):
    history = json.loads((trained / "run" / "metrics.json").read_text())["history"]["eval"]
    best = best_evaluation("ctr", history)["step"]
    run = restore_run(trained / "ckpt")  # the checkpoint directory: its best validation model
    assert (run.step, run.chosen) == (best, "the best validation model")
    assert run.recorded == next(e for e in history if e["step"] == best)
    assert restore_run(trained / "ckpt" / "3").step == 3  # a step folder: that one
    assert restore_run(trained / "ckpt", step=3).step == 3  # --step
    # A restored model whose validation AUC is not the run's record is refused.
    with pytest.raises(ValueError, match=r"the restored model's validation AUC is 0\.\d+, the run "
                                         r"recorded 0\.10000 at that step: the rebuilt model is not"):
        _verified(dataclasses.replace(run, recorded={**run.recorded, "auc": 0.1}))


def _checkpoint(path, config: dict | None):
    """A checkpoint of one array whose metadata holds ``config`` (as jaxrec train saves it)."""
    meta = {"step": 1, "data_position": 1, "history": {"train": [], "eval": []}}
    save_checkpoint(path, 1, {"x": np.zeros(1, np.float32)},
                    metadata=meta if config is None else {**meta, "config": config})
    return path


def _config(**changes):
    return json.loads(json.dumps(dataclasses.asdict(TrainConfig(**changes))))


def _not_a_run(trained, tmp):
    (tmp / "notes.txt").write_text("mine")
    return tmp


def _no_checkpoint(trained, tmp):
    record = json.loads((trained / "run" / "metrics.json").read_text())
    record.update(test={}, config=_config(checkpoint_dir=None))  # a run without --checkpoint-dir
    (tmp / "metrics.json").write_text(json.dumps(record))
    return tmp


def _corrupt(trained, tmp):
    shutil.copytree(trained / "ckpt", tmp / "ckpt")
    (tmp / "ckpt" / "3" / "manifest" / "metadata").write_bytes(b"{")
    return tmp / "ckpt" / "3"


BAD_RUNS = {
    "missing": (lambda t, tmp: tmp / "nowhere", r"CHECKPOINT '.*nowhere' does not exist: pass the --out-dir"),
    "not a run": (_not_a_run, r"is not a jaxrec run \(no metrics.json, no checkpoint step folders\)"),
    "no checkpoint saved": (_no_checkpoint, r"this run saved no checkpoint \(it ran without --checkpoint-dir\)"
                                            r".*train again with --checkpoint-dir"),
    "not jaxrec train's": (lambda t, tmp: _checkpoint(tmp / "c", None),
                           r"was not written by jaxrec train \(its metadata has no 'config'\)"),
    "retrieval": (lambda t, tmp: _checkpoint(tmp / "c", _config(data="movielens:ml", task="retrieval")),
                  r"is a --task retrieval run of --model mf; jaxrec export serves click-through models: "
                  r"--task ctr with --model dlrm or dcn"),
    "tt tables": (lambda t, tmp: _checkpoint(tmp / "c", _config(tt_ranks=(4, 4))),
                  r"TT-compressed its tables .*\(--tt-ranks 4,4\).*train without --tt-ranks"),
    "dynamic tables": (lambda t, tmp: _checkpoint(tmp / "c", _config(vocab="dynamic")),
                       r"trained dynamic-vocabulary tables \(--vocab dynamic\), which serving does not "
                       r"support yet .*train with --vocab modulo to export the model"),
    "data gone": (lambda t, tmp: _checkpoint(tmp / "c", _config(data=f"criteo:{tmp / 'gone.tsv'}")),
                  r"the run's data 'criteo:.*gone.tsv' cannot be read .*run it where that path exists"),
    "corrupt": (_corrupt, r"checkpoint step=3 in .* is corrupt"),
}


@pytest.mark.parametrize("case", BAD_RUNS)
def test_what_cannot_be_exported_is_refused(trained, tmp_path, capsys, case):
    make, message = BAD_RUNS[case]
    (tmp_path / "in").mkdir()
    source = make(trained, tmp_path / "in")
    assert main(["export", str(source), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("jaxrec export: ") and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()


BAD_ARGUMENTS = {
    "unknown table": (["--precision", "t_nope=int4,*=int8"], 1,
                      r"--precision 't_nope=int4,\*=int8' names t_nope, which this model lacks; its tables "
                      r"are t_C1, t_C2, "),
    "unknown step": (["--step", "5"], 1, r"--step 5: .*ckpt holds the checkpoints of steps \[3, 6\]; pass one"),
    "out taken": (["OUT_TAKEN"], 1, r"OUT '.*' holds files and is not a serving folder: pass a new or empty"),
    "precision": (["--precision", "int2"], 2, r"argument --precision: 'int2' is not one of fp32, .*int8, int4"),
    "twice": (["--precision", "int8,*=int4"], 2, r"argument --precision: .*gives table '\*' twice"),
    "batch sizes": (["--batch-sizes", "64,0"], 2,
                    r"argument --batch-sizes: expected comma-separated ints >= 1 \(e.g. 1,64,1024\), got '64,0'"),
}


@pytest.mark.parametrize("case", BAD_ARGUMENTS)
def test_bad_arguments_are_named(trained, tmp_path, capsys, case):
    flags, code, message = BAD_ARGUMENTS[case]
    out = tmp_path / "out"
    if flags == ["OUT_TAKEN"]:
        flags = []
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    if code == 2:
        with pytest.raises(SystemExit) as exit_:
            main(["export", str(trained / "ckpt"), str(out), *flags])
        assert exit_.value.code == 2
    else:
        assert main(["export", str(trained / "ckpt"), str(out), *flags]) == 1
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert not out.exists() or [p.name for p in out.iterdir()] == ["notes.txt"]


def test_a_table_its_precision_cannot_hold_is_named_with_the_fix(trained):
    run = restore_run(trained / "ckpt")
    collection = run.collections[0]
    weights = np.array(collection.split_embedding_weights()["t_C2"])
    weights[0, 0] = 1e5  # beyond what a float16 scale and bias hold
    collection.set_embedding_weights({"t_C2": weights})
    with pytest.raises(ValueError, match=r"--precision 'int8': table t_C2: weights reach 100000; .* keep such "
                                         r"a table in fp32; e.g. --precision t_C2=fp32,\*=int8"):
        quantize_run(run, {"*": "int8"}, "int8")


def test_the_jaxrec_command_lists_export_and_its_help(capsys):
    for argv in (["--help"], ["export", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "jaxrec export a trained run's model" in out
    assert "usage: jaxrec export" in out and "--precision" in out and "--batch-sizes" in out
