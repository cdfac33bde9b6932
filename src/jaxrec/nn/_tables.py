"""Where a collection keeps its tables, in either training mode, and how it looks them up.

* **plain** (``optimizer=None``): each group's flat buffer is an ``nnx.Param``; ``jax.grad``
  gives its dense gradient and any optax optimizer trains it (FBGEMM's ``optimizer=NONE``).
* **fused** (``optimizer=RowWiseAdagrad(...)`` etc.): each group is a ``FusedTables``
  variable holding a ``FusedEmbeddingTables`` (weights, optimizer slots, hyperparameters).
  The backward of the lookup updates it in place; optax never sees it. Train such a model
  with ``jaxrec.nn.make_train_step`` (or ``jaxrec.fused.fused_value_and_grad``).

Weights and slots share one variable on purpose: the fused kernel reads and writes both in
one pass, and a checkpoint or a filter (``nnx.state(model, FusedTables)``) must never split
a table from its optimizer state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrec._mesh import to_host
from jaxrec.fused import FusedEmbeddingTables, fused_lookup
from jaxrec.nn import host_cache
from jaxrec.nn._collection import TableCollection
from jaxrec.nn._configs import EmbeddingConfig, group_tables
from jaxrec.nn._fused_variable import FusedTables
from jaxrec.nn._memory import check_fits, check_host_fits
from jaxrec.nn._tt_embedding_bag import TTEmbeddingBag
from jaxrec.nn.dynamic import (
    DynamicIndex,
    IndexState,
    check_collection,
    check_dynamic_table,
    from_portable,
    group_index,
    new_index,
    slots_for_eval,
    slots_for_training,
    statistics,
    table_index,
    to_portable,
)
from jaxrec.nn.host_cache import HostCache, cache_rows_for, full_tables, host_layout, stored
from jaxrec.nn.host_cache import new_state as new_cache_state
from jaxrec.nn.host_tables import batch_rows, buffers, new_host_tables, place_in_host_memory, with_buffers
from jaxrec.ops import BoundsCheckMode, PoolingMode, bounds_check_indices, embedding_bag_lookup, hash_table, tbe_layout
from jaxrec.ops.tbe_kjt import (
    bag_offsets,
    check_variable_batch,
    expand_variable_batch,
    features_in_order,
    require_features,
)
from jaxrec.ops.tbe_layout import TableLayout
from jaxrec.optim import OptimizerConfig, init_state
from jaxrec.sparse import KeyedJaggedTensor


class GroupedTables(TableCollection):
    """Tables grouped into table-batched lookups (the base of the two unsharded collections)."""

    def __init__(self, tables: tuple[EmbeddingConfig, ...], pooling: PoolingMode | None, *,
                 optimizer: OptimizerConfig | None, rngs: nnx.Rngs,
                 bounds_check_mode: BoundsCheckMode | str, backend: str, name: str):
        if optimizer is not None and not isinstance(optimizer, OptimizerConfig):
            raise TypeError(f"optimizer must be None (plain tables, trained by optax) or a fused "
                            f"optimizer config such as jaxrec.optim.RowWiseAdagrad(...), got "
                            f"{optimizer!r}")
        self.groups = groups = group_tables(tables, pooling)
        self.table_configs = tables
        self.optimizer = optimizer
        self.bounds_check_mode = bounds_check_mode
        self.backend = backend
        self.name = name
        self.feature_names = tuple(f for t in self.table_configs for f in t.feature_names)
        check_collection(tables, optimizer)
        host_cache.check_collection(tables, optimizer)
        self.deterministic = False  # dynamic tables: insert new ids (flax's model.train / model.eval)
        _check_fits(name, groups, optimizer)
        keys = {t.name: rngs.params() for t in tables}  # keys drawn in config order
        variables, caches = [], []
        for i, g in enumerate(groups):
            group_name = name if len(groups) == 1 else f"{name}.{i}"
            if g.tt:  # a module of its own, holding a Param list or a FusedTables
                variables.append(_tt_module(g.tables[0], optimizer, group_name, keys))
                continue
            def draw(t, tables=g.tables):
                return tables[t].init(keys[tables[t].name])

            if g.host_cached:  # drawn into host memory; the cache starts empty
                cache = FusedEmbeddingTables.create(g.layout, optimizer, weights=jnp.zeros(
                    g.layout.num_weights, g.dtype), copy=False, name=group_name)
                caches.append(HostCache(new_cache_state(cache, g.tables, draw)))
                variables.append(FusedTables(cache))
                continue
            if g.placement == "host":  # drawn into host memory, one table at a time
                row = TableLayout(rows=(1,), dims=g.layout.dims[:1], feature_table_map=(0,))
                like = FusedEmbeddingTables.create(row, optimizer, weights=jnp.zeros(row.num_weights, g.dtype))
                variables.append(FusedTables(new_host_tables(like, g.layout, draw, group_name)))
                continue
            flat = tbe_layout.merge_drawn_tables(g.layout, draw, g.dtype)
            if optimizer is None:
                variables.append(nnx.Param(flat))
            else:  # flat is ours alone: handed over, not copied (MLPerf-sized tables fit once)
                variables.append(FusedTables(FusedEmbeddingTables.create(
                    g.layout, optimizer, weights=flat, copy=False, name=group_name)))
        self.tables = nnx.List(variables)
        # one hash index per dynamic group, in group order
        self.indices = nnx.List([DynamicIndex(new_index(g.tables)) for g in groups if g.dynamic])
        # one cache state (index and host rows) per host-cached group, in group order
        self.caches = nnx.List(caches)

    def split_embedding_weights(self) -> dict[str, jax.Array]:
        """``{table name: [num_embeddings, embedding_dim]}`` (views of the flat buffers)."""
        out = {}
        for i, (g, var) in enumerate(zip(self.groups, self.tables)):
            if g.tt:  # materialised from the cores: num_embeddings x dim floats
                out[g.tables[0].name] = var.full_weight()
            elif g.in_host_memory:  # NumPy, from host memory (host-cached: the cached rows over it)
                out.update(zip((t.name for t in g.tables), self._full_tables(i).split_embedding_weights()))
            else:
                flat = var.get_value().weights if self.fused else var.get_value()
                out.update(zip((t.name for t in g.tables), g.layout.split_embedding_weights(flat)))
        return out

    def split_optimizer_states(self) -> dict[str, dict[str, jax.Array]]:
        """``{table name: {state name: [rows, dim] or [rows]}}`` of the fused optimizer (TT
        tables, whose state lives on their cores, are left out)."""
        self._require_fused("optimizer state")
        out = {}
        for i, (g, var) in enumerate(zip(self.groups, self.tables)):
            if not g.tt:
                tables = self._full_tables(i) if g.in_host_memory else var.get_value()
                out.update(zip((t.name for t in g.tables), tables.split_optimizer_states()))
        return out

    def set_embedding_weights(self, weights: Mapping[str, jax.Array]) -> None:
        """Sets tables from ``{table name: [num_embeddings, embedding_dim]}`` arrays: the
        inverse of ``split_embedding_weights`` (load a trained FBGEMM/TorchRec table). Tables
        not named keep their weights; optimizer state is left as it is."""
        self._check_names(weights, "weights", {t.name for t in self.table_configs})
        for i, (g, var) in enumerate(zip(self.groups, self.tables)):
            names = [t.name for t in g.tables]
            if not any(n in weights for n in names):
                continue
            if g.tt:
                raise ValueError(f"table {names[0]!r} is a TT table: it holds cores, not rows; "
                                 "set its cores with its TTEmbeddingBag's set_cores (ebc.tables[i])")
            full = self._full_tables(i) if g.in_host_memory else None
            flat = full.weights if full is not None else var.get_value().weights if self.fused else var.get_value()
            current = (full.layout if full is not None else g.layout).split_embedding_weights(flat)
            tables = [self._checked(t.name, weights[t.name]) if t.name in weights else cur
                      for t, cur in zip(g.tables, current)]
            if full is not None:
                with _on_the_cpu():  # the full tables are merged in host memory, never on the device
                    full = full.set_embedding_weights(tables)
                self._store_full(i, full)
            elif self.fused:
                var.set_value(var.get_value().set_embedding_weights(tables))
            else:
                var.set_value(g.layout.merge_embedding_weights([t.astype(g.dtype) for t in tables]))

    def set_optimizer_states(self, states: Mapping[str, Mapping[str, jax.Array]], *, step=None) -> None:
        """Sets the fused optimizer's state from ``{table name: {state name: array}}``: the
        inverse of ``split_optimizer_states``. Every table of a group must be given (they
        share one step counter); ``step``: the updates already applied (unchanged when None)."""
        self._require_fused("optimizer state")
        self._check_names(states, "optimizer states",
                          {t.name for g in self.groups if not g.tt for t in g.tables})
        for i, (g, var) in enumerate(zip(self.groups, self.tables)):
            names = [t.name for t in g.tables]
            given = [n for n in names if n in states]
            if not given:
                continue
            if len(given) != len(names):
                raise ValueError(f"tables {names} share one fused buffer and step: give the states of "
                                 f"all of them, got {given}")
            if g.in_host_memory:
                with _on_the_cpu():
                    full = self._full_tables(i).set_optimizer_states([states[n] for n in names], step=step)
                self._store_full(i, full)
            else:
                var.set_value(var.get_value().set_optimizer_states([states[n] for n in names], step=step))

    def _cache(self, i: int) -> HostCache:
        """Host-cached group ``i``'s ``HostCache`` (``caches`` is in group order)."""
        return self.caches[sum(g.host_cached for g in self.groups[:i])]

    def _full_tables(self, i: int):
        """Group ``i``'s full tables in host memory as NumPy buffers (host-cached: the cached
        rows written over the host's)."""
        if self.groups[i].placement == "host":
            return jax.tree.map(to_host, self.tables[i].get_value())
        return full_tables(self._cache(i).get_value(), self.tables[i].get_value(), self.groups[i].tables)

    def _store_full(self, i: int, full) -> None:
        """Group ``i`` in host memory set to the full tables ``full``: host memory holds them
        (host-cached: the cache starts empty), the step is theirs."""
        step = jnp.asarray(np.asarray(full.step))  # on the default device, wherever full's was
        if self.groups[i].placement == "host":
            placed = [place_in_host_memory(np.asarray(b)) for b in buffers(full)]
            tables = with_buffers(self.tables[i].get_value(), placed)
            self.tables[i].set_value(dataclasses.replace(tables, state=tables.state._replace(step=step)))
            return
        var = self._cache(i)
        var.set_value(stored(var.get_value(), full))
        cache = self.tables[i].get_value()
        self.tables[i].set_value(dataclasses.replace(cache, state=cache.state._replace(step=step)))

    def _indices(self) -> dict[str, tuple[DynamicIndex, tuple, int, int]]:
        """``{table name: (its group's DynamicIndex, the group's configs, its place there,
        the group)}`` of the dynamic tables (``indices`` is in group order)."""
        dynamic = [(i, g) for i, g in enumerate(self.groups) if g.dynamic]
        return {t.name: (index, g.tables, k, i) for (i, g), index in zip(dynamic, self.indices)
                for k, t in enumerate(g.tables)}

    def dynamic_index(self, name: str) -> IndexState:
        """Dynamic table ``name``'s own index (its bucket range of its group's, its counters)."""
        index, configs, k, _ = self._indices()[name]
        return table_index(index.get_value(), configs, k)

    def dynamic_statistics(self) -> dict[str, dict[str, jax.Array]]:
        """``{table name: statistics}`` of the dynamic tables: ``size``, ``load_factor``,
        ``inserted``, ``evicted``, ``failed_inserts``, ``unknown_lookups`` (docs/dynamic_vocab.md)."""
        return {name: statistics(self.dynamic_index(name)) for name in self._indices()}

    def cache_statistics(self) -> dict[str, dict[str, jax.Array]]:
        """``{table name: statistics}`` of the host-cached tables: ``size`` (rows cached),
        ``load_factor``, ``inserted`` (rows loaded: misses) and ``evicted`` (rows written
        back) since the collection was created (docs/host_memory.md)."""
        out = {}
        for i, g in enumerate(self.groups):
            if g.host_cached:
                out.update(host_cache.statistics(self._cache(i).get_value(), g.tables))
        return out

    def dynamic_changes(self, table: str, since_step: int) -> dict[str, np.ndarray]:
        """``{"ids", "rows"}`` (NumPy) of dynamic table ``table``: the ids that training saw
        at fused step ``since_step`` or later (inserted or updated since) and their rows now;
        what a serving copy must refresh (docs/dynamic_vocab.md)."""
        indices = self._indices()
        check_dynamic_table(table, indices, self.name)
        ids, slots = hash_table.changed_since(self.dynamic_index(table).table, since_step)
        _, _, k, i = indices[table]
        layout = self.groups[i].layout
        weights = self.tables[i].get_value().weights.reshape(-1, layout.dims[0])  # one width (dynamic_group_key)
        rows = weights[slots + layout.row_offsets[k]]
        return {"ids": ids, "rows": to_host(rows)}  # only the changed rows leave the device

    def portable_tables(self) -> dict[str, dict[str, np.ndarray]]:
        """Each table's weights, fused optimizer state and step, as NumPy arrays: the
        plan-free form of ``ShardedEmbeddingBagCollection.portable_tables``, so that a
        sharded model's checkpoint restores into this collection
        (``jaxrec.parallel.load_portable_state``). Each group's buffers are copied to the
        host whole and cut there: a checkpoint of tables that fill the device never needs
        a second copy of them on it."""
        if any(g.tt for g in self.groups):
            raise NotImplementedError(f"collection {self.name!r} has TT tables, which have no portable form")
        out = {}
        for i, (g, var) in enumerate(zip(self.groups, self.tables)):
            host = self._full_tables(i) if g.in_host_memory else jax.tree.map(to_host, var.get_value())
            flat, layout = (host.weights, host.layout) if self.fused else (host, g.layout)
            for t, w in zip(g.tables, layout.split_embedding_weights(flat)):
                out[t.name] = {"weights": w}
            if self.fused:
                for t, states in zip(g.tables, host.split_optimizer_states()):
                    out[t.name].update(states, step=host.step)
        for name in self._indices():
            out[name]["index"] = to_portable(jax.tree.map(to_host, self.dynamic_index(name)))
        return out

    def load_portable_tables(self, portable: Mapping[str, Mapping[str, jax.Array]]) -> None:
        """Sets the tables (and fused optimizer state) from ``portable_tables``' form."""
        self.set_embedding_weights({name: t["weights"] for name, t in portable.items()})
        if self.fused:
            for g in self.groups:  # one step counter per group
                names = [t.name for t in g.tables]
                self.set_optimizer_states(
                    {n: {k: v for k, v in portable[n].items() if k not in ("weights", "step", "index")}
                     for n in names},
                    step=portable[names[0]]["step"])
        for g in (g for g in self.groups if g.dynamic):  # each group's index from its tables' own
            index, *_ = self._indices()[g.tables[0].name]
            index.set_value(group_index([from_portable(portable[t.name]["index"]) for t in g.tables]))

    def _host_rows(self, i: int, table, values, offsets, kwargs):
        """``(ids, offsets, tables)`` of group ``i`` in host memory: the ids checked against
        their tables under the collection's bounds-check mode (an id NONE leaves out of range
        looks up nothing), as ids of the device tables that the lookup then runs on
        unchecked: the cache (host-cached, nn/host_cache.py) or the batch's rows (host,
        nn/host_tables.py). A host-cached group also caches the rows of the batch being
        prefetched (``host_cache.prefetching``), whose out-of-range ids it leaves out."""
        group = self.groups[i]
        full = host_layout(group.layout, group.tables)
        values, offsets, _ = bounds_check_indices(
            full.feature_rows, values, offsets, kwargs["bounds_check_mode"],
            feature_names=kwargs["feature_names"], table_names=kwargs["table_names"], backend=self.backend)
        kwargs["bounds_check_mode"] = BoundsCheckMode.NONE
        table_of, valid = _ids_in_tables(values, offsets, full)
        if group.placement == "host":
            first = 0 if table_of is None else jnp.asarray(full.row_offsets, jnp.int32)[table_of]
            ids, scratch = batch_rows(table, first + values.astype(jnp.int32), valid)
            return ids.astype(offsets.dtype), offsets, scratch
        upcoming = host_cache.upcoming_features(group.feature_names)
        if upcoming is not None:
            upcoming = features_in_order(upcoming, group.feature_names)
            up_values, up_offsets = upcoming.values(), bag_offsets(upcoming)
            up_table_of, up_valid = _ids_in_tables(up_values, up_offsets, full)
            upcoming = (up_values, up_valid, up_table_of)
        slots, table = cache_rows_for(self._cache(i), table, group.tables, values, valid, table_of, upcoming)
        # The cache now holds the rows the index says it does, in evaluation too (with no
        # backward to hand the tables back); a train step takes its tables from the backward.
        self.tables[i].set_value(table)
        slots = _rows_of_tables(slots, table_of, group.layout)
        return slots.astype(offsets.dtype), offsets, table

    def group_features(self, features: KeyedJaggedTensor) -> list[KeyedJaggedTensor]:
        """One KJT per group, holding that group's features in its layout's order."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        require_features(features, self.feature_names, f"{type(self).__name__} {self.name!r}")
        return [features_in_order(features, g.feature_names) for g in self.groups]

    def lookup(self, i: int, features: KeyedJaggedTensor, pooling: PoolingMode) -> jax.Array:
        """Group ``i``'s lookup: ``[B, total_dim]`` pooled, or ``[capacity, dim]`` for NONE.

        A variable-batch KJT (VBE) is looked up once per bag of each key and expanded to
        the full batch by its inverse indices (``jaxrec.ops.tbe_kjt``)."""
        check_variable_batch(features, pooling, f"{type(self).__name__} {self.name!r}")
        values = features.values()
        offsets = bag_offsets(features)
        group = self.groups[i]
        if group.tt:
            out = self.tables[i](values, offsets, features.weights_or_none(),
                                 num_features=len(group.feature_names))
            return expand_variable_batch(out, features, group.layout.feature_dims)
        kwargs = dict(pooling=pooling, per_sample_weights=features.weights_or_none(),
                      bounds_check_mode=self.bounds_check_mode, backend=self.backend,
                      feature_names=list(group.feature_names),  # for FATAL's message
                      table_names=[group.tables[t].name for t in group.layout.feature_table_map])
        table = self.tables[i].get_value()
        if group.in_host_memory:  # row ids to rows of the cache, or of the batch's rows
            values, offsets, table = self._host_rows(i, table, values, offsets, kwargs)
        elif group.dynamic:  # raw ids to slots; unknown or refused ids (-1) look up nothing
            index, configs, _, _ = self._indices()[group.tables[0].name]
            valid = jnp.arange(values.shape[0], dtype=offsets.dtype) < offsets[-1]
            table_of = _table_of_entries(offsets, group.layout, values.shape[0])
            if self.deterministic:
                slots = slots_for_eval(index, configs, values, valid, table_of)
            else:
                slots, table = slots_for_training(index, table, configs, values, valid, table_of)
            values = _rows_of_tables(slots, table_of, group.layout).astype(offsets.dtype)
            kwargs["bounds_check_mode"] = BoundsCheckMode.NONE
        if self.fused:
            out = fused_lookup(table, values, offsets, **kwargs)
        else:
            out = embedding_bag_lookup(table, values, offsets, layout=group.layout, **kwargs)
        return out if pooling == PoolingMode.NONE else expand_variable_batch(out, features, group.layout.feature_dims)


def _ids_in_tables(values: jax.Array, offsets: jax.Array, full: TableLayout):
    """``(table_of, valid)`` of a group's ids (``_table_of_entries``): whether each entry is
    an id (not padding) inside its table of the full layout ``full``."""
    table_of = _table_of_entries(offsets, full, values.shape[0])
    rows = jnp.asarray(full.rows, values.dtype)[0 if table_of is None else table_of]
    valid = (jnp.arange(values.shape[0], dtype=offsets.dtype) < offsets[-1]) & (values >= 0) & (values < rows)
    return table_of, valid


def _rows_of_tables(slots: jax.Array, table_of: jax.Array | None, layout) -> jax.Array:
    """Rows of a group's buffer as rows of each entry's own table (``table_of``); -1 stays."""
    if table_of is None:
        return slots
    return jnp.where(slots >= 0, slots - jnp.asarray(layout.row_offsets, jnp.int32)[table_of], -1)


def _on_the_cpu():
    """jnp's operations on the CPU (host memory) for the block."""
    return jax.default_device(jax.devices("cpu")[0])


