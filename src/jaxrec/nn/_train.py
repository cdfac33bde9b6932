"""Training an NNX model whose tables may be fused and sharded: ``make_train_step``.

::

    model = DLRM(ebc, ..., rngs=nnx.Rngs(0))    # ebc with optimizer=RowWiseAdagrad(...)
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def loss_fn(model, batch):
        logits = model(batch.dense, batch.sparse)
        return bce(logits, batch.labels, batch.mask)

    train_step = make_train_step(loss_fn)
    loss = train_step(model, optimizer, batch)   # model and optimizer updated in place

The optimizer is Flax's own ``nnx.Optimizer``: with ``wrt=nnx.Param`` it trains the
parameters by optax, and the ``FusedTables`` (not ``Param`` s) train themselves inside the
backward. The step splits the model into its ``wrt`` parameters, its fused tables and the
rest (e.g. RNG counters, carried through) and runs ``jaxrec.fused.guarded_update`` on them:
one jitted function that donates parameters, optax state, tables and the rest, so every
table, slot and index (a dynamic table's, updated in place by its handler) stays in the
buffer it already occupies. Plain tables (``nnx.Param``) go
through the same step: optax trains them from dense gradients.

**Sharded models** (``jaxrec.parallel.shard``) take the same step: when the model's
``TableCollection`` s live on a mesh, the step is ``jax.jit(shard_map(body))`` over the
mesh axis and takes batches from ``jaxrec.parallel.shard_batch`` (a leading device axis).
On each device ``body`` runs ``loss_fn`` on that device's samples (the sharded collections
exchange ids and pooled embeddings with collectives), differentiates the mean over
devices of the loss (fused tables come back updated shard by shard), adds up the
gradients of replicated parameters over the devices (``psum``: the dense part is data
parallel) and applies optax to every parameter where it lives. ``loss`` is the mean over
devices; ``aux`` comes back with a leading device axis.

Host time: this is Flax's "split once, jit a pure function of the states" pattern. The
model's split is kept between steps while its structure stays the same
(``_split_cache``), the step takes and returns flat lists of raw arrays, and the compiled
function is looked up once per split, so issuing a step costs a list walk, not a graph
walk (at 4 GPUs the graph walk had made the host the bottleneck of the sharded DLRM).
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import weakref

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrec import _step_guard
from jaxrec._mesh import CpuPacer, on_mesh
from jaxrec.fused import guarded_update
from jaxrec.fused import set_learning_rate as _set_tables_learning_rate
from jaxrec.nn import host_cache
from jaxrec.nn._collection import TableCollection
from jaxrec.nn._fused_variable import FusedTables
from jaxrec.nn._split_cache import SplitCache, split_for_training, write_back


class TrainStep:
    """``train_step(model, optimizer, *batch, prefetch=None) -> loss``, built by
    ``make_train_step``.

    ``check()`` waits for the issued steps and raises what they found (a
    ``jaxrec.NonFiniteError`` or a FATAL bounds-check ``ValueError``, the step's update
    skipped); a call raises it too once the device has finished the bad step (read every
    16 calls), so the host never waits for the device. ``stats()``: host ints ``steps``,
    ``nonfinite_steps``, ``ids_corrected`` (WARNING bounds checks) and ``nonfinite_rows``
    (fused table rows kept because their update would not stay finite) so far.
    """

    def __init__(self, loss_fn, *, has_aux: bool, donate: bool, on_nonfinite: str):
        self._loss_fn, self._has_aux, self._donate = loss_fn, has_aux, donate
        self._policy = on_nonfinite
        self._monitor = _step_guard.StepMonitor()
        self._splits = SplitCache(split_for_training)
        self._optimizers = SplitCache()
        self._per_graphdef = {}  # model graphdef -> (mesh, axis, {key: (jitted, messages)})
        self._opt_graphdefs = {}  # optimizer graphdef -> a small int that stands for it in keys
        self._pacer = CpuPacer()  # on CPU devices, a sharded step's queue stays short

    def __call__(self, model: nnx.Module, optimizer: nnx.Optimizer, *batch, prefetch=None):
        if not isinstance(optimizer, nnx.Optimizer):
            raise TypeError(f"optimizer must be a flax.nnx.Optimizer (nnx.Optimizer(model, tx, "
                            f"wrt=nnx.Param)), got {type(optimizer).__name__}")
        split = self._splits.split(model, optimizer.wrt)
        if "steps" not in split.derived:  # once per split: hashing a graphdef walks it
            found = self._per_graphdef.get(split.graphdef)
            if found is None:
                found = self._per_graphdef[split.graphdef] = (*_placement(model, optimizer.wrt), {})
            split.derived["steps"] = found
        mesh, axis, steps = split.derived["steps"]
        if prefetch is not None and mesh is not None:
            raise NotImplementedError("prefetch= is built for unsharded collections only: a sharded "
                                      "collection's host-cached tables load each batch's rows inside its step")
        opt_split = self._optimizers.split(optimizer)
        if "token" not in opt_split.derived:  # the graphdef (and its tx) hashed once per split
            opt_split.derived["token"] = self._opt_graphdefs.setdefault(
                opt_split.graphdef, len(self._opt_graphdefs))
        (opt_vars,) = opt_split.variables
        # per state, the raw value of each Variable: params, optimizer, tables, rest
        lists = [[v.get_raw_value() for v in variables] for variables in split.variables]
        lists.insert(1, [v.get_raw_value() for v in opt_vars])
        self._monitor.poll()
        lists.append(self._monitor.latch(like=next((x for x in lists[0] if isinstance(x, jax.Array)), None)))
        structure = specs = None
        if mesh is not None:  # every array on the mesh, and its spec (a spec per leaf)
            lists, structure, specs = _placed(split, lists, mesh)
        key = (opt_split.derived["token"], structure, specs, len(batch), prefetch is not None)
        compiled = steps.get(key)
        if compiled is None:
            compiled = steps[key] = self._compile(split, opt_split, optimizer, mesh, axis,
                                                  structure, specs, len(batch), prefetch is not None)
        step, messages = compiled
        upcoming = () if prefetch is None else (prefetch,)
        try:
            params, opt_state, tables, rest, loss, aux, fatal, latch = step(*lists, *batch, *upcoming)
        except jax.errors.JaxRuntimeError as e:  # raised before the step ran: nothing donated
            if self._donate and "donate the same buffer twice" in str(e):
                raise ValueError(_shared_arrays_message(model, optimizer)) from None
            raise
        write_back(split, (params, tables, rest))
        write_back(opt_split, (opt_state,))
        self._monitor.issued(fatal, latch, messages)
        if mesh is not None:
            _remember_placed(split, (params, opt_state, tables, rest, latch), structure, specs)
            self._pacer.issued(mesh, loss)
        return (loss, aux) if self._has_aux else loss

    def _compile(self, split, opt_split, optimizer, mesh, axis, structure, specs, batch_count, prefetched):
        """The jitted step over flat lists: per state (params, optimizer, tables, rest) the
        raw value of each Variable, in the split's order, then the guard's latch, the batch
        and (``prefetched``) the features to prefetch; sharded: ``shard_map`` with
        ``specs``, a spec per array leaf of those lists (``structure``)."""
        loss_fn, has_aux, graphdef = self._loss_fn, self._has_aux, split.graphdef
        tx, wrt = optimizer.tx, optimizer.wrt
        treedefs = [jax.tree.structure(s) for s in split.states]
        opt_treedef = jax.tree.structure(opt_split.states[0])
        n = 1 if mesh is None else mesh.shape[axis]
        messages: list = []

        def pure_loss(params, tables, rest, *batch):
            # ``params`` are pure arrays (as optax sees them, and as nnx.Optimizer's state
            # is laid out); new Variables, of this trace: the model may count into its
            # state (ShardedEmbeddingBagCollection.dropped_ids).
            params = jax.tree.unflatten(treedefs[0], jax.tree.leaves(params))
            model = nnx.merge(graphdef, params, tables, rest, copy=True)
            upcoming = contextlib.nullcontext()
            if prefetched:
                *batch, features = batch
                upcoming = host_cache.prefetching(features)
            with upcoming:
                out = loss_fn(model, *batch)
            loss, aux = out if has_aux else (out, None)
            return loss / n, (loss, aux, split_for_training(model, wrt)[3])

        reduce_grads = None
        if mesh is not None:  # replicated parameters' gradients are summed over the devices
            # (params lead the leaves)
            replicated = nnx.as_pure(jax.tree.unflatten(
                treedefs[0], [s == P() for s in specs[:treedefs[0].num_leaves]]))

            def reduce_grads(grads):
                return jax.tree.map(lambda g, r: jax.lax.psum(g, axis) if r else g,
                                    grads, replicated)

        update = guarded_update(pure_loss, tx, has_aux=True, on_nonfinite=self._policy,
                                messages=messages, axis_name=axis, reduce_grads=reduce_grads)

        def body(params, opt_vars, tables, rest, latch, *batch):
            lists = [jax.tree.structure(x) for x in (params, opt_vars, tables, rest)]
            if mesh is not None:  # this device's slice, without the device axis
                batch = jax.tree.map(lambda x: x[0], batch)
            params, tables, rest = (jax.tree.unflatten(td, jax.tree.leaves(x))
                                    for td, x in zip(treedefs, (params, tables, rest)))
            params = nnx.as_pure(params)
            optimizer = nnx.merge(opt_split.graphdef,
                                  jax.tree.unflatten(opt_treedef, jax.tree.leaves(opt_vars)))
            opt_state = nnx.as_pure(optimizer.opt_state)
            params, opt_state, tables, (_, (loss, aux, rest)), fatal, latch = update(
                params, opt_state, tables, latch, rest, *batch)
            nnx.update(optimizer.opt_state, nnx.state(opt_state))
            optimizer.step[...] += 1
            out = [jax.tree.unflatten(td, jax.tree.leaves(x))
                   for td, x in zip(lists, (params, nnx.state(optimizer), tables, rest))]
            if mesh is not None:
                loss = jax.lax.pmean(loss, axis)
                aux = jax.tree.map(lambda x: jnp.asarray(x)[None], aux)
            return (*out, loss, aux, fatal, latch)

        if mesh is not None:
            state_specs = tuple(jax.tree.unflatten(structure, specs))
            in_specs = (*state_specs, *(P(axis),) * batch_count)
            out_specs = (*state_specs[:4], P(), P(axis), P(), P())
            body = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=False)
        # the latch (4) always: see _step_guard.StepMonitor
        donated = (0, 1, 2, 3, 4) if self._donate else (4,)
        return jax.jit(body, donate_argnums=donated), messages

    def check(self) -> None:
        self._monitor.check()

    def stats(self) -> dict:
        return self._monitor.stats()


def make_train_step(loss_fn, *, has_aux: bool = False, donate: bool = True,
                    on_nonfinite: str = "raise") -> TrainStep:
    """``train_step(model, optimizer, *batch) -> loss`` (``(loss, aux)`` with ``has_aux``).

    ``loss_fn(model, *batch)`` returns the scalar loss (and ``aux``); for a sharded model it
    runs on each device with that device's slice of every batch leaf. The step updates
    ``model`` and ``optimizer`` (an ``nnx.Optimizer`` whose ``wrt`` leaves the fused tables
    out, e.g. ``nnx.Param``) in place. With ``donate`` (the default) the arrays of the
    model's state before the step are invalid afterwards; read them again from the model.

    ``on_nonfinite``: ``"raise"`` (default) and ``"skip"`` leave everything as it was when
    a step's loss or gradients are not finite; ``"raise"`` then raises
    ``jaxrec.NonFiniteError`` at a later call or ``train_step.check()`` (the steps issued
    in between update nothing either), ``"skip"`` counts
    it (``train_step.stats()``). ``"ignore"`` applies every step unchecked. A FATAL bounds
    check never updates anything and raises the same way; every device of a sharded step
    skips together.

    ``prefetch=`` (a call's keyword): the next batch's ``KeyedJaggedTensor`` (or a sequence
    of them, one per collection's features). The host-cached tables then also cache that
    batch's rows, copied from host memory in the background while this step computes; the
    rows of both batches stay cached until the next step has looked its own up
    (docs/host_memory.md, "Prefetch"). Unsharded collections only; it changes no result.
    """
    _step_guard.check_policy(on_nonfinite)
    return TrainStep(loss_fn, has_aux=has_aux, donate=donate, on_nonfinite=on_nonfinite)


def set_learning_rate(model: nnx.Module, learning_rate) -> None:
    """Sets the learning rate of every fused table of ``model`` (a float or a traced scalar:
    no recompile). The optax optimizer's rate is optax's (``optax.inject_hyperparams``)."""
    variables = [v for _, v in nnx.iter_graph(model) if isinstance(v, FusedTables)]
    if not variables:
        raise ValueError(f"{type(model).__name__} has no fused tables (collections built with "
                         "optimizer=None train by optax: set the rate there)")
    for var in variables:
        var.set_value(_set_tables_learning_rate(var.get_value(), learning_rate))


def _shared_arrays_message(model: nnx.Module, optimizer: nnx.Optimizer) -> str:
    """Names the Variables that hold one array between them (XLA refuses to donate a
    buffer twice, and names only the flattened argument)."""
    holders: dict[int, tuple[int, str]] = {}  # id(array) -> (id(Variable), its path)
    for prefix, graph in (("model", model), ("optimizer", optimizer)):
        for path, node in nnx.iter_graph(graph):
            value = node.get_raw_value() if isinstance(node, nnx.Variable) else None
            if not isinstance(value, jax.Array):
                continue
            name = ".".join([prefix, *map(str, path)])
            first = holders.setdefault(id(value), (id(node), name))
            if first[0] != id(node):
                return (f"{first[1]} and {name} hold the same array, and the train step donates "
                        "each Variable's array (its buffer is reused for the new value): give each "
                        "Variable an array of its own, e.g. jnp.array(x, copy=True), or build the "
                        "step with make_train_step(..., donate=False). Nothing was changed.")
    return "two Variables hold the same array, which the train step cannot donate twice"


def _placement(model: nnx.Module, wrt) -> tuple[jax.sharding.Mesh | None, str | None]:
    """The mesh and axis of the model's sharded collections, or ``(None, None)``."""
    fused_in_wrt = [".".join(map(str, path)) for path, _ in nnx.to_flat_state(
        nnx.state(model, nnx.All(wrt, FusedTables)))]
    if fused_in_wrt:
        raise ValueError(f"the optimizer's wrt filter also selects the fused tables {fused_in_wrt}, "
                         "which their own optimizer updates in the backward; build the optimizer "
                         "with wrt=nnx.Param")
    collections = [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, TableCollection)]
    placed = {(m.mesh, m.axis_name) for _, m in collections if m.mesh is not None}
    if not placed:
        return None, None
    if len(placed) > 1:
        raise ValueError(f"the model's sharded collections live on {len(placed)} different "
                         "meshes or axes; shard them all with one mesh (jaxrec.parallel.shard)")
    fused = [".".join(map(str, path)) or "<model>" for path, m in collections
             if m.mesh is None and m.fused]
    if fused:  # replicated fused tables would each be updated from one device's batch
        raise ValueError(f"the model also holds unsharded collections with fused tables {fused}; "
                         "every device would update its replica from its own samples. Shard them "
                         "too (jaxrec.parallel.shard, DATA_PARALLEL keeps them whole) or make them "
                         "plain (optimizer=None)")
    return placed.pop()


def _placed(split, lists, mesh):
    """``(lists, structure, specs)``: ``lists`` with every array on ``mesh``, its tree
    structure and a spec per leaf. The values the last step returned are on the mesh
    with the specs it took: when every value is one of them (by identity; they are held
    weakly, so that values replaced since are freed), nothing is walked."""
    last = split.derived.get("placed")
    if last is not None:
        refs, structure, specs = last
        values = [*itertools.chain(*lists[:-1]), lists[-1]]
        if len(values) == len(refs) and all(map(operator.is_, (r() for r in refs), values)):
            return lists, structure, specs
    leaves, structure = jax.tree.flatten(lists)
    leaves = [on_mesh(x, mesh) for x in leaves]
    specs = tuple(x.sharding.spec for x in leaves)
    return jax.tree.unflatten(structure, leaves), structure, specs


def _remember_placed(split, outputs, structure, specs) -> None:
    """Keeps (weakly) the step's new values, for ``_placed``: per state, its list of raw
    values, then the latch. Values are arrays or frozen pytrees (the fused tables), so
    one seen again holds the same leaves; a raw value that cannot be referenced weakly
    (a list, a dict) turns this off: every step walks."""
    values = [*itertools.chain(*outputs[:-1]), outputs[-1]]
    try:
        split.derived["placed"] = ([weakref.ref(x) for x in values], structure, specs)
    except TypeError:
        split.derived.pop("placed", None)
