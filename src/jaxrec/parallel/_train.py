"""One jitted step for a whole sharded model, and the batches it takes.

::

    model = shard(DLRM(ebc, ...), plan, mesh)                 # tables sharded, rest replicated
    optimizer = PartitionedOptimizer(model, optax.adam(1e-3))
    train_step = make_train_step(loss_fn)                     # loss_fn(model, *local_batch)
    for batch in log.batches(8 * 1024, steps):               # a global batch of 8 x 1024
        loss = train_step(model, optimizer, shard_batch(batch, mesh))

The step is ``jax.jit(shard_map(body))`` over the mesh axis. On each device ``body`` runs
``loss_fn`` on that device's samples (the sharded collections exchange ids and pooled
embeddings with collectives), takes ``jaxrec.optim.fused_value_and_grad`` of
``mean over devices of loss_fn`` (fused tables come back updated in place, shard by
shard), adds up the gradients of replicated parameters over the devices (``psum``: the
dense part and data-parallel plain tables are data parallel), and applies optax to every
parameter where it lives (sharded plain tables shard by shard). Parameters, optax state
and tables are donated, as in ``jaxrec.nn.make_train_step``. The model's split is kept
between steps while its structure is unchanged (``jaxrec.nn._split_cache``) and the
jitted function takes flat lists of arrays: at 4 GPUs the host's time to issue a step
otherwise exceeded the GPUs' time.

Batches (``shard_batch``): every leaf gets a leading device axis, sharded over the mesh
axis, and each device sees its own slice without that axis: arrays ``[N * B, ...]`` become
``[N, B, ...]``; a KeyedJaggedTensor of stride N * B becomes N KJTs of stride B whose
capacities are padded to one static size (the largest device's ids, bucketed). A device
may have fewer real samples (padding rows, mask 0) or no ids at all.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrec import _step_guard, optim
from jaxrec.nn import PartitionedOptimizer
from jaxrec.nn._split_cache import SplitCache, split_for_training, write_back
from jaxrec.nn._tables import TableCollection
from jaxrec.parallel._sharded_ebc import (
    ShardedEmbeddingBagCollection,
    auto_mesh,
    on_mesh,
)
from jaxrec.sparse import KeyedJaggedTensor, capacity_bucket


def mesh_of(model) -> tuple[jax.sharding.Mesh, str]:
    """The mesh and axis of the model's sharded collections (one pair for all)."""
    modules = list(nnx.iter_modules(model))
    found = {(m.mesh, m.axis_name) for _, m in modules
             if isinstance(m, ShardedEmbeddingBagCollection)}
    if len(found) != 1:
        raise ValueError("the model needs ShardedEmbeddingBagCollections on one mesh and axis "
                         f"(build them with jaxrec.parallel.shard); found {len(found)} meshes/axes")
    fused = [".".join(map(str, path)) or "<model>" for path, m in modules
             if isinstance(m, TableCollection) and m.fused]
    if fused:  # replicated fused tables would each be updated from one device's batch
        raise ValueError(f"the model also holds unsharded collections with fused tables {fused}; "
                         "every device would update its replica from its own samples. Shard them "
                         "too (jaxrec.parallel.shard, DATA_PARALLEL keeps them whole) or make them "
                         "plain (optimizer=None)")
    return found.pop()


def _placed(tree, mesh):
    return jax.tree.map(functools.partial(on_mesh, mesh=mesh), tree)


def _specs(tree):
    return jax.tree.map(lambda x: x.sharding.spec, tree)


def _key(*trees):
    """Spec trees as a hashable key (structure and leaves); ``_unkey`` rebuilds them."""
    return tuple((jax.tree.structure(t), tuple(jax.tree.leaves(t))) for t in trees)


def _unkey(key):
    return tuple(jax.tree.unflatten(treedef, leaves) for treedef, leaves in key)


