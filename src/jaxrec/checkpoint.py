"""Checkpoints of training state on orbax-checkpoint: ``save_checkpoint`` / ``restore_checkpoint``.

What is saved, under ``directory/<step>/`` (one orbax composite checkpoint, written to a
temporary folder and renamed when complete):

- ``state``: every array leaf of the pytree, flattened by path
  (``jax.tree_util.tree_flatten_with_path``) into a flat dict of arrays, so any pytree
  works — ``nnx.State``, optax ``NamedTuple`` states, ``FusedEmbeddingTables`` and other
  registered dataclasses — and no custom node ever reaches orbax. Typed PRNG keys
  (``key<fry>``, e.g. inside ``nnx.Rngs``) are saved as their ``jax.random.key_data`` and
  re-wrapped on restore. Python ``int``/``float`` leaves are not supported: make them arrays
  (``jnp.asarray``) or static fields.
- ``manifest``: JSON, each leaf's path, shape, dtype (and PRNG implementation) and the
  SHA-256 of its bytes, the SHA-256 of the metadata, and a SHA-256 of the manifest itself.
- ``metadata``: your JSON dict, e.g. ``{"step": 1000, "data_position": 128000}``.

Restoring is bit-exact: the same dtypes (bfloat16, float16, uint32, int64 with x64, ...)
and the same bits, NaN payloads and -0.0 included; no leaf is ever cast. The checkpoint
must hold exactly the paths, shapes and dtypes of the target, else the error names each
difference.

Integrity:

- Every restored array, the metadata and the manifest are checked against their checksums;
  a checkpoint that fails (a changed byte, a truncated or missing file, unreadable data)
  raises ``CheckpointCorruptError`` naming the checkpoint and the file or leaf. With
  ``step=None`` the restore falls back to the newest intact checkpoint instead, with a
  warning; the returned metadata's ``.step`` says which step was restored.
- Only complete checkpoints count (``all_steps``): a folder named like a step that orbax
  did not finish (a stray ``ckpt/999``) is ignored.
- ``save_checkpoint`` refuses floating arrays holding NaN or Inf (a diverged run must not
  replace good checkpoints) unless ``allow_nonfinite=True``.
- ``CheckpointLock(directory)`` gives one process the directory for a run; a second one
  is refused with ``CheckpointLockedError``.
- Arrays that span several processes (docs/multiprocess.md) are checked by a digest that
  each process computes over the shards it holds (``_digests``: two wrapping uint32 sums
  of the array's words, weighted by their position, so any change of one word is seen
  whatever the sharding), not by SHA-256: that would gather every array to one host. A
  restore checks each leaf by what its save wrote, on any number of processes.

Resuming a training run::

    state = (model_state, opt_state)
    save_checkpoint(ckpt_dir, step, state, metadata={"step": step, "data_position": pos},
                    keep=3)
    ...
    # in the new process: build the state as before, without computing it
    target = jax.eval_shape(init_fn)          # or ShapeDtypeStructs with shardings
    (model_state, opt_state), meta = restore_checkpoint(ckpt_dir, target)
    step, pos = meta["step"], meta["data_position"]

Each restored array is placed with the sharding of its target leaf (a concrete array's
``.sharding``, or ``jax.ShapeDtypeStruct(..., sharding=...)``); a leaf without one goes to
the default device. Since the target decides, restoring into a target of other shardings
— another mesh, fewer devices, replicated — reshards the checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import json
import numbers
import os
import pathlib
import re
import shutil
import socket
import sys
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxrec._mesh import default_device, to_host

__all__ = ["CheckpointCorruptError", "CheckpointLock", "CheckpointLockedError",
           "NonFiniteStateError", "RestoredMetadata", "all_steps", "latest_step", "read_metadata",
           "restore_checkpoint", "save_checkpoint"]

_FORMAT = "jaxrec.checkpoint/2"
_UNCHECKED_FORMATS = ("jaxrec.checkpoint/1",)  # older checkpoints, written without checksums
_COMPLETE = "_CHECKPOINT_METADATA"  # orbax writes it before the folder gets its final name
_LOCK_FILE = ".lock"


class CheckpointCorruptError(ValueError):
    """A checkpoint's files do not hold what was saved (changed, truncated or missing)."""


