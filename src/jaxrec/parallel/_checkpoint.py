"""Checkpoints of sharded models that restore on any mesh: ``portable_state`` /
``load_portable_state`` around ``jaxrec.checkpoint``.

A sharded collection's buffers depend on its plan (which device stacks which shard where,
_layout.py), so they cannot be resharded by orbax alone. ``portable_state`` replaces them
by each table's whole arrays (weights, fused optimizer state, step: the plan-free form
of _portable.py); the rest of the model and the optax state are replicated arrays. Orbax
then restores every array onto the target's shardings, on any number of devices, and
``load_portable_state`` packs the tables for the target's plan::

    # 8 devices
    save_checkpoint(ckpt_dir, step, portable_state(model, optimizer))
    # later, 4 devices: the same model built and sharded with a plan for 4
    target = portable_state(model4, optimizer4)           # arrays with the 4-device shardings
    state, meta = restore_checkpoint(ckpt_dir, target)
    load_portable_state(model4, state, optimizer4)

Restoring is bit-exact. The target may also be the same model *unsharded* (its
collections plain ``EmbeddingBagCollection`` s, on one device), whose
``portable_tables`` / ``load_portable_tables`` have the same form. Plain sharded tables trained
by an optax optimizer with state (Adagrad, Adam, ...) are not portable: their optax state
mirrors the plan's buffers. A collection's portable form is its tables only: the
``dropped_ids`` count of a sharded collection is a statistic of the run and is not
carried over.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrec.nn import TableCollection


def _collections(model) -> list[tuple[tuple, TableCollection]]:
    return [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, TableCollection)]


def _node(tree: dict, path: tuple) -> dict:
    for key in path:
        tree = tree[key]
    return tree


def portable_state(model: nnx.Module, optimizer: nnx.Optimizer | None = None) -> dict:
    """``{"model": ..., "optimizer": ...}`` of a model with sharded collections, in a form
    that does not depend on the plan (module doc). Save it with ``save_checkpoint``; use the
    same call on the target model as the restore target."""
    pure = nnx.to_pure_dict(nnx.state(model))
    for path, module in _collections(model):
        node = _node(pure, path)
        node.clear()  # run statistics of a sharded collection (dropped_ids) are not carried
        node["tables"] = module.portable_tables()
    out = {"model": pure}
    if optimizer is not None:
        opt_state = nnx.to_pure_dict(nnx.state(optimizer))
        sharded = [x for x in jax.tree.leaves(opt_state)
                   if getattr(getattr(x, "sharding", None), "spec", P()) != P()]
        if sharded:
            raise NotImplementedError(
                "the optax state holds sharded arrays (plain sharded tables trained by a stateful "
                "optax optimizer), which mirror this plan's buffers and are not portable; train "
                "the tables with a fused optimizer (optimizer=... in the collection) or optax.sgd")
        out["optimizer"] = opt_state
    return out


def load_portable_state(model: nnx.Module, state: dict,
                        optimizer: nnx.Optimizer | None = None) -> None:
    """Loads ``state`` (``portable_state`` of any plan, e.g. restored from a checkpoint)
    into ``model`` (and ``optimizer``), packing the tables for the model's plan."""
    pure = dict(state["model"])
    rest = jax.tree.map(lambda x: x, pure)  # a copy whose tables entries we may drop
    for path, module in _collections(model):
        module.load_portable_tables(_node(pure, path)["tables"])
        del _node(rest, path)["tables"]
    current = nnx.state(model)
    nnx.replace_by_pure_dict(current, rest)
    nnx.update(model, current)
    if optimizer is not None:
        if "optimizer" not in state:
            raise ValueError("state has no 'optimizer'; save it with portable_state(model, optimizer)")
        current = nnx.state(optimizer)
        nnx.replace_by_pure_dict(current, state["optimizer"])
        nnx.update(optimizer, current)