def _table_of_entries(offsets: jax.Array, layout, capacity: int) -> jax.Array | None:
    """``int32[capacity]``: the table (in the group) of each entry of a group's ids, from the
    feature-major ``offsets`` (``[F * stride + 1]``); entries past the last id: the last
    feature's. None for a group of one table."""
    if layout.num_tables == 1:
        return None
    num_features = len(layout.feature_table_map)
    stride = (offsets.shape[0] - 1) // num_features
    feature_ends = offsets[stride::stride][:num_features]  # where each feature's ids end
    position = jnp.arange(capacity, dtype=offsets.dtype)
    feature = jnp.minimum(jnp.searchsorted(feature_ends, position, side="right"), num_features - 1)
    return jnp.asarray(layout.feature_table_map, jnp.int32)[feature]


def _tt_module(config, optimizer, name: str, keys):
    """The ``TTEmbeddingBag`` of a TT table of a collection."""
    tt = config.tt
    if optimizer is not None and tt.optimizer is not None:
        optimizer = tt.optimizer
    elif optimizer is None and tt.optimizer is not None:
        raise ValueError(f"table {config.name!r}: TTConfig.optimizer is set but the collection "
                         "has plain tables (optimizer=None); give the collection a fused optimizer "
                         "or drop TTConfig.optimizer")
    return TTEmbeddingBag(
        config.num_embeddings, config.embedding_dim, tt_ranks=tt.tt_ranks,
        tt_p_shapes=tt.tt_p_shapes, tt_q_shapes=tt.tt_q_shapes, pooling=config.pooling,
        weight_dist=tt.weight_dist, optimizer=optimizer, rngs=nnx.Rngs(params=keys[config.name]),
        name=name)


