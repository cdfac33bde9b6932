"""``export`` a served model as ``jax.export`` artifacts with its weights; ``load`` it back in
a fresh process, with nothing but jaxrec installed.

::

    served, _ = quantize(model, "int8")
    export(served, "dlrm-served", num_dense=13, keys=log.keys, ids_per_sample=26)
    # elsewhere:
    predict = load("dlrm-served")
    scores = predict(dense, kjt)              # dense [B, 13], a KeyedJaggedTensor of B samples

The folder holds ``manifest.json`` (format, version, keys, buckets, SHA-256 of every
file), ``weights.npz`` (the model's arrays, flat) and one serialized ``jax.export``
artifact per batch-size bucket (``serve_<B>.bin``), each lowered for every platform of
``platforms`` (CPU and CUDA by default). A call pads its batch to the smallest bucket
that holds it (``batch_sizes``, default 1, 64, 1024, 4096; larger batches are served in
pieces). Each bucket takes at most ``ids_per_sample * B`` ids; a batch with more is an
error that says so. The function exported is ``call(model, dense, sparse)``, by default
``model(dense, sparse)`` (DLRM, DLRM_DCN); the model's arrays are its arguments, not
constants, so one set of weights serves every bucket.

``load`` checks the format and version (a newer artifact is refused with the version it
needs), every file's checksum (a corrupted or truncated file is named), and the shapes
of the weights against what the artifacts expect.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrec import _ffi
from jaxrec.sparse import KeyedJaggedTensor

FORMAT = "jaxrec-serving"
VERSION = 2  # 2: the artifacts call jaxrec's kernels (custom calls); 1: jnp only
READABLE_VERSIONS = (1, 2)
BATCH_SIZES = (1, 64, 1024, 4096)


def export(model: nnx.Module, path: str | os.PathLike, *, num_dense: int, keys: Sequence[str],
           ids_per_sample: int, weighted: bool = False, batch_sizes: Sequence[int] = BATCH_SIZES,
           platforms: Sequence[str] = ("cpu", "cuda"),
           call: Callable | None = None) -> Path:
    """Writes the serving folder of ``model`` at ``path`` (module doc); returns the path.

    ``keys``: the sparse features, in the order of the KJTs the model will be called with;
    ``ids_per_sample``: the most ids one sample holds over all keys (a bucket of B
    samples takes ``B * ids_per_sample``); ``weighted``: the KJTs carry per-sample weights.
    """
    call = call or (lambda m, dense, sparse: m(dense, sparse))
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = list(keys)

    def serve(leaves, dense, values, lengths, weights):
        m = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        sparse = KeyedJaggedTensor(keys, values, weights=weights if weighted else None,
                                   lengths=lengths, capacity=values.shape[0])
        return call(m, dense, sparse)

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "weights.npz", **{f"a{k}": np.asarray(x) for k, x in enumerate(leaves)})
    specs = [jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype) for x in leaves]
    # jaxrec's kernels are custom calls, which jax.export refuses unless named; a platform
    # without jaxrec's handlers here is lowered with the jnp references instead. The ops
    # trace the branches of `platforms` (lowering_platforms), not only this process's.
    allowed = [jax.export.DisabledSafetyCheck.custom_call(t) for t in _ffi.custom_call_targets()]
    buckets = {}
    for b in sorted(set(int(b) for b in batch_sizes)):
        capacity = max(1, b * ids_per_sample)
        with _ffi.lowering_platforms(platforms):
            exported = jax.export.export(jax.jit(serve), platforms=tuple(platforms), disabled_checks=allowed)(
                specs, jax.ShapeDtypeStruct((b, num_dense), jnp.float32),
                jax.ShapeDtypeStruct((capacity,), jnp.int32),
                jax.ShapeDtypeStruct((len(keys) * b,), jnp.int32),
                jax.ShapeDtypeStruct((capacity,), jnp.float32))
        name = f"serve_{b}.bin"
        (out / name).write_bytes(exported.serialize())
        buckets[str(b)] = {"file": name, "capacity": capacity}
    files = ["weights.npz"] + [v["file"] for v in buckets.values()]
    manifest = {"format": FORMAT, "version": VERSION, "keys": keys, "num_dense": num_dense,
                "weighted": weighted, "platforms": list(platforms), "buckets": buckets,
                "kernels": [p for p in platforms if _ffi.has_kernel(p)],
                "num_arrays": len(leaves), "sha256": {f: _sha256(out / f) for f in files}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


class Served:
    """``predict(dense, sparse) -> scores``: a loaded serving folder (``load``)."""

    def __init__(self, path: Path, manifest: dict, arrays: list, buckets: dict):
        self.path, self.manifest, self._arrays, self._buckets = path, manifest, arrays, buckets
        self.keys = tuple(manifest["keys"])

    def __call__(self, dense, sparse: KeyedJaggedTensor):
        if list(sparse.keys()) != list(self.keys):
            raise ValueError(f"the KJT's keys {sparse.keys()} are not the served model's {list(self.keys)} "
                             "(in this order)")
        weights = sparse.weights_or_none()
        if sparse.stride() != np.shape(dense)[0]:
            raise ValueError(f"dense must be [B, {self.manifest['num_dense']}] float32 with B the KJT's "
                             f"{sparse.stride()} samples, got shape {np.shape(dense)}")
        return self.predict_arrays(dense, sparse.lengths(), sparse.values(),
                                   None if weights is None else weights)

    def predict_arrays(self, dense, lengths, values, weights=None):
        """Scores from a request's host arrays, without building a KJT (whose arrays would go
        to the device and back to be padded): ``dense [B, num_dense]``, ``lengths
        [num_keys * B]`` key-major in ``self.keys``' order, ``values`` the ids, key-major
        (entries past ``sum(lengths)`` are ignored), ``weights`` per id or None."""
        dense = np.asarray(dense, np.float32)
        if dense.ndim != 2 or dense.shape[1] != self.manifest["num_dense"]:
            raise ValueError(f"dense must be [B, {self.manifest['num_dense']}] float32, got shape {dense.shape}")
        batch = dense.shape[0]
        lengths = np.asarray(lengths)
        if lengths.size != len(self.keys) * batch:
            raise ValueError(f"lengths must hold {len(self.keys)} keys x {batch} samples = "
                             f"{len(self.keys) * batch} entries (key-major), got {lengths.size}")
        lengths = lengths.reshape(len(self.keys), batch)
        values = np.asarray(values)
        weights = np.ones(values.shape, np.float32) if weights is None else np.asarray(weights, np.float32)
        # Per key, where each sample's ids start (values are key-major), for cutting pieces.
        starts = np.concatenate([np.zeros((len(self.keys), 1), np.int64), np.cumsum(lengths, axis=1)], axis=1)
        key_start = np.concatenate([[0], np.cumsum(starts[:, -1])])[:-1]
        largest = max(self._buckets)
        if batch <= largest:  # one piece: the ids as they are
            total = int(starts[:, -1].sum())
            return self._bucket_call(dense, lengths, values[:total], weights[:total])
        parts = []
        for start in range(0, batch, largest):
            stop = min(start + largest, batch)
            take = np.concatenate([key_start[k] + np.arange(starts[k, start], starts[k, stop])
                                   for k in range(len(self.keys))]).astype(np.int64)
            parts.append(self._bucket_call(dense[start:stop], lengths[:, start:stop], values[take],
                                           weights[take]))
        return jnp.concatenate(parts)

    def _bucket_call(self, dense, lengths, values, weights):
        """One piece of at most the largest bucket's samples, padded to its bucket."""
        b = dense.shape[0]
        size = min(s for s in self._buckets if s >= b)
        call, capacity = self._buckets[size]
        if values.size > capacity:
            raise ValueError(f"{values.size} ids for {b} samples; the {size}-sample bucket of {self.path} "
                             f"takes at most {capacity}: export with a larger ids_per_sample")
        pad_lengths = np.zeros((len(self.keys), size), np.int32)
        pad_lengths[:, :b] = lengths
        pad_values = np.zeros(capacity, np.int32)
        pad_values[:values.size] = values
        pad_weights = np.zeros(capacity, np.float32)
        pad_weights[:values.size] = weights
        pad_dense = np.zeros((size, dense.shape[1]), np.float32)
        pad_dense[:b] = dense
        out = call(self._arrays, pad_dense, pad_values, pad_lengths.reshape(-1), pad_weights)
        return out if b == size else out[:b]