class NonFiniteStateError(ValueError):
    """``save_checkpoint`` refused a state that holds NaN or Inf (``allow_nonfinite=False``)."""


class CheckpointLockedError(RuntimeError):
    """Another process holds the ``CheckpointLock`` of the directory."""


class RestoredMetadata(dict):
    """The metadata dict of a restored checkpoint, and which checkpoint it came from.

    ``step``: the step restored (with ``step=None``, the newest intact one). ``corrupt``:
    ``{step: reason}`` of the newer checkpoints that were found corrupt and skipped.
    """

    def __init__(self, metadata: dict, *, step: int, corrupt: dict[int, str]):
        super().__init__(metadata)
        self.step, self.corrupt = step, corrupt


def save_checkpoint(directory, step: int, state, *, metadata: dict | None = None,
                    keep: int | None = None, keep_steps=(), allow_nonfinite: bool = False) -> pathlib.Path:
    """Writes ``state`` (a pytree of arrays) and ``metadata`` as checkpoint ``step``.

    ``directory`` is created if missing. Returns once the checkpoint is complete on disk
    (the caller may exit right after), with the path of the step's folder. ``step`` must be
    larger than every step saved in ``directory``. ``keep=N`` deletes all but the ``N``
    newest checkpoints and those of ``keep_steps`` (e.g. the best evaluation's). A floating
    leaf holding NaN or Inf is refused (``ValueError`` naming it) unless
    ``allow_nonfinite=True``.
    """
    step = _check_step(step)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, numbers.Integral)
                             or keep < 1):
        raise ValueError(f"keep must be a positive int or None (keep all), got keep={keep!r}")
    metadata = _json_metadata({} if metadata is None else metadata)
    arrays, leaves = _flatten(state, allow_nonfinite=allow_nonfinite)
    manifest = _seal({"format": _FORMAT, "leaves": leaves, "metadata_sha256": _json_sha(metadata)})
    path = pathlib.Path(directory).absolute()
    steps = all_steps(path)
    if steps and step <= steps[-1]:
        what = "already exists" if step in steps else f"is older than the latest, {steps[-1]},"
        raise ValueError(
            f"checkpoint step={step} {what} in {path} (steps {steps}); steps must increase, "
            "since restore takes the newest: save under a larger step, or delete the newer "
            "step folders first (to roll back)")
    if (path / str(step)).exists():
        raise ValueError(f"{path / str(step)} exists but is not a complete checkpoint (no "
                         f"{_COMPLETE}); delete or rename it, or save under another step")
    path.mkdir(parents=True, exist_ok=True)
    with contextlib.closing(_checkpointer()) as checkpointer:
        checkpointer.save(path / str(step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(arrays), manifest=ocp.args.JsonSave(manifest),
            metadata=ocp.args.JsonSave(metadata)))
    if keep is not None and jax.process_index() == 0:
        for old in [*steps, step][:-keep]:
            if old not in keep_steps:
                shutil.rmtree(path / str(old))
    return path / str(step)


def restore_checkpoint(directory, target, *, step: int | None = None, verify: bool = True):
    """Restores checkpoint ``step`` (default: the newest intact one) into ``target``'s structure.

    ``target`` is a pytree of arrays or ``jax.ShapeDtypeStruct`` (e.g. ``jax.eval_shape``
    of the init) of the same paths, shapes and dtypes as the saved state; each array is
    placed with its target leaf's sharding. Returns ``(state, metadata)``; ``metadata`` is
    a ``RestoredMetadata`` (a dict) whose ``.step`` is the step restored.

    ``verify`` checks every array against its checksum (one copy of the state to the host).
    A corrupt checkpoint raises ``CheckpointCorruptError`` when ``step`` was given; with
    ``step=None`` the newest intact older checkpoint is restored instead, with a warning
    (``metadata.corrupt`` lists the skipped ones), and the error is raised only when no
    checkpoint is intact.
    """
    path = pathlib.Path(directory).absolute()
    step = _existing_step(path, directory, step)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    (leaves, metadata), restored, corrupt = _newest_intact(
        path, step, lambda checkpointer, s: _restore_step(checkpointer, path, s, paths_leaves,
                                                          verify=verify))
    return (jax.tree_util.tree_unflatten(treedef, leaves),
            RestoredMetadata(metadata, step=restored, corrupt=corrupt))


