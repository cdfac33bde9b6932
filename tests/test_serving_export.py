"""jaxrec.serving.export / load: a quantized DLRM exported for CPU and CUDA, loaded in a
fresh process, equals the in-memory model (exactly at a bucket's batch size); bad folders
are refused with the file and the fix."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrec import serving
from jaxrec.data import SyntheticClickLog
from jaxrec.models import DLRM
from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig

LOG = SyntheticClickLog(max_rows=500, seed=0)  # one id per feature: 26 per sample


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tables = [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=n, embedding_dim=8, feature_names=[k])
              for k, n in zip(LOG.keys, LOG.table_sizes)]
    model = DLRM(EmbeddingBagCollection(tables, rngs=nnx.Rngs(0)), LOG.num_dense, [16, 8], [16, 1],
                 rngs=nnx.Rngs(1))
    served, _ = serving.quantize(model, {"*": "int8", "t_" + LOG.keys[0]: "int4"})
    path = serving.export(served, tmp_path_factory.mktemp("served") / "dlrm", num_dense=LOG.num_dense,
                          keys=LOG.keys, ids_per_sample=26, batch_sizes=(1, 64))
    return served, path


def in_memory(served, batch):
    return np.asarray(jax.jit(lambda m, d, s: m(d, s))(served, batch.dense, batch.sparse))


def test_a_fresh_process_serves_what_the_model_computes(exported, tmp_path):
    served, path = exported
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["platforms"] == ["cpu", "cuda"] and set(manifest["buckets"]) == {"1", "64"}
    batch = next(LOG.batches(64, 1, start=500))
    np.save(tmp_path / "dense.npy", np.asarray(batch.dense))
    script = f"""
import numpy as np
from jaxrec.data import SyntheticClickLog
from jaxrec.serving import load
batch = next(SyntheticClickLog(max_rows=500, seed=0).batches(64, 1, start=500))
np.save("{tmp_path / 'out.npy'}", np.asarray(load("{path}")(batch.dense, batch.sparse)))
"""
    subprocess.run([sys.executable, "-c", script], check=True)
    got, expected = np.load(tmp_path / "out.npy"), in_memory(served, batch)
    if jax.default_backend() == "cpu":  # the same program on the same CPU: the same bits
        np.testing.assert_array_equal(got, expected)
    else:  # compiled apart on a GPU, the two programs agree to rounding (docs/serving.md)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_other_batch_sizes_go_through_the_buckets(exported):
    served, path = exported
    predict = serving.load(path)
    batch = next(LOG.batches(70, 1, start=1000))  # a full bucket of 64, then 6 padded to 64
    got = np.asarray(predict(batch.dense, batch.sparse))
    assert got.shape == (70, 1)
    np.testing.assert_allclose(got, in_memory(served, batch), rtol=1e-5, atol=1e-6)
    # The same request as host arrays, without a KJT: the same programs, the same bits.
    lengths, values = np.asarray(batch.sparse.lengths()), np.asarray(batch.sparse.values())
    np.testing.assert_array_equal(np.asarray(predict.predict_arrays(batch.dense, lengths, values)), got)
    small = next(LOG.batches(5, 1, start=2000))
    np.testing.assert_array_equal(
        np.asarray(predict.predict_arrays(small.dense, small.sparse.lengths(), small.sparse.values())),
        np.asarray(predict(small.dense, small.sparse)))
    with pytest.raises(ValueError, match=r"lengths must hold 26 keys x 70 samples = 1820 entries"):
        predict.predict_arrays(batch.dense, lengths[:-1], values)


def test_bad_calls_and_bad_folders_are_named(exported, tmp_path):
    _, path = exported
    batch = next(LOG.batches(4, 1))
    predict = serving.load(path)
    with pytest.raises(ValueError, match=r"dense must be \[B, 13\] float32 with B the KJT's 4 samples"):
        predict(np.asarray(batch.dense)[:3], batch.sparse)
    reordered = batch.sparse.permute([1, 0, *range(2, len(LOG.keys))])
    with pytest.raises(ValueError, match="are not the served model's"):
        predict(batch.dense, reordered)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in path.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    weights = copy / "weights.npz"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    with pytest.raises(ValueError, match=r"weights.npz does not match its checksum .*export the model again"):
        serving.load(copy)
    weights.write_bytes((path / "weights.npz").read_bytes())
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(ValueError, match=r"a version 99 serving folder; this jaxrec reads versions \(1, 2\)"):
        serving.load(copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        serving.load(copy)
