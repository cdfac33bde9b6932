"""Evaluating a sharded model, and the device-stacked batches its train step takes.

::

    model = shard(DLRM(ebc, ...), plan, mesh)                 # tables sharded, rest replicated
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    train_step = jaxrec.nn.make_train_step(loss_fn)           # loss_fn(model, *local_batch)
    for batch in log.batches(8 * 1024, steps):               # a global batch of 8 x 1024
        loss = train_step(model, optimizer, shard_batch(batch, mesh))
    scores = make_forward(score_fn)(model, shard_batch(eval_batch, mesh))

``jaxrec.nn.make_train_step`` runs the step under ``shard_map`` when the model's
collections are sharded (its module doc). ``make_forward`` does the same for a forward
pass: ``fn`` on every device, outputs stacked along a leading device axis.

Batches (``shard_batch``): every leaf gets a leading device axis, sharded over the mesh
axis, and each device sees its own slice without that axis: arrays ``[N * B, ...]`` become
``[N, B, ...]``; a KeyedJaggedTensor of stride N * B becomes N KJTs of stride B whose
capacities are padded to one static size (the largest device's ids, bucketed). A device
may have fewer real samples (padding rows, mask 0) or no ids at all.

A variable-batch KJT (VBE: ``stride_per_key_per_rank`` and ``inverse_indices``) is split
by samples too: device d gets, for each key, the bags that its B samples use, each once,
then empty bags up to B, and inverse indices into them. Every device's KJT then holds B
bags per key (one static shape), and its ids are only those of its distinct bags::

    # full batch of 4 on 2 devices, key "user": bags [u0, u1], inverse [0, 1, 1, 1]
    # device 0: samples 0, 1 -> bags [u0, u1], inverse [0, 1]
    # device 1: samples 2, 3 -> bags [u1, (empty)], inverse [0, 0]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrec._mesh import CpuPacer, on_mesh
from jaxrec.nn import TableCollection
from jaxrec.parallel._sharded_ebc import ShardedEmbeddingBagCollection, auto_mesh
from jaxrec.sparse import KeyedJaggedTensor, capacity_bucket


def mesh_of(model) -> tuple[jax.sharding.Mesh, str]:
    """The mesh and axis of the model's sharded collections (one pair for all)."""
    found = {(m.mesh, m.axis_name) for _, m in nnx.iter_modules(model)
             if isinstance(m, TableCollection) and m.mesh is not None}
    if len(found) != 1:
        raise ValueError("the model needs ShardedEmbeddingBagCollections on one mesh and axis "
                         f"(build them with jaxrec.parallel.shard); found {len(found)} meshes/axes")
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

    pacer = CpuPacer()

    def forward(model: nnx.Module, *batch):
        mesh, axis = mesh_of(model)
        graphdef, state = nnx.split(model)
        state = _placed(state, mesh)
        out = compiled(graphdef, mesh, axis, _key(_specs(state)), len(batch))(state, *batch)
        pacer.issued(mesh, out)
        return out

    return forward


# --- batches -----------------------------------------------------------------------------

def shard_batch(batch, mesh: jax.sharding.Mesh, *, axis_name: str | None = None,
                capacity: int | None = None, per_device: bool = False,
                model: nnx.Module | None = None, process_local: bool = False):
    """The device-stacked batch of ``make_train_step`` (module doc), placed on ``mesh``.

    ``batch``: a global batch (any pytree: arrays with a leading batch axis of N * B rows,
    KeyedJaggedTensors of stride N * B; device d gets rows ``d*B:(d+1)*B``), or with
    ``per_device=True`` a list of N batches, one per device. ``capacity``: the static
    capacity of every device's KJT; default: the largest device's number of ids, bucketed
    (``capacity_bucket``), so that recompiles stay rare. ``model``: its sharded collections
    size their row return from this batch's KJTs (``fit_row_return``; their groups of
    bounded features then receive distinct rows, not pooled bags or partial sums).
    ``process_local``: with several processes (docs/multiprocess.md), ``batch`` holds only
    this process's rows, for its own devices of the mesh, in mesh order; every process calls
    ``shard_batch`` alike, and the KJTs' capacity is ``capacity`` or else the largest need
    over all processes (agreed on by a collective: pass ``capacity`` to call it from a
    data-loading thread).
    """
    mesh = auto_mesh(mesh)
    axis_name = mesh.axis_names[0] if axis_name is None else axis_name
    n = mesh.shape[axis_name]
    if process_local:
        if model is not None:
            raise ValueError("shard_batch(process_local=True) cannot size the row return from one "
                             "process's KJTs; pass model=None (and size it with fit_row_return on the "
                             "global batch's KJTs) or give every process the global batch")
        n = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    if per_device:
        parts = list(batch)
        if len(parts) != n:
            raise ValueError(f"per_device=True needs one batch per device: got {len(parts)} "
                             f"batches for {n} devices")
        parts = [jax.tree.map(lambda x: _used_bags(x, 0, _samples(x)) if _is_vbe(x) else x, p,
                              is_leaf=lambda x: isinstance(x, KeyedJaggedTensor)) for p in parts]
    else:
        parts = [_slice(batch, d, n) for d in range(n)]
    is_kjt = lambda x: isinstance(x, KeyedJaggedTensor)
    kjts = [[x for x in jax.tree.leaves(p, is_leaf=is_kjt) if is_kjt(x)] for p in parts]
    if model is not None:
        _fit_row_return(model, kjts)
    needs = [max(int(np.asarray(k[j].lengths()).sum()) for k in kjts) for j in range(len(kjts[0]))]
    if process_local and capacity is None and jax.process_count() > 1:
        # One static capacity in every process: agreed on by a collective, so calls must be
        # made in the same order everywhere (with a given capacity, none is needed).
        needs = np.asarray(multihost_utils.process_allgather(np.asarray(needs, np.int64))).max(axis=0).tolist()
    caps = []
    for need in needs:
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
    if process_local:
        return jax.tree.map(lambda *xs: jax.make_array_from_process_local_data(
            sharding, np.stack([np.asarray(x) for x in xs])), *stacked)
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