def make_train_step(loss_fn, *, has_aux: bool = False, donate: bool = True,
                    on_nonfinite: str = "raise"):
    """``train_step(model, optimizer, *batch) -> loss`` (``(loss, aux)`` with ``has_aux``)
    for a model with sharded collections; see the module doc.

    ``loss_fn(model, *local_batch)`` runs on each device with that device's slice of every
    batch leaf (``shard_batch``). The objective is the mean over devices of its value, so
    with equal local batch sizes a per-device mean loss gives the global mean. ``loss`` is
    that mean; ``aux`` comes back with a leading device axis. ``on_nonfinite``, and the
    step's ``check()`` and ``stats()``: as for ``jaxrec.nn.make_train_step``; every device
    skips a step together.
    """

    def compiled(graphdef, treedefs, opt_treedef, tx, mesh, axis, structure, specs,
                 batch_count):
        messages: list = []
        # The step takes and returns flat lists (per state, the raw value of each Variable;
        # the optax state's leaves): flattening nnx States on each call cost host time.
        # ``treedefs``: the states'; ``structure``/``specs``: the tree of those lists and a
        # spec per leaf.
        param_specs, opt_specs, table_specs, rest_specs = jax.tree.unflatten(structure, specs)
        # params lead the leaves; their replicated gradients are summed over the devices
        replicated = jax.tree.unflatten(treedefs[0],
                                        [s == P() for s in specs[:treedefs[0].num_leaves]])
        n = mesh.shape[axis]

        def body(params, opt_state, tables, rest, *batch):
            batch = jax.tree.map(lambda x: x[0], batch)
            raw = [jax.tree.structure(x) for x in (params, tables, rest)]
            params, tables, rest = (jax.tree.unflatten(td, jax.tree.leaves(x))
                                    for td, x in zip(treedefs, (params, tables, rest)))
            opt_state = jax.tree.unflatten(opt_treedef, opt_state)

            def pure_loss(params, tables, rest, *batch):
                # New Variables, of this trace: the model may count into its state
                # (ShardedEmbeddingBagCollection.dropped_ids).
                model = nnx.merge(graphdef, params, tables, rest, copy=True)
                out = loss_fn(model, *batch)
                loss, aux = out if has_aux else (out, None)
                return loss / n, (loss, aux, split_for_training(model)[3])

            def sum_replicated(grads):
                return jax.tree.map(lambda g, r: jax.lax.psum(g, axis) if r else g,
                                    grads, replicated)

            update = optim.guarded_update(pure_loss, tx, has_aux=True, on_nonfinite=policy,
                                          messages=messages, axis_name=axis,
                                          reduce_grads=sum_replicated)
            params, opt_state, tables, (_, (loss, aux, rest)), stats = update(
                params, opt_state, tables, rest, *batch)
            params, tables, rest = (jax.tree.unflatten(td, jax.tree.leaves(x))
                                    for td, x in zip(raw, (params, tables, rest)))
            aux = jax.tree.map(lambda x: jnp.asarray(x)[None], aux)
            return (params, jax.tree.leaves(opt_state), tables, rest,
                    jax.lax.pmean(loss, axis), aux, stats)

        in_specs = (param_specs, opt_specs, table_specs, rest_specs) + (P(axis),) * batch_count
        out_specs = (param_specs, opt_specs, table_specs, rest_specs, P(), P(axis), P())
        mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                               check_vma=False)
        return jax.jit(mapped, donate_argnums=(0, 1, 2) if donate else ()), messages

    _step_guard.check_policy(on_nonfinite)
    policy = on_nonfinite
    monitor = _step_guard.StepMonitor(policy)
    splits = SplitCache()
    per_graphdef = {}  # graphdef -> (mesh, axis, {key: jitted step}), shared by equal splits

    def train_step(model: nnx.Module, optimizer: PartitionedOptimizer, *batch):
        if not isinstance(optimizer, PartitionedOptimizer):
            raise TypeError(f"optimizer must be a jaxrec.nn.PartitionedOptimizer, got "
                            f"{type(optimizer).__name__}")
        split = splits.split(model)
        if "steps" not in split.derived:  # once per split: hashing a graphdef walks it
            found = per_graphdef.get(split.graphdef)
            if found is None:
                found = per_graphdef[split.graphdef] = (*mesh_of(model), {})
            split.derived["steps"] = found
        mesh, axis, steps = split.derived["steps"]
        params, tables, rest = ([v.get_raw_value() for v in variables]
                                for variables in split.variables)
        opt_treedef, opt_state = optimizer.flat_opt_state()
        leaves, structure = jax.tree.flatten((params, opt_state, tables, rest))
        leaves = [on_mesh(x, mesh) for x in leaves]
        specs = tuple(x.sharding.spec for x in leaves)
        key = (optimizer.tx, opt_treedef, structure, specs, len(batch))
        step = steps.get(key)
        if step is None:
            treedefs = [jax.tree.structure(s) for s in split.states]
            step = steps[key] = compiled(split.graphdef, treedefs, opt_treedef, optimizer.tx,
                                         mesh, axis, structure, specs, len(batch))
        step, messages = step
        params, opt_state, tables, rest, loss, aux, stats = step(
            *jax.tree.unflatten(structure, leaves), *batch)
        write_back(split, (params, tables, rest))
        optimizer.set_flat_opt_state(opt_treedef, opt_state)
        optimizer.step += 1
        monitor.record(stats, messages)
        return (loss, aux) if has_aux else loss

    # The nn step's interface: check() and stats() (jaxrec.nn.TrainStep).
    train_step.check, train_step.stats = monitor.check, monitor.stats
    return train_step