def read_metadata(directory, *, step: int | None = None) -> RestoredMetadata:
    """The metadata of checkpoint ``step`` (default: the newest whose metadata is intact),
    verified against its checksum, without reading the arrays: e.g. to check that a run's
    settings fit a checkpoint before building the state to restore into."""
    path = pathlib.Path(directory).absolute()
    step = _existing_step(path, directory, step)
    (_, metadata), found, corrupt = _newest_intact(
        path, step, lambda checkpointer, s: _read_json(checkpointer, path, s))
    return RestoredMetadata(metadata, step=found, corrupt=corrupt)


def latest_step(directory) -> int | None:
    """The newest complete checkpoint step in ``directory``, or ``None`` when there is none."""
    steps = all_steps(directory)
    return steps[-1] if steps else None


def all_steps(directory) -> list[int]:
    """All complete checkpoint steps in ``directory``, ascending (``[]`` when there is none).

    A folder named like a step that is not a finished checkpoint (no ``_CHECKPOINT_METADATA``,
    e.g. an empty ``ckpt/999``) is ignored. Complete checkpoints may still be corrupt:
    ``restore_checkpoint`` verifies them.
    """
    path = pathlib.Path(directory).absolute()
    if not path.is_dir():
        return []
    return sorted(int(p.name) for p in path.iterdir()
                  if p.name.isdigit() and p.is_dir() and (p / _COMPLETE).is_file())


class CheckpointLock:
    """Exclusive use of a checkpoint directory by one process, e.g. for a training run::

        with CheckpointLock(ckpt_dir):
            ...  # save and restore checkpoints

    An exclusive ``flock`` on ``directory/.lock`` (the directory is created if missing); a
    second process (or a second lock in this one) gets ``CheckpointLockedError`` naming the
    directory and the holder's pid and host. The operating system drops the lock when the
    process ends, crashes included, so a stale lock never blocks the next run.
    """

    def __init__(self, directory):
        self.directory = pathlib.Path(directory).absolute()
        self._file = None

    def acquire(self) -> CheckpointLock:
        if self._file is not None:
            raise RuntimeError(f"this CheckpointLock of {self.directory} is already held")
        self.directory.mkdir(parents=True, exist_ok=True)
        file = open(self.directory / _LOCK_FILE, "a+")  # noqa: SIM115 (held until release)
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "unknown"
            file.close()
            raise CheckpointLockedError(
                f"checkpoint directory {self.directory} is in use by another run (holder: "
                f"{holder}); wait for it to end, or use another checkpoint directory") from None
        file.seek(0)
        file.truncate()
        file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        file.flush()
        self._file = file
        return self

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self) -> CheckpointLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# --- helpers -------------------------------------------------------------------------

def _existing_step(path: pathlib.Path, directory, step) -> int | None:
    """``step`` checked to be a complete checkpoint in ``path`` (None stays None)."""
    if step is not None:
        step = _check_step(step)
    steps = all_steps(path)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in directory={str(directory)!r}: check the path, "
                                "or start from a fresh state when nothing was saved yet")
    if step is not None and step not in steps:
        raise FileNotFoundError(f"no checkpoint step={step} in {path}; the steps there are "
                                f"{steps} (step=None restores the newest)")
    return step


