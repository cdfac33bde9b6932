"""Checkpoints of training state on orbax-checkpoint: ``save_checkpoint`` / ``restore_checkpoint``.

What is saved, under ``directory/<step>/`` (one orbax ``CheckpointManager`` step):

- ``state``: every array leaf of the pytree, flattened by path
  (``jax.tree_util.tree_flatten_with_path``) into a flat dict of arrays, so any pytree
  works — ``nnx.State``, optax ``NamedTuple`` states, ``FusedEmbeddingTables`` and other
  registered dataclasses — and no custom node ever reaches orbax. Typed PRNG keys
  (``key<fry>``, e.g. inside ``nnx.Rngs``) are saved as their ``jax.random.key_data`` and
  re-wrapped on restore. Python ``int``/``float`` leaves are not supported: make them arrays
  (``jnp.asarray``) or static fields.
- ``manifest``: JSON, each leaf's path, shape and dtype (and PRNG implementation).
- ``metadata``: your JSON dict, e.g. ``{"step": 1000, "data_position": 128000}``.

Restoring is bit-exact: the same dtypes (bfloat16, float16, uint32, int64 with x64, ...)
and the same bits, NaN payloads and -0.0 included; no leaf is ever cast. The checkpoint
must hold exactly the paths, shapes and dtypes of the target, else the error names each
difference.

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

import json
import numbers
import pathlib
import re

import jax
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["all_steps", "latest_step", "restore_checkpoint", "save_checkpoint"]

_FORMAT = "jaxrec.checkpoint/1"


def save_checkpoint(directory, step: int, state, *, metadata: dict | None = None,
                    keep: int | None = None) -> pathlib.Path:
    """Writes ``state`` (a pytree of arrays) and ``metadata`` as checkpoint ``step``.

    ``directory`` is created if missing. Returns once the checkpoint is complete on disk
    (the caller may exit right after), with the path of the step's folder. ``step`` must be
    larger than every step saved in ``directory``. ``keep=N`` deletes all but the ``N``
    newest checkpoints.
    """
    step = _check_step(step)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, numbers.Integral)
                             or keep < 1):
        raise ValueError(f"keep must be a positive int or None (keep all), got keep={keep!r}")
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict (JSON), got {type(metadata).__name__}")
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata must be JSON-serialisable (str keys; str, int, float, bool, "
                        f"None, list, dict values): {e}. Convert arrays with .tolist() or "
                        "int(...)") from None
    arrays, manifest = _flatten(state)
    path = pathlib.Path(directory).absolute()
    manager = _manager(path, keep=keep, create=True)
    try:
        steps = sorted(manager.all_steps())
        if steps and step <= steps[-1]:
            what = "already exists" if step in steps else f"is older than the latest, {steps[-1]},"
            raise ValueError(
                f"checkpoint step={step} {what} in {path} (steps {steps}); steps must increase, "
                "since restore takes the newest: save under a larger step, or delete the newer "
                "step folders first (to roll back)")
        manager.save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(arrays),
            manifest=ocp.args.JsonSave({"format": _FORMAT, "leaves": manifest}),
            metadata=ocp.args.JsonSave(metadata)))
        manager.wait_until_finished()
    finally:
        manager.close()
    return path / str(step)


def restore_checkpoint(directory, target, *, step: int | None = None):
    """Restores checkpoint ``step`` (default: the newest) into the structure of ``target``.

    ``target`` is a pytree of arrays or ``jax.ShapeDtypeStruct`` (e.g. ``jax.eval_shape``
    of the init) of the same paths, shapes and dtypes as the saved state; each array is
    placed with its target leaf's sharding. Returns ``(state, metadata)``.
    """
    path = pathlib.Path(directory).absolute()
    if step is not None:
        step = _check_step(step)
    steps = all_steps(path)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in directory={str(directory)!r}: check the path, "
                                "or start from a fresh state when nothing was saved yet")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise FileNotFoundError(f"no checkpoint step={step} in {path}; the steps there are "
                                f"{steps} (step=None restores the newest)")
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    manager = _manager(path, keep=None, create=False)
    try:
        saved = manager.restore(step, args=ocp.args.Composite(
            manifest=ocp.args.JsonRestore(), metadata=ocp.args.JsonRestore()))
        manifest, metadata = saved["manifest"]["leaves"], saved["metadata"]
        abstract = _abstract(paths_leaves, manifest, step, path)
        arrays = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract)))["state"]
    finally:
        manager.close()
    leaves = []
    for p, leaf in paths_leaves:
        entry = manifest[jax.tree_util.keystr(p)]
        array = arrays[entry["name"]]
        if "key_impl" in entry:
            array = jax.random.wrap_key_data(array, impl=entry["key_impl"])
            array = jax.device_put(array, _sharding(leaf, jax.tree_util.keystr(p)))
        leaves.append(array)
    return jax.tree_util.tree_unflatten(treedef, leaves), dict(metadata or {})


def latest_step(directory) -> int | None:
    """The newest checkpoint step in ``directory``, or ``None`` when there is none."""
    steps = all_steps(directory)
    return steps[-1] if steps else None


def all_steps(directory) -> list[int]:
    """All checkpoint steps in ``directory``, ascending (``[]`` when there is none)."""
    path = pathlib.Path(directory).absolute()
    if not path.is_dir():
        return []
    manager = _manager(path, keep=None, create=False)
    try:
        return sorted(int(s) for s in manager.all_steps())
    finally:
        manager.close()


# --- helpers -------------------------------------------------------------------------

def _manager(path: pathlib.Path, *, keep: int | None, create: bool) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create)
    return ocp.CheckpointManager(path, options=options)


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step must be an int >= 0, got step={step!r}")
    return int(step)


def _is_key(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _flatten(state) -> tuple[dict, dict]:
    """``{storage name: array}`` and the manifest ``{keystr(path): entry}`` of ``state``."""
    arrays, manifest = {}, {}
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
        if _is_key(leaf.dtype):
            entry["key_impl"] = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        arrays[name] = leaf
        manifest[key] = entry
    if not arrays:
        raise ValueError("state has no array leaves; there is nothing to checkpoint")
    return arrays, manifest


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
    device = jax.config.jax_default_device
    if device is None or isinstance(device, str):
        device = jax.devices(device)[0]
    return jax.sharding.SingleDeviceSharding(device)


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