def make_forward(fn):
    """``forward(model, *batch)``: ``fn(model, *local_batch)`` on every device (inside one
    jitted ``shard_map``), its outputs stacked along a leading device axis. For evaluation
    and inspection; changes to the model's state are not kept."""

    @functools.cache
    def compiled(graphdef, mesh, axis, spec_key, batch_count):
        (state_specs,) = _unkey(spec_key)

        def body(state, *batch):
            model = nnx.merge(graphdef, state)
            out = fn(model, *jax.tree.map(lambda x: x[0], batch))
            return jax.tree.map(lambda x: jnp.asarray(x)[None], out)

        mapped = jax.shard_map(body, mesh=mesh, in_specs=(state_specs,) + (P(axis),) * batch_count,
                               out_specs=P(axis), check_vma=False)
        return jax.jit(mapped)

    def forward(model: nnx.Module, *batch):
        mesh, axis = mesh_of(model)
        graphdef, state = nnx.split(model)
        state = _placed(state, mesh)
        return compiled(graphdef, mesh, axis, _key(_specs(state)), len(batch))(state, *batch)

    return forward


# --- batches -----------------------------------------------------------------------------

def shard_batch(batch, mesh: jax.sharding.Mesh, *, axis_name: str | None = None,
                capacity: int | None = None, per_device: bool = False,
                model: nnx.Module | None = None):
    """The device-stacked batch of ``make_train_step`` (module doc), placed on ``mesh``.

    ``batch``: a global batch (any pytree: arrays with a leading batch axis of N * B rows,
    KeyedJaggedTensors of stride N * B; device d gets rows ``d*B:(d+1)*B``), or with
    ``per_device=True`` a list of N batches, one per device. ``capacity``: the static
    capacity of every device's KJT; default: the largest device's number of ids, bucketed
    (``capacity_bucket``), so that recompiles stay rare. ``model``: its sharded collections
    size their row return from this batch's KJTs (``fit_row_return``; their groups of
    bounded features then receive distinct rows, not pooled bags or partial sums).
    """
    mesh = auto_mesh(mesh)
    axis_name = mesh.axis_names[0] if axis_name is None else axis_name
    n = mesh.shape[axis_name]
    if per_device:
        parts = list(batch)
        if len(parts) != n:
            raise ValueError(f"per_device=True needs one batch per device: got {len(parts)} "
                             f"batches for {n} devices")
    else:
        parts = [_slice(batch, d, n) for d in range(n)]
    is_kjt = lambda x: isinstance(x, KeyedJaggedTensor)
    kjts = [[x for x in jax.tree.leaves(p, is_leaf=is_kjt) if is_kjt(x)] for p in parts]
    if model is not None:
        _fit_row_return(model, kjts)
    caps = []
    for j in range(len(kjts[0])):
        need = max(int(np.asarray(k[j].lengths()).sum()) for k in kjts)
        if capacity is not None and need > capacity:
            raise ValueError(f"a device's KJT holds {need} ids but capacity={capacity}; pass a "
                             "larger capacity (or None)")
        caps.append(capacity_bucket(need) if capacity is None else capacity)
    stacked = []
    for p in parts:
        leaves, treedef = jax.tree.flatten(p, is_leaf=is_kjt)
        fitted, it = [], iter(caps)
        for x in leaves:
            fitted.append(_fit(x, next(it)) if is_kjt(x) else np.asarray(x))
        stacked.append(jax.tree.unflatten(treedef, fitted))
    sharding = NamedSharding(mesh, P(axis_name))
    return jax.tree.map(lambda *xs: jax.device_put(np.stack([np.asarray(x) for x in xs]), sharding),
                        *stacked)