def load(path: str | os.PathLike) -> Served:
    """The serving folder at ``path`` as a callable (module doc); verified before it is used."""
    folder = Path(path)
    manifest_path = folder / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{folder} is not a jaxrec serving folder: it has no manifest.json "
                                "(write one with jaxrec.serving.export)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{manifest_path} is corrupted (not JSON: {error}); export the model again") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{manifest_path} is not a {FORMAT} manifest (format {manifest.get('format')!r})")
    if manifest.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"{folder} is a version {manifest.get('version')} serving folder; this jaxrec "
                         f"reads versions {READABLE_VERSIONS}: load it with the jaxrec that wrote it, or "
                         "export again")
    for name, digest in manifest["sha256"].items():
        file = folder / name
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing from the serving folder; export the model again")
        if _sha256(file) != digest:
            raise ValueError(f"{file} does not match its checksum in manifest.json (corrupted or "
                             "truncated); export the model again")
    for platform in ("cpu", "cuda"):  # the artifacts' custom calls need jaxrec's handlers registered
        _ffi.has_kernel(platform)
    with np.load(folder / "weights.npz") as npz:
        arrays = [jnp.asarray(npz[f"a{k}"]) for k in range(manifest["num_arrays"])]
    buckets = {}
    for size, entry in manifest["buckets"].items():
        exported = jax.export.deserialize(bytearray((folder / entry["file"]).read_bytes()))
        expected = [tuple(a.shape) for a in exported.in_avals[:len(arrays)]]
        if expected != [tuple(a.shape) for a in arrays]:
            raise ValueError(f"{folder}/weights.npz does not hold the arrays {entry['file']} was "
                             "exported with; export the model again")
        # Under jit: one dispatch per call (exported.call alone dispatches op by op on the host).
        buckets[int(size)] = (jax.jit(exported.call), entry["capacity"])
    return Served(folder, manifest, arrays, buckets)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