def _newest_intact(path: pathlib.Path, step: int | None, read):
    """``(read(checkpointer, s), s, corrupt)`` for ``s = step``, or with ``step=None`` for the
    newest checkpoint that ``read`` finds intact; ``corrupt`` maps the newer ones skipped
    to why (and a warning says so)."""
    corrupt: dict[int, str] = {}
    with contextlib.closing(_checkpointer()) as checkpointer:
        for candidate in [step] if step is not None else all_steps(path)[::-1]:
            try:
                result = read(checkpointer, candidate)
                break
            except CheckpointCorruptError as e:
                if step is not None:
                    raise
                corrupt[candidate] = str(e)
        else:
            raise CheckpointCorruptError(f"every checkpoint in {path} is corrupt:\n  "
                                         + "\n  ".join(corrupt.values()))
    if corrupt:
        warnings.warn(f"using checkpoint step={candidate} of {path}, the newest intact one; "
                      f"skipped the newer corrupt ones:\n  " + "\n  ".join(corrupt.values()),
                      stacklevel=3)
    return result, candidate, corrupt

def _checkpointer() -> ocp.Checkpointer:
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step must be an int >= 0, got step={step!r}")
    return int(step)


def _is_key(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _json_metadata(metadata) -> dict:
    """``metadata`` as it reads back from JSON (so that its checksum matches on restore)."""
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict (JSON), got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(metadata))
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata must be JSON-serialisable (str keys; str, int, float, bool, "
                        f"None, list, dict values): {e}. Convert arrays with .tolist() or "
                        "int(...)") from None


