"""A model's split for training, kept between steps while the model's structure stays the same.

``nnx.split`` walks the whole module graph. For the sharded DLRM on 4 GPUs that walk, and
the pytree work around it, took about half of the host's time to issue a train step, and
the host then bound the step. ``SplitCache(split_fn).split(model, *args)`` walks once
(``split_fn(model, *args)``, e.g. ``split_for_training``); on later calls with the same
``args`` it only checks (microseconds) that nothing was reassigned since:

* every nnx ``Pytree`` node's attributes (modules, ``nnx.List``/``nnx.Dict``);
* the items of every Python list, dict and set in the graph;
* every Variable's metadata, by equality.

Attributes and items compare by identity, or by equality where both are plain immutable
values (numbers, strings, dtypes, tuples of them), so that setting an equal setting again
(``ebc.max_ids_per_bag = (1,) * n``) keeps the split.

Any difference and it splits again. The kept states hold the model's own Variables (flax's
split hands them out, not copies), so they always carry the current values: a step reads
them with ``get_raw_value`` and writes back with ``set_raw_value``, as ``nnx.split`` and
``nnx.update`` do. Setting a Variable's value (``nnx.update``, a restored checkpoint) needs
no new split.

Not seen: an in-place change inside an attribute's value that is none of the above (a
mutable object whose field is set); nnx compares such static values by equality. Assign a
new value instead. The cache holds the model weakly and forgets it when it is collected.
"""

from __future__ import annotations

import functools
import operator
import weakref
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrec.nn._fused_variable import FusedTables


class Split(NamedTuple):
    """A split (``graphdef, *states``) with its Variables listed in the states' leaf order."""

    graphdef: nnx.GraphDef
    states: tuple  # nnx.States whose leaves are the Variables
    variables: tuple  # per state, its Variables in leaf order
    derived: dict  # what a step derives from this split and keeps with it (e.g. its mesh)


def split_for_training(model: nnx.Module, wrt=nnx.Param):
    """``(graphdef, params, fused tables, rest)`` of ``model``: ``params`` are the Variables
    that ``wrt`` selects among those that are not ``FusedTables``."""
    graphdef, tables, params, rest = nnx.split(model, FusedTables, wrt, ...)
    return graphdef, params, tables, rest


class SplitCache:
    """``split(model, *args)``: the kept ``split_fn(model, *args)`` while ``model``'s
    structure and ``args`` are unchanged, else a new one (module doc)."""

    def __init__(self, split_fn=nnx.split):
        self._split_fn = split_fn
        self._entries = {}  # id(model) -> (weakref to model, args, Split, snapshot)

    def split(self, model, *args) -> Split:
        entry = self._entries.get(id(model))
        if (entry is not None and entry[0]() is model and entry[1] == args
                and _unchanged(entry[3])):
            return entry[2]
        _require_shared_variables()
        graphdef, *states = self._split_fn(model, *args)
        is_var = lambda x: isinstance(x, nnx.Variable)
        split = Split(graphdef, tuple(states),
                      tuple(tuple(jax.tree.leaves(s, is_leaf=is_var)) for s in states), {})
        key = id(model)
        forget = lambda _, key=key: self._entries.pop(key, None)
        self._entries[key] = (weakref.ref(model, forget), args, split, _snapshot(model))
        return split


def write_back(split: Split, values) -> None:
    """Sets the model's Variables (``split.variables``) to the step's new ``values``: per
    state, one raw value per Variable, in the same order.

    ``set_raw_value`` checks the trace level twice per Variable (~1.4 us each; the sharded
    DLRM with its optax state has 52 Variables). The step runs outside any trace, so
    flax's check runs for the first Variable of each state and the others are set
    directly, where ``_direct_set_works`` found that sound for this flax and no Variable
    is a hijax one."""
    direct = split.derived.get("direct_set")
    if direct is None:
        direct = split.derived["direct_set"] = _direct_set_works() and not any(
            v.hijax for variables in split.variables for v in variables)
    for variables, new in zip(split.variables, values, strict=True):
        if len(variables) != len(new):
            raise ValueError(f"write_back: {len(new)} values for {len(variables)} Variables")
        if not direct:
            for var, value in zip(variables, new):
                var.set_raw_value(value)
        elif variables:
            variables[0].set_raw_value(new[0])
            for var, value in zip(variables[1:], new[1:]):
                object.__setattr__(var, "_raw_value", value)


def raw_values(state) -> list:
    """The raw values of ``state``'s Variables, in leaf order."""
    return [v.get_raw_value()
            for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))]


def _snapshot(model) -> list:
    """What ``_unchanged`` compares, per graph node: ``("node", weakref, items)``,
    ``("container", list/dict/set, items)`` (items: ``_items`` of its attributes or
    itself) or ``("variable", Variable, metadata)``."""
    out = []
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable):
            out.append(("variable", node, node.get_metadata()))
        elif isinstance(node, nnx.Pytree):
            attributes = vars(node)
            out.append(("node", weakref.ref(node), _items(attributes)))
            out.extend(("container", value, _items(value)) for value in attributes.values()
                       if isinstance(value, (list, dict, set)))
    return out


def _items(container) -> list:
    """A container's keys and values (dict) or elements, to compare with ``_same``."""
    if isinstance(container, dict):
        return [*container.keys(), *container.values()]
    return list(container)


def _unchanged(snapshot: list) -> bool:
    for kind, owner, kept in snapshot:
        if kind == "variable":
            if owner.get_metadata() != kept:
                return False
            continue
        if kind == "node":
            owner = owner()
            if owner is None:
                return False
            owner = vars(owner)
        now = _items(owner)
        # identity first (a C loop: the usual case, nothing reassigned), then _same
        if len(now) != len(kept) or not (all(map(operator.is_, now, kept))
                                         or all(map(_same, now, kept))):
            return False
    return True


_PLAIN = (int, float, complex, str, bytes, bool, type(None), np.dtype)


def _same(a, b) -> bool:
    """``a is b``, or both plain immutable values (``_PLAIN``, tuples of them) and equal:
    never ``==`` on arrays, Variables or modules."""
    return a is b or (type(a) is type(b) and _plain(a) and _plain(b) and a == b)


def _plain(x) -> bool:
    if isinstance(x, tuple):
        return all(_plain(v) for v in x)
    return isinstance(x, _PLAIN)


@functools.cache
def _require_shared_variables() -> None:
    """The kept states must hold the model's own Variables (flax >= 0.12's split does)."""
    probe = _Probe()
    if nnx.split(probe)[1]["w"] is not probe.w:
        raise RuntimeError("this flax's nnx.split copies Variables; jaxrec's train steps need "
                           "the model's own Variables in the split (flax 0.12 gives them)")


@functools.cache
def _direct_set_works() -> bool:
    """Whether this flax keeps a Variable's value in ``_raw_value`` and reads nothing else
    (flax 0.12), so that ``write_back`` may set it without the per-Variable trace check."""
    try:
        var = _Probe().w
        value = jnp.ones(())
        object.__setattr__(var, "_raw_value", value)
        return var.get_raw_value() is value and var.get_value() is value and not var.hijax
    except Exception:  # another flax: set every Variable through set_raw_value
        return False


class _Probe(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.zeros(()))