def _fit_row_return(model: nnx.Module, kjts: list[list[KeyedJaggedTensor]]) -> None:
    """Sizes the row return of ``model``'s sharded collections from every KJT of the batch
    that holds their features (``kjts[device][leaf]``)."""
    collections = [m for _, m in nnx.iter_modules(model)
                   if isinstance(m, ShardedEmbeddingBagCollection)]
    if not collections:
        raise ValueError("shard_batch(model=) needs a model with ShardedEmbeddingBagCollections "
                         "(jaxrec.parallel.shard)")
    for ebc in collections:
        for j in range(len(kjts[0])):
            if set(ebc.feature_names) <= set(kjts[0][j].keys()):
                ebc.fit_row_return([k[j] for k in kjts])


def _slice(tree, d: int, n: int):
    """Device ``d``'s rows of a global batch."""
    def one(x):
        if isinstance(x, KeyedJaggedTensor):
            return _slice_kjt(x, d, n)
        x = np.asarray(x)
        if x.ndim == 0 or x.shape[0] % n:
            raise ValueError(f"every batch leaf needs a leading batch axis divisible by the "
                             f"{n} devices, got shape {x.shape}; pad the batch (mask 0 rows)")
        rows = x.shape[0] // n
        return x[d * rows:(d + 1) * rows]
    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, KeyedJaggedTensor))


def _slice_kjt(kjt: KeyedJaggedTensor, d: int, n: int) -> KeyedJaggedTensor:
    stride = kjt.stride()
    if stride % n:
        raise ValueError(f"the KJT's stride (batch size) {stride} is not a multiple of the {n} "
                         "devices; pad the batch with empty rows")
    b, keys = stride // n, kjt.keys()
    lengths = np.asarray(kjt.lengths()).reshape(len(keys), stride)
    offsets = np.concatenate([[0], np.cumsum(lengths.ravel())]).reshape(-1)
    values = np.asarray(kjt.values())
    weights = None if kjt.weights_or_none() is None else np.asarray(kjt.weights())
    take = np.concatenate([np.arange(offsets[k * stride + d * b], offsets[k * stride + (d + 1) * b])
                           for k in range(len(keys))]).astype(np.int64)
    return KeyedJaggedTensor._make(keys, b, values[take], lengths[:, d * b:(d + 1) * b].ravel(),
                                   None if weights is None else weights[take])


def _fit(kjt: KeyedJaggedTensor, capacity: int) -> KeyedJaggedTensor:
    values = np.asarray(kjt.values())[:int(np.asarray(kjt.lengths()).sum())]
    weights = kjt.weights_or_none()
    weights = None if weights is None else np.asarray(weights)[:values.shape[0]]
    pad = capacity - values.shape[0]
    return KeyedJaggedTensor._make(
        kjt.keys(), kjt.stride(), np.pad(values, (0, pad)),
        np.asarray(kjt.lengths(), np.int32),
        None if weights is None else np.pad(weights, (0, pad)))