def _json_sha(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _seal(manifest: dict) -> dict:
    """The manifest with a checksum of itself, so that a changed shape or checksum is seen."""
    return {**manifest, "sha256": _json_sha(manifest)}


def _spans_processes(array) -> bool:
    return isinstance(array, jax.Array) and not array.is_fully_addressable


def _array_sha(array) -> str:
    """SHA-256 of an array's bytes (C order); an array spanning several processes is
    gathered to every process first (restores only: saves digest such arrays)."""
    host = np.ascontiguousarray(to_host(array))
    return hashlib.sha256(host.reshape(-1).view(np.uint8)).hexdigest()


def _global_digest(array) -> str:
    """The digest of one array (``_digests``)."""
    return _digests([array])[0][0]


def _digests(arrays) -> tuple[list[str], list[int]]:
    """Each array's digest (module doc) and count of NaN/Inf values, the same for any
    sharding: each process adds up the shards it holds (one replica of each) in NumPy, and
    one all-gather of every array's sums adds up the processes' (every process must call
    it alike). uint32 sums wrap: exact, and independent of the order they are added in."""
    sums = np.zeros((len(arrays), 3), np.uint32)
    for i, array in enumerate(arrays):
        if isinstance(array, jax.Array):
            shards = [(s.data, s.index) for s in array.addressable_shards if s.replica_id == 0]
        else:
            shards = [(array, ())]
        for data, index in shards:
            sums[i] += _shard_sums(np.asarray(data), index, np.shape(array))
    if jax.process_count() > 1:
        sums = np.asarray(multihost_utils.process_allgather(sums)).sum(axis=0, dtype=np.uint32)
    return [f"{a:08x}-{b:08x}" for a, b, _ in sums], [int(bad) for *_, bad in sums]


def _shard_sums(data: np.ndarray, index: tuple, shape: tuple) -> np.ndarray:
    """``[first, second, non-finite count]`` of one shard at ``index`` of an array of
    ``shape``: sums over its words of ``word * (2p + 1)`` and ``(word ^ p * 0x9E3779B9) *
    0x85EBCA6B``, ``p`` the word's position in the whole array (C order). An odd weight is
    invertible mod 2**32, so any change of a single word changes the first sum."""
    data = np.ascontiguousarray(data)
    bad = (np.count_nonzero(~np.isfinite(data))
           if jax.dtypes.issubdtype(data.dtype, np.inexact) else 0)
    position, stride = np.zeros((), np.uint64), 1
    for k in reversed(range(len(shape))):
        start, stop, _ = (index[k] if k < len(index) else slice(None)).indices(shape[k])
        along = np.arange(start, stop, dtype=np.uint64) * np.uint64(stride)
        position = position + along.reshape([-1 if j == k else 1 for j in range(len(shape))])
        stride *= shape[k]
    position = np.broadcast_to(position, data.shape).reshape(-1)
    width = data.dtype.itemsize
    if data.dtype == np.bool_:
        words = data.view(np.uint8).reshape(-1).astype(np.uint32)
    elif width < 4:
        words = data.view(f"uint{8 * width}").reshape(-1).astype(np.uint32)
    else:  # 4 bytes: one word; 8 bytes: two, in memory order
        words = data.view(np.uint32).reshape(-1)
        if width == 8:
            position = (2 * position[:, None] + np.arange(2, dtype=np.uint64)).reshape(-1)
    p = (position & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    first = np.sum(words * (2 * p + 1), dtype=np.uint32)
    second = np.sum((words ^ (p * np.uint32(0x9E3779B9))) * np.uint32(0x85EBCA6B), dtype=np.uint32)
    return np.array([first, second, bad], np.uint32)


def _nonfinite(key: str, array) -> str | None:
    """``"key (n of size values NaN/Inf)"`` when a floating array is not all finite."""
    if not jax.dtypes.issubdtype(array.dtype, np.inexact):
        return None
    bad = int(np.size(array) - np.count_nonzero(np.isfinite(np.asarray(array))))
    return _nonfinite_note(key, bad, np.size(array))


def _nonfinite_note(key: str, bad: int, size: int) -> str | None:
    return f"{key or '<root>'} ({bad} of {size} values NaN/Inf)" if bad else None


def _flatten(state, *, allow_nonfinite: bool) -> tuple[dict, dict]:
    """``{storage name: array}`` and the manifest ``{keystr(path): entry}`` of ``state``."""
    arrays, manifest, nonfinite, spanning = {}, {}, [], []
    for i, (p, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(state)[0]):
        key = jax.tree_util.keystr(p)
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            raise ValueError(
                f"state leaf {key or '<root>'} is a {type(leaf).__name__} ({leaf!r}); checkpoints "
                "hold arrays only (Python ints/floats are not supported): make it an array with "
                "jnp.asarray(...), or a static (meta) field of its pytree node")
        leaf = np.asarray(leaf) if isinstance(leaf, np.generic) else leaf
        if not _is_key(leaf.dtype) and leaf.dtype.kind in "OUS":
            raise ValueError(f"state leaf {key or '<root>'} has dtype {leaf.dtype}; checkpoints "
                             "hold numeric arrays only")
        # Storage names are safe for any file system; the manifest maps paths to them.
        name = f"{i:05d}_" + re.sub(r"[^A-Za-z0-9]+", "_", key).strip("_")
        entry = {"name": name, "shape": list(leaf.shape), "dtype": str(leaf.dtype)}
        check_finite = not allow_nonfinite and not _is_key(leaf.dtype)
        if _is_key(leaf.dtype):
            entry["key_impl"] = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        if _spans_processes(leaf):  # checked below, all at once
            spanning.append((key, entry, leaf, check_finite))
        else:
            if check_finite and (bad := _nonfinite(key, leaf)):
                nonfinite.append(bad)
            entry["sha256"] = _array_sha(leaf)
        arrays[name] = leaf
        manifest[key] = entry
    if not arrays:
        raise ValueError("state has no array leaves; there is nothing to checkpoint")
    if spanning:
        digests, bad_counts = _digests([leaf for _, _, leaf, _ in spanning])
        for (key, entry, leaf, check_finite), digest, bad in zip(spanning, digests, bad_counts):
            entry["digest"] = digest
            if check_finite and (note := _nonfinite_note(key, bad, leaf.size)):
                nonfinite.append(note)
    if nonfinite:
        raise NonFiniteStateError(
            f"state leaves hold NaN or Inf: {', '.join(nonfinite[:10])}"
            + (f" and {len(nonfinite) - 10} more" if len(nonfinite) > 10 else "")
            + "; not saved, so that a diverged state never replaces a good checkpoint. Save a "
            "finite state (lower the learning rate, skip non-finite steps), or pass "
            "allow_nonfinite=True to save it anyway")
    return arrays, manifest


def _corrupt(path: pathlib.Path, step: int, what: str, error: Exception | None = None):
    detail = ""
    if error is not None:  # the first line of orbax's error, without TensorStore's spec dump
        first = (str(error).splitlines() or [""])[0].split(" See full TensorStore details")[0]
        detail = f" ({type(error).__name__}: {first[:300]})"
    return CheckpointCorruptError(f"checkpoint step={step} in {path} is corrupt: {what}{detail}")


def _read_json(checkpointer, path: pathlib.Path, step: int) -> tuple[dict, dict]:
    """The manifest's leaves and the metadata of checkpoint ``step``, verified."""
    where = path / str(step)
    try:
        saved = checkpointer.restore(where, args=ocp.args.Composite(
            manifest=ocp.args.JsonRestore(), metadata=ocp.args.JsonRestore()))
        manifest, metadata = saved["manifest"], saved["metadata"]
    except Exception as e:  # noqa: BLE001 (orbax/TensorStore/JSON errors of damaged files)
        raise _corrupt(path, step, f"cannot read {where / 'manifest'} or {where / 'metadata'}",
                       e) from e
    leaves_manifest = _check_manifest(manifest, path, step)
    if not isinstance(metadata, dict):
        raise _corrupt(path, step, f"{where / 'metadata'} holds a {type(metadata).__name__}, "
                                   "not a dict")
    if "metadata_sha256" in manifest and _json_sha(metadata) != manifest["metadata_sha256"]:
        raise _corrupt(path, step, f"{where / 'metadata'} does not match its checksum")
    return leaves_manifest, metadata


def _restore_step(checkpointer, path: pathlib.Path, step: int, paths_leaves, *, verify: bool):
    """The target's leaves and the metadata of checkpoint ``step``, verified."""
    where = path / str(step)
    leaves_manifest, metadata = _read_json(checkpointer, path, step)
    abstract = _abstract(paths_leaves, leaves_manifest, step, path)
    error = None
    try:
        arrays = checkpointer.restore(where, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract)))["state"]
    except Exception as e:  # noqa: BLE001 (same as above, for the arrays' files)
        error = _corrupt(path, step, f"cannot read the arrays in {where / 'state'}", e)
    if error is not None:  # outside the except: orbax's frames are released
        _collect_unfinished_reads()
        raise error
    leaves, digested = [], []
    for p, leaf in paths_leaves:
        key = jax.tree_util.keystr(p)
        entry = leaves_manifest[key]
        array = arrays[entry["name"]]
        if verify and entry.get("digest"):
            digested.append((key, entry, array))  # checked below, all at once
        if verify and entry.get("sha256") and _array_sha(array) != entry["sha256"]:
            raise _corrupt(path, step, _mismatch(key, entry, where))
        if "key_impl" in entry:
            array = jax.random.wrap_key_data(array, impl=entry["key_impl"])
            array = jax.device_put(array, _sharding(leaf, key))
        elif _sharding(leaf, key).memory_kind in ("pinned_host", "unpinned_host") and (
                jax.typeof(array).memory_space != jax.memory.Space.Host):
            # orbax places a host-memory leaf in host memory but types it as device memory,
            # which jit would then misread: a copy typed right (host-cached tables)
            array = jax.device_put(array, _sharding(leaf, key), may_alias=False)
        leaves.append(array)
    if digested:
        for (key, entry, _), digest in zip(digested, _digests([a for *_, a in digested])[0]):
            if digest != entry["digest"]:
                raise _corrupt(path, step, _mismatch(key, entry, where))
    return leaves, metadata


