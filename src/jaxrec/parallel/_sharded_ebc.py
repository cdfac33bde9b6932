"""``ShardedEmbeddingBagCollection``: the EmbeddingBagCollection of a plan over a mesh.

::

    mesh = jax.make_mesh((8,), ("data",))
    plan = EmbeddingShardingPlanner(Topology(world_size=8, hbm_cap=16 << 30)).plan(tables)
    ebc = ShardedEmbeddingBagCollection(tables, plan, mesh, optimizer=RowWiseAdagrad(...),
                                        rngs=nnx.Rngs(0))          # or shard(model, plan, mesh)

Inside ``shard_map`` over the mesh axis (``jaxrec.nn.make_train_step`` /
``make_forward`` put it there) each device calls it with *its* KJT of B samples and
gets *its* ``KeyedTensor [B, sum(dims)]``, with the keys, order and values that the
unsharded ``EmbeddingBagCollection`` gives for those samples (TorchRec's contract).
In between: ids to the shard owners, one lookup per group, pooled results back
(``_dist.py``); the backward runs the same path in reverse and, for fused tables,
applies the optimizer to each shard in place.

The tables live in one variable per group (``_layout.py``): a ``FusedTables`` (weights,
optimizer state and step of the fused optimizer) or an ``nnx.Param``, whose arrays are
global and sharded over the axis (each device's block is its virtual table), replicated
for data-parallel groups. ``split_embedding_weights`` / ``portable_tables`` give the
whole tables back; ``load_portable_tables`` takes them from any plan.

Tables in host memory (``placement="host"`` or ``"host_cached"``, by their configs or the
plan's ``placement``) form groups apart, each device's virtual table in its host memory;
a lookup reads the batch's rows (nn/host_tables.py) or maps them to the device's own cache
(_host_cache.py). They do not take the row return.

A dynamic-vocabulary table (``EmbeddingBagConfig(dynamic=...)``) is ROW_WISE in equal
blocks, each device's block holding one bucket range of the hash index: ids go to the
device of their hash, which maps them to rows (``_dynamic.py``). ``dynamic_statistics``,
``dynamic_changes``, evaluation (``model.eval()``: ``deterministic``) and the portable
form (with the whole index) are those of the unsharded collection.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrec import _step_guard
from jaxrec._mesh import on_mesh, replicate, to_host
from jaxrec.fused import FusedEmbeddingTables
from jaxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig, FusedTables, TableCollection, host_cache
from jaxrec.nn.dynamic import DynamicIndex, check_collection, check_dynamic_table, statistics
from jaxrec.nn.dynamic import to_portable as index_to_portable
from jaxrec.nn.host_cache import HostCache, cache_rows_for
from jaxrec.nn.host_tables import batch_rows, buffers
from jaxrec.ops import BoundsCheckMode, PoolingMode, bounds_check_indices, hash_table
from jaxrec.ops.bounds_check import as_bounds_check_mode
from jaxrec.ops.host_cache import HOST_MEMORY
from jaxrec.ops.tbe_kjt import features_in_order, require_features
from jaxrec.optim import SGD, Adagrad, Adam, OptimizerConfig
from jaxrec.parallel import _dist, _dynamic, _host_cache, _row_return
from jaxrec.parallel._layout import A2A, DP, REDUCE, build_layout, placement
from jaxrec.parallel._portable import pack_group, portable_sharding, unpack
from jaxrec.parallel._table_spec import table_specs
from jaxrec.parallel._types import ShardingPlan, ShardingType
from jaxrec.sparse import KeyedJaggedTensor, KeyedTensor

_COMM_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))
_COLUMN_SEPARABLE = (SGD, Adagrad, Adam)
"""Optimizers whose update of a row's column does not read the row's other columns."""


class DroppedIds(nnx.Variable):
    """Ids whose rows did not fit the row return's capacity, summed over steps and
    devices (0 when every batch came through ``shard_batch(..., model=)``)."""


class ShardedEmbeddingBagCollection(TableCollection):
    """An ``EmbeddingBagCollection`` whose tables are sharded by ``plan`` over ``mesh``.

    Args:
      tables: the ``EmbeddingBagConfig`` s (output order as the unsharded module's).
      plan: a ``ShardingPlan`` for these tables and ``mesh.shape[axis_name]`` devices.
      mesh: the ``jax.sharding.Mesh``; its ``axis_name`` axis carries the batch.
      axis_name: default: the mesh's first axis.
      optimizer: None (plain ``nnx.Param`` tables, trained by optax) or a fused optimizer.
      rngs: initialises the tables exactly as the unsharded module does (same keys, same
        order), so both start from identical tables.
      initial: instead of ``rngs``, the tables' portable form
        ``{table: {"weights": [rows, dim], <state field>: ..., "step": int32[]}}`` (what
        ``shard`` passes, and what ``portable_tables`` returns).
      comm_dtype: the dtype of the pooled embeddings (and their gradients) on the wire:
        float32 (default, exact) or bfloat16 / float16, TorchRec's quantized comms
        (``QCommsConfig``): half the bytes of the output all-to-all and reduce-scatter,
        at 16-bit rounding of the pooled values and of their gradients (row-wise partial
        sums are also added in that dtype). Lookups and updates stay float32.
      max_ids_per_bag: None, an int for every feature, or ``{feature: int}``: the most ids
        of one bag (1 for one-hot features). A group whose features all have a bound reads,
        per source device, only the ids of its own features (``B * max_ids_per_bag`` each)
        instead of every gathered id: its index work and the fused backward's sort shrink
        from ``N * C`` to about the share of its features. Once its batches are sized
        (``fit_row_return``), a row-wise or table-wise group whose features all have a
        bound receives the distinct rows its bags read and pools them itself, instead of
        partial sums or pooled bags (``_row_return``). A longer bag is an error under
        ``bounds_check_mode=FATAL``, cut to its first ``max_ids_per_bag`` ids under
        WARNING and IGNORE (the correction), and undefined under NONE.
      bounds_check_mode, backend, name: as for ``EmbeddingBagCollection``.

    ``comm_dtype``, ``max_ids_per_bag`` (a tuple per feature in ``feature_names`` order,
    0 for none) and ``row_return_capacity`` (per group: 0, or the row return's K) stay
    attributes of the module: static, so setting them between steps compiles a new step
    (the benchmark compares settings on one model this way). ``dropped_ids`` counts the
    ids whose rows a batch not sized by ``fit_row_return`` had past the capacity
    (WARNING, IGNORE, NONE; FATAL raises).
    """

    def __init__(self, tables: Sequence[EmbeddingBagConfig], plan: ShardingPlan,
                 mesh: jax.sharding.Mesh, *, axis_name: str | None = None,
                 optimizer: OptimizerConfig | None = None, rngs: nnx.Rngs | None = None,
                 initial: Mapping[str, Mapping[str, jax.Array]] | None = None,
                 comm_dtype=jnp.float32,
                 max_ids_per_bag: int | Mapping[str, int] | None = None,
                 bounds_check_mode: BoundsCheckMode | str = BoundsCheckMode.WARNING,
                 backend: str = "auto", name: str = "ebc"):
        tables = tuple(tables)
        wrong = [getattr(t, "name", t) for t in tables if not isinstance(t, EmbeddingBagConfig)]
        if wrong or not tables:
            raise TypeError(f"tables must be a non-empty list of EmbeddingBagConfig; {wrong} are not")
        if not isinstance(plan, ShardingPlan):
            raise TypeError(f"plan must be a jaxrec.parallel.ShardingPlan, got {type(plan).__name__}")
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        mesh = auto_mesh(mesh)
        axis_name = mesh.axis_names[0] if axis_name is None else axis_name
        if axis_name not in mesh.axis_names or mesh.shape[axis_name] != plan.world_size:
            raise ValueError(f"the plan is for {plan.world_size} devices but mesh axis "
                             f"{axis_name!r} has {dict(mesh.shape).get(axis_name)}; make the plan "
                             "for this mesh (world_size=mesh.shape[axis_name])")
        if optimizer is not None and not isinstance(optimizer, OptimizerConfig):
            raise TypeError(f"optimizer must be None or a fused optimizer config, got {optimizer!r}")
        comm_dtype = jnp.dtype(comm_dtype)
        if comm_dtype not in _COMM_DTYPES:
            raise ValueError(f"comm_dtype must be one of {[d.name for d in _COMM_DTYPES]}, got "
                             f"{comm_dtype.name}")
        check_collection(tables, optimizer)
        for t in tables:
            if getattr(t, "dynamic", None) is not None:
                _dynamic.check(t, plan.world_size)
        if (rngs is None) == (initial is None):
            raise ValueError("pass exactly one of rngs= (new tables) or initial= (portable tables)")
        specs = table_specs(tables)
        host_cache.check_collection(tables, optimizer,
                                    placements=[placement(t, plan) if t.name in plan else t.placement
                                                for t in specs])
        self.layout = build_layout(specs, plan)
        hosted = [t.name for t in specs if placement(t, plan) != "device"]
        if hosted and jax.process_count() > 1:
            raise NotImplementedError(f"tables {hosted} are placed in host memory, which is sharded over the "
                                      "devices of one process only so far; place them on the device to train "
                                      f"over {jax.process_count()} processes")
        column_wise = [t.name for t, k in zip(tables, self.layout.kinds)
                       if k == ShardingType.COLUMN_WISE]
        if column_wise and optimizer is not None and not isinstance(optimizer, _COLUMN_SEPARABLE):
            raise ValueError(
                f"tables {column_wise} are COLUMN_WISE but {type(optimizer).__name__} reads whole "
                "rows (row-wise state or row norms): each column shard would keep its own row "
                "statistics and training would differ from the unsharded module. Shard them "
                "TABLE_WISE / ROW_WISE / TABLE_ROW_WISE, or use SGD, Adagrad or Adam")
        self.table_configs = tables
        self.plan = plan
        self.mesh = mesh
        self.axis_name = axis_name
        self.optimizer = optimizer
        self.comm_dtype = comm_dtype
        self.max_ids_per_bag = _max_ids(max_ids_per_bag, self.layout.features)  # per feature, 0: none
        self.bounds_check_mode = bounds_check_mode
        self.backend = backend
        self.name = name
        self.feature_names = self.layout.features
        self.row_return_capacity = (0,) * len(self.layout.groups)  # fit_row_return sizes it
        self.dropped_ids = DroppedIds(jnp.zeros((), jnp.int32))
        self.deterministic = False  # dynamic tables: insert new ids (flax's model.train / model.eval)
        if initial is None:  # keys drawn in config order; each table to the host at once, in its
            # dtype, so that the default device never holds more than one (MLPerf's 40M-row ones)
            initial = {t.name: {"weights": to_host(t.init(rngs.params()).astype(t.dtype))} for t in tables}
        tables, caches = self._with_caches(self._variables(initial))
        self.tables = nnx.List(tables)
        # one cache state (index and host rows) per host-cached group, in group order (_host_cache.py)
        self.caches = nnx.List(caches)
        # one hash index per dynamic group, in group order (_dynamic.py), empty unless given
        self.indices = nnx.List([DynamicIndex(_dynamic.sharded_index(
            config, mesh, axis_name, initial[config.name].get("index"))) for config in self._dynamic_configs()])

    # -- TorchRec's accessors (and jaxrec.nn.TableCollection's) ---------------------------
    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self.table_configs)

    def split_embedding_weights(self) -> dict[str, jax.Array]:
        """``{table name: [num_embeddings, embedding_dim]}``: the whole tables."""
        weights = [g[0] for g in self._group_buffers()]
        return dict(zip((t.name for t in self.table_configs), self._unpack(weights, False)))

    def portable_tables(self) -> dict[str, dict[str, jax.Array]]:
        """Each table's weights, optimizer state buffers and fused step, whole (the form that
        checkpoints save and that any plan on any mesh can load)."""
        names = [t.name for t in self.table_configs]
        out = {n: {"weights": w} for n, w in zip(names, self.split_embedding_weights().values())}
        if not self.fused:
            return out
        values = [v.get_value() for v in self.tables]
        groups = self._group_buffers()
        for j, field in enumerate(self.optimizer.state_names):
            per_row = field in self.optimizer.state_type.row_fields
            for n, x in zip(names, self._unpack([g[1 + j] for g in groups], per_row)):
                out[n][field] = x
        for group, value in zip(self.layout.groups, values):
            for p in group.pieces:
                out[names[p.table]]["step"] = value.state.step
        for name, index in self._indices().items():  # the whole table's index, as unsharded
            out[name]["index"] = _dynamic.to_portable(index.get_value())
        return out

    def load_portable_tables(self, portable: Mapping[str, Mapping[str, jax.Array]]) -> None:
        """Replaces the tables (and optimizer state) by ``portable`` (``portable_tables``)."""
        missing = [name for name in self._indices() if "index" not in portable.get(name, {})]
        if missing:
            raise ValueError(f"the portable tables {missing} lack the 'index' of their dynamic "
                             "vocabulary; give portable_tables() of a collection with these tables")
        tables, caches = self._with_caches(self._variables(portable))
        for var, new in zip([*self.tables, *self.caches], [*tables, *caches]):
            var.set_value(new.get_value())
        for config, index in zip(self._dynamic_configs(), self.indices):
            index.set_value(_dynamic.sharded_index(config, self.mesh, self.axis_name,
                                                   portable[config.name]["index"]))

    def split_optimizer_states(self) -> dict[str, dict[str, jax.Array]]:
        """``{table name: {state name: [rows, dim] or [rows]}}`` of the fused optimizer."""
        return {name: {k: v for k, v in states.items() if k != "index"}
                for name, states in super().split_optimizer_states().items()}

    # -- host-cached tables (_host_cache.py) ----------------------------------------------
    def _with_caches(self, variables) -> tuple[list[nnx.Variable], list[HostCache]]:
        """``(tables, caches)``: the groups' variables, each host-cached group's whole virtual
        tables split into its caches (its variable) and a ``HostCache``."""
        tables, caches = [], []
        for group, var in zip(self.layout.groups, variables):
            if group.placement != "host_cached":
                tables.append(var)
                continue
            cache, state = _host_cache.split(group, var.get_value(), self.mesh, self.axis_name)
            tables.append(FusedTables(cache))
            caches.append(HostCache(state))
        return tables, caches

    def _cache(self, i: int) -> HostCache:
        """Host-cached group ``i``'s ``HostCache`` (``caches`` is in group order)."""
        return self.caches[sum(g.placement == "host_cached" for g in self.layout.groups[:i])]

    def _virtual_config(self, i: int) -> EmbeddingBagConfig:
        group = self.layout.groups[i]
        names = [self.table_configs[t].name for t in sorted({p.table for p in group.pieces})]
        return _host_cache.virtual_config(group, names)

    def _group_buffers(self) -> list[list]:
        """Each group's buffers: the weights, then each optimizer-state buffer; a host-cached
        group's (NumPy) with each device's cached rows written over its host rows."""
        out = []
        for i, (group, var) in enumerate(zip(self.layout.groups, self.tables)):
            value = var.get_value()
            if not self.fused:
                out.append([value])
            elif group.placement == "host_cached":
                out.append(_host_cache.flushed(group, self._cache(i).get_value(), value, self._virtual_config(i),
                                               self.layout.world_size))
            else:
                out.append(buffers(value))
        return out

    def cache_statistics(self) -> dict[str, dict[str, jax.Array]]:
        """``{tables: statistics}`` of each host-cached group (its tables' names joined by
        "+"), its devices' caches together: ``size``, ``load_factor``, ``inserted`` (rows
        loaded: misses), ``evicted`` (rows written back)."""
        return {self._virtual_config(i).name: _host_cache.statistics(self._cache(i).get_value())
                for i, g in enumerate(self.layout.groups) if g.placement == "host_cached"}

    # -- dynamic vocabularies (_dynamic.py) ---------------------------------------------
    def _dynamic_configs(self) -> list[EmbeddingBagConfig]:
        """The configs of the dynamic tables, in group order (each is a group of its own)."""
        return [self.table_configs[g.pieces[0].table] for g in self.layout.groups if g.dynamic]

    def _indices(self) -> dict[str, DynamicIndex]:
        """``{table name: its DynamicIndex}`` of the dynamic tables."""
        return dict(zip((c.name for c in self._dynamic_configs()), self.indices))

    def dynamic_statistics(self) -> dict[str, dict[str, jax.Array]]:
        """``{table name: statistics}`` of the dynamic tables, over the whole table (every
        device's part and counters): ``size``, ``load_factor``, ``inserted``, ``evicted``,
        ``failed_inserts``, ``unknown_lookups`` (docs/dynamic_vocab.md)."""
        return {name: statistics(_dynamic.totals(index.get_value()))
                for name, index in self._indices().items()}

    def dynamic_changes(self, table: str, since_step: int) -> dict[str, np.ndarray]:
        """``{"ids", "rows"}`` (NumPy) of dynamic table ``table``: the ids that training saw
        at fused step ``since_step`` or later and their rows now (as the unsharded
        collection's ``dynamic_changes``)."""
        indices = self._indices()
        check_dynamic_table(table, indices, self.name)
        ids, slots = hash_table.changed_since(indices[table].get_value().table, since_step)
        (i,) = [i for i, g in enumerate(self.layout.groups)
                if g.dynamic and self.table_configs[g.pieces[0].table].name == table]
        # equal blocks in device order: the group's global buffer is the table, slot by slot
        weights = self.tables[i].get_value().weights.reshape(-1, self.layout.groups[i].layout.dims[0])
        return {"ids": ids, "rows": to_host(weights[slots])}

    # -- the lookup (per device, inside shard_map) --------------------------------------
    def __call__(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        features, inverse = _bags_of_variable_batch(features, self.name)
        try:
            me = jax.lax.axis_index(self.axis_name)
        except NameError:
            raise ValueError(
                f"ShardedEmbeddingBagCollection {self.name!r} runs per device inside shard_map over "
                f"mesh axis {self.axis_name!r}, on each device's own KJT; call it through "
                "jaxrec.nn.make_train_step or jaxrec.parallel.make_forward (batches from shard_batch)"
            ) from None
        layout = self.layout
        values, lengths, weights, batch = self._prepare(features)
        num_features = len(layout.features)
        local = _dist.local_ids(values, lengths, weights, num_features)
        mean = np.array([layout.tables[t].pooling == PoolingMode.MEAN for t in layout.feature_table])
        plans = [self._group_plan(group, batch, capacity)
                 for group, capacity in zip(layout.groups, self.row_return_capacity)]
        gather = any(not rows and (g.kind != DP or self.fused)
                     for g, (_, _, rows) in zip(layout.groups, plans))
        everyone = _dist.gather_ids(local, self.axis_name) if gather else None
        outputs = {A2A: [], REDUCE: [], DP: []}
        for i, (group, (here, max_ids, rows)) in enumerate(zip(layout.groups, plans)):
            weighted = weights is not None
            if rows:
                out = self._row_return(i, local, max_ids, mean & here, weighted)
                outputs[group.kind].append((out, True))
                continue
            arrays = group.slot_arrays(num_features)
            row = {k: jnp.asarray(v.astype(values.dtype))[0 if group.kind == DP else me]
                   for k, v in arrays.items()}
            ids = local if group.kind == DP and not self.fused else everyone
            table = self.tables[i].get_value()
            if group.dynamic:  # raw ids to global slots (-1: not this device's, refused, unknown)
                config = self.table_configs[group.pieces[0].table]
                features = [f for f, t in enumerate(layout.feature_table) if t == group.pieces[0].table]
                ids, table = _dynamic.map_ids(self._indices()[config.name], table, config, ids, features,
                                              me, layout.world_size, training=not self.deterministic)
            need = {"weighted": weighted, "need_weights": weighted or bool((mean & here).any())}
            if max_ids:
                group_values, offsets, psw = _dist.window_input(
                    ids, row, mean & here, batch * max_ids, **need)
            else:
                group_values, offsets, psw = _dist.group_input(ids, row, mean & here, **need)
            if group.in_host_memory:  # virtual rows to rows of the batch's rows or of the cache
                group_values, table = self._host_rows(i, table, group_values, offsets)
            repeated = group.kind == DP and self.fused  # the global batch, on every device
            if repeated and psw is not None:
                psw = _dist.repeated(psw, layout.world_size)
            out = _dist.lookup(table, group, group_values, offsets, psw,
                               fused=self.fused, backend=self.backend)
            if repeated:
                out = _dist.own_rows(out, self.axis_name, batch)
            outputs[group.kind].append(out if group.kind == DP else (out, False))
        pooled = _dist.assemble(layout, outputs, self.axis_name, batch, self.comm_dtype)
        dims = [layout.tables[t].dim for t in layout.feature_table]
        if inverse is not None:  # each feature's bags taken at its samples' inverse indices
            columns = np.concatenate([[0], np.cumsum(dims)])
            pooled = jnp.concatenate([pooled[:, columns[f]:columns[f + 1]][inverse[name]]
                                      for f, name in enumerate(layout.features)], axis=1)
        return KeyedTensor(list(layout.features), dims, pooled)

    def _host_rows(self, i: int, table, values, offsets):
        """``(values, tables)`` of group ``i`` in host memory: its virtual rows as rows of the
        tables the lookup then runs on, the batch's rows (host) or this device's cache
        (host_cached, _host_cache.py)."""
        valid = jnp.arange(values.shape[0], dtype=offsets.dtype) < offsets[-1]
        if self.layout.groups[i].placement == "host":
            ids, table = batch_rows(table, values.astype(jnp.int32), valid)
            return ids.astype(offsets.dtype), table
        slots, table = cache_rows_for(self._cache(i), table, [self._virtual_config(i)], values.astype(jnp.int32),
                                      valid)
        self.tables[i].set_value(table)  # the cache as the index has it, in evaluation too
        return slots.astype(offsets.dtype), table

    def _group_bound(self, group):
        """``(here, max_ids)`` of a group: its features (a mask over ``feature_names``) and
        the most ids of their bags (0 unless every one has a ``max_ids_per_bag``)."""
        here = np.zeros(len(self.feature_names), bool)
        features = np.asarray(group.slot_feature)
        here[features[features >= 0]] = True
        bounds = np.asarray(self.max_ids_per_bag)[here]
        return here, int(bounds.max()) if here.any() and bounds.min() > 0 else 0

    def _group_plan(self, group, batch: int, capacity: int):
        """``(here, max_ids, rows)`` of a group: ``_group_bound``, and whether it takes the
        row return: over several devices, sized (``fit_row_return``), and fewer rows on
        the wire than the pooled bags."""
        here, max_ids = self._group_bound(group)
        rows = (self.layout.world_size > 1 and max_ids > 0  # one device: nothing to send
                and 0 < capacity < batch * group.num_slots and not group.dynamic and not group.in_host_memory)
        return here, max_ids, rows

    def _row_return(self, i, local, max_ids, mean, weighted):
        """Group ``i`` pooled from the distinct rows its owners send back (``_row_return``)."""
        group = self.layout.groups[i]
        capacity = self.row_return_capacity[i]
        slots = _row_return.output_slots(group)
        feature = jnp.asarray(slots.feature.astype(local.values.dtype))
        mine = _dist.feature_windows(local, feature, local.lengths.shape[-1] * max_ids)
        requested, row, dropped = _row_return.request(mine, slots, group.layout.rows[0], capacity)
        values, offsets = _row_return.owner_bags(
            _row_return.exchange(requested, self.axis_name), group.num_slots)
        looked_up = _dist.lookup(self.tables[i].get_value(), group, values, offsets, None,
                                 fused=self.fused, backend=self.backend)
        received = _row_return.send_rows(looked_up, group.layout.dims[0], self.axis_name,
                                         self.comm_dtype)
        weights = None
        if weighted or mean.any():
            weights = _dist.window_weights(local, mine, feature, mean, weighted=weighted)[:, 0]
        if as_bounds_check_mode(self.bounds_check_mode) == BoundsCheckMode.FATAL:
            report = jnp.stack([(dropped > 0).astype(jnp.int32), dropped.astype(jnp.int32)])
            self._raise_everywhere(functools.partial(_overflow_message, capacity), report)
        self.dropped_ids.set_value(self.dropped_ids.get_value()
                                   + jax.lax.psum(dropped.astype(jnp.int32), self.axis_name))
        return _row_return.pool(received, row, mine, weights, max_ids)

    def fit_row_return(self, kjts: Sequence[KeyedJaggedTensor]) -> None:
        """Sizes the groups' row return for these per-device host KJTs, one per device
        (``shard_batch(..., model=)`` calls it): afterwards every row-wise and table-wise
        (a2a) group whose features all have a ``max_ids_per_bag`` asks the owners for the
        distinct rows of its bags and pools them itself, instead of receiving pooled bags
        or partial sums, whenever that sends fewer rows (``_row_return``).

        The capacity only grows (a batch fitted earlier still fits), by steps of at most
        1/8, so that batches of one distribution compile one step."""
        if len(kjts) != self.layout.world_size:
            raise ValueError(f"fit_row_return needs one KJT per device: got {len(kjts)} for "
                             f"{self.layout.world_size} devices")
        rows = [self.layout.tables[t].rows for t in self.layout.feature_table]
        ids = [_ids_by_feature(kjt, self.layout.features) for kjt in kjts]
        capacity = list(self.row_return_capacity)
        for i, group in enumerate(self.layout.groups):
            if group.kind != DP and not group.dynamic and not group.in_host_memory and self._group_bound(group)[1] and \
                    _row_return.fits_keys(group):
                capacity[i] = max(capacity[i], _row_return.fit_capacity(group, rows, ids))
        self.row_return_capacity = tuple(capacity)

    def _prepare(self, features: KeyedJaggedTensor):
        """This device's ids of the collection's features, in its order, bounds-checked."""
        require_features(features, self.layout.features, f"collection {self.name!r}")
        kjt = features_in_order(features, self.layout.features)
        values = kjt.values()
        offsets = kjt.offsets().astype(values.dtype)
        weights = kjt.weights_or_none()
        mode = as_bounds_check_mode(self.bounds_check_mode)
        if mode == BoundsCheckMode.NONE:
            return values, offsets[1:] - offsets[:-1], weights, kjt.stride()
        # FATAL checks raise on every device, about the first device with bad input: a
        # device that failed alone would leave the others waiting in the next collective.
        fatal = mode == BoundsCheckMode.FATAL
        rows = [self.layout.tables[t].rows for t in self.layout.feature_table]
        dynamic = [f for f, t in enumerate(self.layout.feature_table) if self.layout.tables[t].dynamic]
        if dynamic:  # raw ids of dynamic tables: any value is an id; the offsets are still checked
            raw, raw_position = values, _dynamic.dynamic_positions(values, offsets, dynamic, kjt.stride())
            values = jnp.where(raw_position, 0, values)
        values, offsets, corrected = bounds_check_indices(
            rows, values, offsets, BoundsCheckMode.WARNING if fatal else mode,
            feature_names=list(self.layout.features), backend=self.backend)
        if dynamic:
            values = jnp.where(raw_position, raw, values)
        if fatal:
            self._raise_everywhere(_bad_ids_message, corrected[None].astype(jnp.int32))
        lengths = offsets[1:] - offsets[:-1]
        bounds = np.asarray(self.max_ids_per_bag)
        if not bounds.any():
            return values, lengths, weights, kjt.stride()
        bounds = np.where(bounds > 0, bounds, values.shape[0])
        by_feature = lengths.reshape(len(bounds), -1)
        if fatal:
            over = by_feature > bounds[:, None]
            first = jnp.argmax(over.ravel())
            report = jnp.stack([x.astype(jnp.int32) for x in
                                (over.any(), first, by_feature.ravel()[first])])
            self._raise_everywhere(functools.partial(_too_long_message, self.layout.features,
                                                     bounds, by_feature.shape[1]), report)
            return values, lengths, weights, kjt.stride()
        values, by_feature, weights = _dist.truncate_bags(values, by_feature, weights, bounds)
        return values, by_feature.ravel(), weights, kjt.stride()

    def _raise_everywhere(self, message, report: jax.Array) -> None:
        """Raises ``message(device, *report)`` on every device when the first entry of any
        device's ``report`` is nonzero (the first such device and its report); inside a
        train step, the step skips its update and raises after it (``jaxrec._step_guard``)."""
        reports = jax.lax.all_gather(report, self.axis_name)
        bad = reports[:, 0] != 0
        device = jnp.argmax(bad)
        head = jnp.stack([bad.any().astype(reports.dtype), device.astype(reports.dtype)])
        gathered = jnp.concatenate([head, reports[device]])
        _step_guard.report_fatal(gathered, functools.partial(_on_device, message))

    # -- portable <-> group buffers -----------------------------------------------------
    def _variables(self, portable) -> list[nnx.Variable]:
        names = [t.name for t in self.table_configs]
        missing = [n for n in names if n not in portable or "weights" not in portable[n]]
        if missing:
            raise ValueError(f"initial tables lack {missing}: give each table its 'weights'")
        n = self.layout.world_size
        out = []
        for g, group in enumerate(self.layout.groups):
            members = sorted({p.table for p in group.pieces})
            spec = P() if group.kind == DP else P(self.axis_name)
            sharding = NamedSharding(self.mesh, spec, memory_kind=HOST_MEMORY if group.in_host_memory else None)
            weights = {t: portable[names[t]]["weights"] for t in members}
            flat = jax.device_put(pack_group(group, n, weights, False, group.dtype), sharding)
            if not self.fused:
                out.append(nnx.Param(flat))
                continue
            config = self.optimizer
            state_dtype = jnp.dtype(getattr(config, "state_dtype", jnp.float32))
            buffers = {}
            for field in config.state_names:
                per_row = field in config.state_type.row_fields
                arrays = {}
                for t in members:
                    spec_t = self.table_configs[t]
                    given = portable[names[t]].get(field)
                    shape = (spec_t.num_embeddings,) + (() if per_row else (spec_t.embedding_dim,))
                    arrays[t] = np.zeros(shape, state_dtype) if given is None else given
                buffers[field] = jax.device_put(
                    pack_group(group, n, arrays, per_row, state_dtype), sharding)
            steps = {int(portable[names[t]].get("step", 0)) for t in members}
            if len(steps) > 1:
                raise ValueError(f"tables {[names[t] for t in members]} share one fused optimizer "
                                 f"step under this plan but the portable state gives them steps "
                                 f"{sorted(steps)}")
            step = on_mesh(np.int32(steps.pop()), self.mesh)
            hparams = jax.tree.map(functools.partial(on_mesh, mesh=self.mesh), config.hyperparams())
            name = self.name if len(self.layout.groups) == 1 else f"{self.name}.{g}"
            out.append(FusedTables(FusedEmbeddingTables(
                flat, config.state_type(step=step, **buffers), hparams, group.layout, config,
                name)))
        return out

    def _unpack(self, group_buffers, per_row: bool) -> list[jax.Array]:
        """Each table's portable array from the group buffers, placed on the mesh; a table
        in host memory stays a NumPy array (the devices need not have room for it)."""
        shapes = [(t.num_embeddings,) + (() if per_row else (t.embedding_dim,))
                  for t in self.table_configs]
        tables = unpack(self.layout, group_buffers, per_row)
        hosted = [placement(t, self.plan) != "device" for t in self.layout.tables]
        return [x if host else jax.device_put(x, portable_sharding(self.mesh, self.axis_name, s))
                for x, s, host in zip(tables, shapes, hosted)]


def _max_ids(bound, features: Sequence[str]) -> tuple[int, ...]:
    """``max_ids_per_bag`` per feature (0: no bound), checked (a tuple: static, not state)."""
    if bound is None:
        return (0,) * len(features)
    given = (dict.fromkeys(features, bound) if isinstance(bound, (int, np.integer))
             else dict(bound))
    unknown = sorted(set(given) - set(features))
    if unknown:
        raise ValueError(f"max_ids_per_bag names features {unknown} that no table reads; the "
                         f"features are {list(features)}")
    bad = {k: v for k, v in given.items()
           if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1}
    if bad:
        raise ValueError(f"max_ids_per_bag must be positive ints (the most ids of one bag), got "
                         f"{bad}; leave a feature out to give it no bound")
    return tuple(int(given.get(f, 0)) for f in features)


def _bags_of_variable_batch(features: KeyedJaggedTensor, name: str):
    """``(KJT of one stride, {key: inverse indices} or None)``: a variable-batch KJT as
    ``shard_batch`` gives it to each device (every key holding as many bags as samples)
    is looked up as a KJT of one stride, one pooled row per bag, then expanded."""
    if not features.variable_stride_per_key():
        return features, None
    strides = features.stride_per_key()
    inverse = features.inverse_indices_or_none()
    if inverse is None or inverse[1].shape[1] != features.stride() or len(set(strides)) != 1:
        raise ValueError(
            f"ShardedEmbeddingBagCollection {name!r} takes a variable-batch (VBE) KJT as "
            "jaxrec.parallel.shard_batch places it, every key holding one bag per sample of the "
            f"device (padded with empty bags) and inverse_indices; got stride_per_key={strides} for "
            f"{None if inverse is None else inverse[1].shape[1]} samples. Pass the global batch through "
            "shard_batch")
    plain = KeyedJaggedTensor(features.keys(), features.values(), weights=features.weights_or_none(),
                              lengths=features.lengths(), stride=features.stride())
    return plain, dict(zip(inverse[0], inverse[1]))


def _ids_by_feature(kjt: KeyedJaggedTensor, features: Sequence[str]) -> list[np.ndarray]:
    """A host KJT's ids of each of ``features`` (NumPy)."""
    keys = list(kjt.keys())
    missing = [f for f in features if f not in keys]
    if missing:
        raise ValueError(f"the KeyedJaggedTensor lacks the features {missing}; its keys are {keys}")
    values = np.asarray(kjt.values())
    per_key = np.asarray(kjt.lengths()).reshape(len(keys), -1).sum(1)
    start = np.concatenate([[0], np.cumsum(per_key)])
    return [values[start[keys.index(f)]:start[keys.index(f) + 1]] for f in features]


def _overflow_message(capacity, device, _, dropped) -> str:
    return (f"device {device} asks one owner for more distinct rows than the row return "
            f"capacity {capacity} holds ({dropped} ids past it): the batch did not pass through "
            "jaxrec.parallel.shard_batch(..., model=model) (or "
            "ShardedEmbeddingBagCollection.fit_row_return), which sizes the capacity")


def _bad_ids_message(device, count) -> str:
    return (f"bounds_check_indices (FATAL): device {device} has {count} ids out of their "
            "tables' range or bad offsets. Fix the ids, or pass bounds_check_mode=WARNING or "
            "IGNORE to correct them (jaxrec.ops.bounds_check_indices on that device's KJT names "
            "the feature and the bag)")


def _too_long_message(features, bounds, batch, device, _, bag, length) -> str:
    feature, sample = divmod(bag, batch)
    return (f"feature {features[feature]!r}, bag {sample} of device {device}: {length} ids, "
            f"more than max_ids_per_bag={int(bounds[feature])}. Raise the bound, or pass "
            "bounds_check_mode=WARNING or IGNORE to cut such bags to their first ids")


def auto_mesh(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """``mesh`` with every axis of type Auto: jaxrec.parallel places arrays on it and lets
    XLA move data in its jitted gathers (Explicit axes would type every slice)."""
    auto = jax.sharding.AxisType.Auto
    if all(t == auto for t in mesh.axis_types):
        return mesh
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(auto,) * len(mesh.axis_names))


def portable_from_collection(ebc: EmbeddingBagCollection) -> dict[str, dict[str, jax.Array]]:
    """The portable tables of an unsharded ``EmbeddingBagCollection``."""
    out = {name: {"weights": w} for name, w in ebc.split_embedding_weights().items()}
    if ebc.fused:  # (a host-cached group's: of its full tables, the cached rows over them)
        for name, states in ebc.split_optimizer_states().items():
            out[name].update(states)
        for group, var in zip(ebc.groups, ebc.tables):
            for t in group.tables:
                out[t.name]["step"] = var.get_value().step
    for name in (t.name for g in ebc.groups if g.dynamic for t in g.tables):  # each its own part
        out[name]["index"] = index_to_portable(ebc.dynamic_index(name))
    return out


def shard(model: nnx.Module, plan: ShardingPlan, mesh: jax.sharding.Mesh, *,
          axis_name: str | None = None, comm_dtype=jnp.float32,
          max_ids_per_bag: int | Mapping[str, int] | None = None) -> nnx.Module:
    """TorchRec's ``DistributedModelParallel`` in one call: every ``EmbeddingBagCollection``
    of ``model`` becomes a ``ShardedEmbeddingBagCollection`` (same tables, same optimizer
    state), every other variable is replicated over ``mesh`` (the dense part is data
    parallel). ``comm_dtype``, ``max_ids_per_bag``: see ``ShardedEmbeddingBagCollection``.
    Returns the model (changed in place; an EmbeddingBagCollection itself comes back
    sharded)."""
    def sharded(ebc):
        return ShardedEmbeddingBagCollection(
            ebc.table_configs, plan, mesh, axis_name=axis_name, optimizer=ebc.optimizer,
            initial=portable_from_collection(ebc), comm_dtype=comm_dtype,
            max_ids_per_bag=max_ids_per_bag,
            bounds_check_mode=ebc.bounds_check_mode,
            backend=ebc.backend, name=ebc.name)

    if isinstance(model, EmbeddingBagCollection):
        return sharded(model)
    found = [(path, m) for path, m in nnx.iter_modules(model)
             if isinstance(m, EmbeddingBagCollection) and path]
    if not found and not any(isinstance(m, ShardedEmbeddingBagCollection)
                             for _, m in nnx.iter_modules(model)):
        raise ValueError("the model has no EmbeddingBagCollection to shard")
    for path, ebc in found:
        parent = model
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        if isinstance(path[-1], int):
            parent[path[-1]] = sharded(ebc)
        else:
            setattr(parent, path[-1], sharded(ebc))
    replicate(model, auto_mesh(mesh))
    return model


def _on_device(message, any_bad, device, *report) -> str:
    return message(device, *report)