def concat_in_order(blocks: Sequence[tuple[str, jax.Array]], keys: Sequence[str]) -> jax.Array:
    """Concatenates named column blocks in the order of ``keys``."""
    by_key = dict(blocks)
    return jnp.concatenate([by_key[k] for k in keys], axis=-1)


def _check_fits(name: str, groups, optimizer: OptimizerConfig | None) -> None:
    """Refuses, before any allocation, tables that the default device (or, for tables in
    host memory, the host) cannot hold."""
    sizes, state, drawing, host = {}, 0, 0, {}
    for g in groups:
        if g.tt:  # compressed: the cores are small
            continue
        itemsize = jnp.dtype(g.dtype).itemsize
        group = {t.name: rows * t.embedding_dim * itemsize for t, rows in zip(g.tables, g.layout.rows)}  # a cache's
        group_state = 0
        if optimizer is not None:
            shapes = jax.eval_shape(lambda layout=g.layout: init_state(optimizer, layout))
            group_state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
        if g.placement != "host":  # host-placed: only each batch's rows come to the device
            sizes.update(group)
            state += group_state
        if g.in_host_memory:  # host: the tables and their state; the device: one table drawn at a time
            per_row = group_state / sum(g.layout.rows)  # the state's bytes a row, in the cache as in the host
            host.update({t.name: int(t.num_embeddings * (t.embedding_dim * itemsize + per_row)) for t in g.tables})
            drawing = max(drawing, max(t.num_embeddings * t.embedding_dim for t in g.tables) * (4 + itemsize))
        else:
            in_place = sum(group.values()) >= tbe_layout.IN_PLACE_BYTES
            drawing = max(drawing, max(group.values()) if in_place else sum(group.values()))
    if sizes or drawing:
        check_fits(name, sizes, state, drawing)
    if host:
        check_host_fits(name, host)