def _mismatch(key: str, entry: dict, where: pathlib.Path) -> str:
    return (f"leaf {key or '<root>'} (stored as {entry['name']} in {where / 'state'}) does not "
            "match its checksum")


def _collect_unfinished_reads() -> None:
    """orbax reads the arrays concurrently; when one read fails, the reads of the others are
    left unfinished and, once collected, print "Exception ignored" tracebacks of the same
    damage. Collect them now, quietly: the error raised says what is wrong."""
    hook, sys.unraisablehook = sys.unraisablehook, lambda _: None
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook


def _check_manifest(manifest, path: pathlib.Path, step: int) -> dict:
    """The manifest's leaves, once its format, structure and own checksum are right."""
    where = path / str(step) / "manifest"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("leaves"), dict):
        raise _corrupt(path, step, f"{where} is not a jaxrec checkpoint manifest")
    fmt = manifest.get("format")
    if fmt not in (_FORMAT, *_UNCHECKED_FORMATS):
        raise _corrupt(path, step, f"{where} has format {fmt!r}; this jaxrec reads {_FORMAT} "
                                   f"and {', '.join(_UNCHECKED_FORMATS)}")
    if fmt == _FORMAT:
        body = {k: v for k, v in manifest.items() if k != "sha256"}
        if manifest.get("sha256") != _json_sha(body):
            raise _corrupt(path, step, f"{where} does not match its checksum")
    for key, entry in manifest["leaves"].items():
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("shape"), list) and isinstance(entry.get("dtype"), str)):
            raise _corrupt(path, step, f"{where}: the entry of leaf {key} is malformed")
    return manifest["leaves"]