def _is_vbe(x) -> bool:
    return isinstance(x, KeyedJaggedTensor) and x.variable_stride_per_key()


def _samples(kjt: KeyedJaggedTensor) -> int:
    """The batch of a VBE KJT: its inverse indices' samples."""
    if kjt.inverse_indices_or_none() is None:
        raise ValueError("a variable-batch (VBE) KJT needs inverse_indices to be split over "
                         "devices by sample; build it with inverse_indices=(keys, int[num_keys, batch])")
    return kjt.inverse_indices()[1].shape[1]


def _slice_kjt(kjt: KeyedJaggedTensor, d: int, n: int) -> KeyedJaggedTensor:
    if kjt.variable_stride_per_key():
        full = _samples(kjt)
        if full % n:
            raise ValueError(f"the VBE KJT's batch (its inverse_indices' {full} samples) is not a "
                             f"multiple of the {n} devices; pad the batch with empty rows")
        return _used_bags(kjt, d * (full // n), (d + 1) * (full // n))
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
    return KeyedJaggedTensor(keys, values[take], lengths=lengths[:, d * b:(d + 1) * b].ravel(),
                             weights=None if weights is None else weights[take], stride=b)


def _used_bags(kjt: KeyedJaggedTensor, lo: int, hi: int) -> KeyedJaggedTensor:
    """Samples ``[lo, hi)`` of a VBE KJT: per key, the bags they use (each once, in bag order),
    then empty bags up to ``hi - lo``, and inverse indices into them (module doc)."""
    keys, b = kjt.keys(), hi - lo
    inverse = np.asarray(kjt.inverse_indices()[1])[:, lo:hi]
    lengths = np.asarray(kjt.lengths(), np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    first_bag = np.concatenate([[0], np.cumsum(kjt.stride_per_key())])
    bags, local = [], np.empty((len(keys), b), np.int32)
    new_lengths = np.zeros((len(keys), b), np.int32)
    for k in range(len(keys)):
        used, local[k] = np.unique(inverse[k], return_inverse=True)
        bags.append(first_bag[k] + used)
        new_lengths[k, :used.size] = lengths[bags[-1]]
    bags = np.concatenate(bags).astype(np.int64)
    counts = lengths[bags]
    take = np.repeat(starts[bags] - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(
        keys, np.asarray(kjt.values())[take], lengths=new_lengths.ravel(),
        weights=None if weights is None else np.asarray(weights)[take],
        stride_per_key_per_rank=[[b]] * len(keys), inverse_indices=(keys, local))


def _fit(kjt: KeyedJaggedTensor, capacity: int) -> KeyedJaggedTensor:
    values = np.asarray(kjt.values())[:int(np.asarray(kjt.lengths()).sum())]
    weights = kjt.weights_or_none()
    weights = None if weights is None else np.asarray(weights)[:values.shape[0]]
    pad = capacity - values.shape[0]
    vbe = {}
    if kjt.variable_stride_per_key():
        vbe = {"stride_per_key_per_rank": kjt.stride_per_key_per_rank(),
               "inverse_indices": (kjt.keys(), np.asarray(kjt.inverse_indices()[1]))}
    return KeyedJaggedTensor(
        kjt.keys(), np.pad(values, (0, pad)), lengths=np.asarray(kjt.lengths(), np.int32),
        weights=None if weights is None else np.pad(weights, (0, pad)),
        stride=None if vbe else kjt.stride(), capacity=capacity, **vbe)