def _sharding(leaf, key: str = "") -> jax.sharding.Sharding:
    """The target leaf's sharding (an abstract mesh made concrete), else the default device's."""
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(
            sharding.mesh, jax.sharding.AbstractMesh):
        # jax.eval_shape of sharded arrays: the mesh's devices come from jax.set_mesh.
        mesh = jax.sharding.get_mesh()
        if mesh.empty or mesh.shape != sharding.mesh.shape:
            raise ValueError(
                f"target leaf {key or '<root>'} has a sharding over an abstract mesh "
                f"({dict(sharding.mesh.shape)}, as jax.eval_shape returns) and the mesh set now is "
                f"{dict(mesh.shape)}; restore inside `with jax.set_mesh(mesh):` with the mesh to "
                "place it on, or give the target concrete shardings")
        return jax.sharding.NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)
    if sharding is not None:
        return sharding
    return jax.sharding.SingleDeviceSharding(default_device())


def _abstract(paths_leaves, manifest: dict, step: int, path: pathlib.Path) -> dict:
    """The ``{name: ShapeDtypeStruct}`` that orbax restores; every mismatch is one error."""
    abstract, problems, wanted = {}, [], set()
    for p, leaf in paths_leaves:
        key = jax.tree_util.keystr(p)
        wanted.add(key)
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
            raise ValueError(
                f"target leaf {key or '<root>'} is a {type(leaf).__name__}; the target must be a "
                "pytree of arrays or jax.ShapeDtypeStruct, e.g. jax.eval_shape(init_fn)")
        expected = f"{leaf.dtype}{list(leaf.shape)}"
        entry = manifest.get(key)
        if entry is None:
            problems.append(f"{key or '<root>'}: missing in the checkpoint, target expects "
                            f"{expected}")
            continue
        found = f"{entry['dtype']}{entry['shape']}"
        if found != expected:
            problems.append(f"{key or '<root>'}: saved {found}, target expects {expected}")
            continue
        sharding = _sharding(leaf, key)
        if _is_key(leaf.dtype):
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
            if not isinstance(sharding, (jax.sharding.NamedSharding,
                                         jax.sharding.SingleDeviceSharding)):
                sharding = _sharding(None)  # key_data has more dims; device_put reshards the key
            abstract[entry["name"]] = jax.ShapeDtypeStruct(data.shape, data.dtype,
                                                           sharding=sharding)
        else:
            abstract[entry["name"]] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                           sharding=sharding)
    problems += [f"{key}: saved {e['dtype']}{e['shape']}, not in the target"
                 for key, e in manifest.items() if key not in wanted]
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... {len(problems) - 20} more"
                                             if len(problems) > 20 else "")
        raise ValueError(
            f"checkpoint step={step} in {path} does not match the target:\n  {shown}\nRestore into "
            "the structure that was saved: the same state built with the same config and dtypes "
            "(e.g. jax.eval_shape of the init that produced it); to keep a part, restore the "
            "whole and take the part")
    return abstract
