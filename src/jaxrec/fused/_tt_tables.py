"""TT tables whose optimizer runs inside the backward: ``TTEmbeddingTables`` + ``tt_fused_lookup``.

FBTT's ``sparse=True`` mode in the jaxrec pattern of ``_tables.py``: the backward of
``tt_fused_lookup`` computes the gradient of every core (summed over all ids of the
batch), applies the optimizer to the cores and hands the *updated* tables back where a
gradient would go. Train with ``fused_value_and_grad``, ``make_functional_train_step``
or ``jaxrec.nn.make_train_step``, exactly as FBGEMM-style tables.

Optimizers: ``SGD`` and ``Adagrad`` (element-wise, FBTT's two), with the math of
``update_rows`` applied to the cores viewed as rows ``[r * p, q * r']``. A core entry
that gets no gradient is left exactly unchanged by both.

**The LFU cache** (``cache_size > 0``, FBTT's ``use_cache``; ``jaxrec.ops.tt_cache``):

* The fused backward counts every looked-up id in the hash table; ``cache_populate()``
  moves the ``cache_size`` most frequent ids into the cache, with their rows
  decompressed from the cores.
* A cached id is served from the cache: right after ``cache_populate`` a hit returns
  exactly what the cores would.
* While cached, a row is a dense row trained by the same optimizer (its Adagrad state
  lives in ``cache_slots``), and the cores get no gradient from its lookups. This is
  FBTT's design and the reason for the cache: hot ids skip both chain contractions.
* ``cache_populate`` keeps the trained rows (and slots) of ids that stay cached. FBTT
  instead recomputes every cached row from the cores, discarding what the cache learnt.
* An id that leaves the cache returns to its TT row: what it learnt while cached
  cannot be written into the cores, whose rows share parameters. The trade-off is
  FBTT's. Populate rarely (the counts are cumulative, so the hot set is stable) and
  keep ``cache_size`` at least the size of the hot set.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec import _step_guard
from jaxrec.fused._tables import _record_update
from jaxrec.ops import tt_cache as tc
from jaxrec.ops.bounds_check import BoundsCheckMode, as_bounds_check_mode
from jaxrec.ops.tbe_layout import PoolingMode
from jaxrec.ops.tbe_reference import bag_of_position, position_scale
from jaxrec.ops.tt_embedding import (
    TTSpec,
    check_bounds,
    tt_forward,
    tt_gradients,
    validate,
)
from jaxrec.ops.tt_init import init_tt_cores
from jaxrec.ops.tt_layout import TTLayout
from jaxrec.ops.tt_reference import (
    bags_to_batch,
    batch_to_bags,
    tt_full_weight,
    tt_rows,
)
from jaxrec.optim import _configs as C
from jaxrec.optim._rowwise import clip_output_gradient, update_rows
from jaxrec.optim._state import buffer_fields

TT_OPTIMIZERS = (C.SGD, C.Adagrad)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["key_halves", "counts", "ids", "rows"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TTCacheState:
    """A ``TTCache`` as the fused tables carry it: the counter in float32.

    The fused backward counts ids and returns the new counter in the gradient's place,
    and JAX drops integer cotangents. So the hash keys travel as two exact float32
    halves (``key >> 16`` and ``key & 0xFFFF``) and the counts as float32 (exact up to
    2**24 lookups of one id; beyond that they stop growing, which the LFU order
    tolerates). ``ids`` (int32) changes only in ``cache_populate``.
    """

    key_halves: jax.Array
    counts: jax.Array
    ids: jax.Array
    rows: jax.Array

    @classmethod
    def of(cls, cache: tc.TTCache) -> TTCacheState:
        halves = jnp.stack([cache.keys >> 16, cache.keys & 0xFFFF]).astype(jnp.float32)
        return cls(halves, cache.counts.astype(jnp.float32), cache.ids, cache.rows)

    def to_cache(self) -> tc.TTCache:
        halves = self.key_halves.astype(jnp.int32)
        return tc.TTCache(keys=(halves[0] << 16) | halves[1],
                          counts=jnp.minimum(self.counts, 2.0**24).astype(jnp.int32),
                          ids=self.ids, rows=self.rows)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["cores", "slots", "step", "hparams", "cache", "cache_slots"],
                   meta_fields=["layout", "config", "name"])
@dataclasses.dataclass(frozen=True)
class TTEmbeddingTables:
    """One TT table with its fused optimizer (and optional LFU cache): a pytree.

    ``cores`` (T float32 arrays), ``slots`` (per core, the optimizer's buffers by name:
    ``{"momentum1": ...}`` for Adagrad, ``{}`` for SGD), ``step``, ``hparams``, ``cache``
    (a ``TTCacheState`` or None) and ``cache_slots`` (the cached rows' buffers) are leaves;
    ``layout``, ``config`` and ``name`` are static.
    """

    cores: tuple[jax.Array, ...]
    slots: tuple[dict[str, jax.Array], ...]
    step: jax.Array
    hparams: C.OptimizerHyperparams
    cache: TTCacheState | None
    cache_slots: dict[str, jax.Array]
    layout: TTLayout
    config: C.OptimizerConfig
    name: str = "tt"

    @classmethod
    def create(cls, layout: TTLayout, config: C.OptimizerConfig, *, key=None, cores=None,
               weight_dist: str = "approx-normal", cache_size: int = 0, hashtbl_size: int = 0,
               name: str = "tt") -> TTEmbeddingTables:
        """New tables: ``cores`` as given, else ``init_tt_cores(key, layout, weight_dist)``.

        ``cache_size > 0`` adds the LFU cache; ``hashtbl_size`` defaults to
        ``2 * cache_size`` counters (FBTT's default is ``num_embeddings``).
        """
        if not isinstance(config, TT_OPTIMIZERS):
            raise TypeError(f"config must be jaxrec.optim.SGD or Adagrad (FBTT's fused optimizers "
                            f"for TT cores), got {type(config).__name__}")
        if cores is None:
            if key is None:
                raise ValueError("TTEmbeddingTables.create needs key= (to initialise the cores) "
                                 "or cores=")
            cores = init_tt_cores(key, layout, weight_dist)
        # Copies: a train step donates the tables, and must not delete the caller's arrays.
        cores = layout.validate_cores(jnp.array(c, copy=True) for c in cores)
        slots = tuple(_zero_slots(config, c.shape) for c in cores)
        cache, cache_slots = None, {}
        if cache_size:
            cache = TTCacheState.of(tc.init_cache(cache_size, hashtbl_size or 2 * cache_size,
                                                  layout.embedding_dim))
            cache_slots = _zero_slots(config, cache.rows.shape)
        return cls(cores, slots, jnp.zeros((), jnp.int32), config.hyperparams(), cache, cache_slots,
                   layout, config, name)

    def full_weight(self) -> jax.Array:
        """The dense ``[num_embeddings, D]`` table: the cores' rows, cached rows where cached."""
        full = tt_full_weight(self.cores, layout=self.layout)
        if self.cache is None:
            return full
        cached = self.cache.ids != tc.EMPTY
        ids = jnp.where(cached, self.cache.ids, self.layout.num_embeddings)
        return full.at[ids].set(self.cache.rows, mode="drop")

    materialize = full_weight

    def cache_populate(self) -> TTEmbeddingTables:
        """Refreshes the cache from the counts (see the module doc); a no-op without a cache."""
        if self.cache is None:
            return self
        cores, layout = self.cores, self.layout

        def rows_of(ids):
            return tt_rows(cores, jnp.clip(ids, 0, layout.num_embeddings - 1), layout=layout)

        cache, source = tc.cache_populate(self.cache.to_cache(), rows_of)
        cache = TTCacheState.of(cache)
        kept = (source >= 0)[:, None]
        slots = {k: jnp.where(kept, v[jnp.maximum(source, 0)], 0).astype(v.dtype)
                 for k, v in self.cache_slots.items()}
        return dataclasses.replace(self, cache=cache, cache_slots=slots)

    def cache_hit_rate(self, indices, valid=None) -> jax.Array:
        """Fraction of the ids (where ``valid``) that the cache would serve now."""
        if self.cache is None:
            return jnp.zeros((), jnp.float32)
        ids = jnp.asarray(indices).astype(jnp.int32)
        valid = jnp.ones(ids.shape, bool) if valid is None else valid
        return tc.cache_hit_rate(self.cache.to_cache(), ids, valid)

    def after_fused_update(self, updated: TTEmbeddingTables,
                           applied: jax.Array | None = None) -> TTEmbeddingTables:
        """The tables after one fused update whose results ``updated`` carries (_train_step.py);
        ``applied``: a bool scalar when a train step's guard gated the update."""
        cache = updated.cache
        if cache is not None:  # the cached ids come back as float0: only populate moves them
            cache = dataclasses.replace(cache, ids=self.cache.ids)
        step = self.step + (1 if applied is None else applied.astype(self.step.dtype))
        return dataclasses.replace(updated, cache=cache, step=step, hparams=self.hparams)


def _zero_slots(config, shape) -> dict[str, jax.Array]:
    return {k: jnp.zeros(shape, getattr(config, "state_dtype", "float32"))
            for k in buffer_fields(config.state_type)}


def tt_fused_lookup(tables: TTEmbeddingTables, indices, offsets, *,
                    pooling: PoolingMode | int | str = PoolingMode.SUM, per_sample_weights=None,
                    num_features: int = 1,
                    bounds_check_mode: BoundsCheckMode | int | str = BoundsCheckMode.WARNING,
                    backend: str = "auto") -> jax.Array:
    """``tt_embedding_bag`` of ``tables`` whose backward is the fused update (module doc).

    Differentiate it with ``fused_value_and_grad`` or a train step only.
    """
    if not isinstance(tables, TTEmbeddingTables):
        raise TypeError(f"tables must be TTEmbeddingTables, got {type(tables).__name__}")
    _, indices, offsets, psw, spec = validate(tables.cores, indices, offsets, tables.layout, pooling,
                                              per_sample_weights, num_features, backend)
    if as_bounds_check_mode(bounds_check_mode) != BoundsCheckMode.NONE:
        indices, offsets = check_bounds(spec, indices, offsets, bounds_check_mode)
    return _fused(spec, tables.config, tables.name, tables.cache is not None)(
        tables, psw, indices, offsets)


@functools.cache
def _fused(spec: TTSpec, config, name: str, cached: bool):
    # With a cache the kernel always gets weights: cache hits are masked to weight 0.
    tt_spec = dataclasses.replace(spec, weighted=spec.weighted or cached)

    def split(tables, psw, indices, offsets):
        """Positions' bag, scale and validity; the TT weights; the cache hits."""
        n = indices.shape[0]
        bag = bag_of_position(offsets, n)
        # An id outside the table is never counted or served by the cache (NONE drops it),
        # and is checked before the int32 cast so that a wide id cannot wrap into a row.
        in_table = (indices >= 0) & (indices < tables.layout.num_embeddings)
        valid = (bag >= 0) & (bag < offsets.shape[0] - 1) & in_table
        weights = psw if spec.weighted else jnp.ones((n,), jnp.float32)
        if not cached:
            return bag, valid, psw, None, None
        ids = jnp.where(in_table, indices, 0).astype(jnp.int32)
        hit, location = tc.cache_lookup(tables.cache.to_cache(), ids)
        hit = hit & valid
        return bag, valid, jnp.where(hit, 0.0, weights), hit, location

    def forward_only(tables, psw, indices, offsets):
        return pooled(tables, psw, indices, offsets, *split(tables, psw, indices, offsets))

    def pooled(tables, psw, indices, offsets, bag, valid, tt_weights, hit, location):
        out = tt_forward(tt_spec, tables.cores, tt_weights, indices, offsets)
        if cached:
            scale = position_scale(offsets, psw if spec.weighted else None, bag, spec.pooling)
            rows = tables.cache.rows[location] * jnp.where(hit, scale, 0.0)[:, None]
            num_bags = offsets.shape[0] - 1
            pooled = jax.ops.segment_sum(rows, jnp.where(hit, bag, num_bags), num_bags + 1)
            out = out + bags_to_batch(pooled[:num_bags], spec.num_features)
        return out

    lookup = jax.custom_vjp(forward_only)

    def forward(tables, psw, indices, offsets):
        parts = split(tables, psw, indices, offsets)  # the backward reuses them
        return pooled(tables, psw, indices, offsets, *parts), (tables, psw, indices, offsets, parts)

    def backward(residuals, grad_output):
        tables, psw, indices, offsets, (bag, valid, tt_weights, hit, location) = residuals
        _record_update(name)
        tables = dataclasses.replace(tables, hparams=C.scheduled(config, tables.hparams, tables.step))
        gate = _step_guard.table_gate(name, grad_output)  # on the raw gradient: clip hides Inf
        grad_output = clip_output_gradient(config, tables.hparams, grad_output)
        grad_cores, grad_psw = tt_gradients(tt_spec, grad_output, tables.cores, tt_weights,
                                            indices, offsets)
        step_state = functools.partial(config.state_type, step=tables.step)
        cores, slots = [], []
        for core, grad, slot in zip(tables.cores, grad_cores, tables.slots):
            rows = (core.shape[0] * core.shape[1], -1)
            new, state = update_rows(config, tables.hparams, core.reshape(rows), grad.reshape(rows),
                                     step_state(**{k: v.reshape(rows) for k, v in slot.items()}))
            cores.append(new.reshape(core.shape))
            slots.append({k: getattr(state, k).reshape(core.shape) for k in slot})
        updated = dataclasses.replace(tables, cores=tuple(cores), slots=tuple(slots))
        if cached:
            updated, grad_psw = _train_cache(spec, config, updated, grad_output, psw, offsets,
                                             bag, hit, location, grad_psw)
            ids = jnp.where(valid, indices, 0).astype(jnp.int32)  # valid: inside the table
            counted = TTCacheState.of(tc.count_ids(updated.cache.to_cache(), ids, valid))
            updated = dataclasses.replace(updated, cache=dataclasses.replace(
                counted, ids=_no_grad(tables.cache.ids)))
        # As the kernels keep a row whose update would not stay finite, a TT table keeps its
        # whole update (its cores are shared by every row); the step's guard is told.
        # Counted only where the guard let the update through, as the kernels count.
        stays_finite = _step_guard.all_finite(jax.tree.leaves(_trained(updated)))
        kept = ~stays_finite if gate is None else gate & ~stays_finite
        _step_guard.report_nonfinite_rows(kept.astype(jnp.int32))
        updated = _keep_unless(stays_finite if gate is None else gate & stays_finite, updated, tables)
        # The updated tables take the place of the gradient; the int step has none
        # (after_fused_update increments it), nor do the hyperparameters.
        updated = dataclasses.replace(updated, step=_no_grad(tables.step),
                                      hparams=jax.tree.map(jnp.zeros_like, tables.hparams))
        return updated, (grad_psw if spec.weighted else jnp.zeros_like(psw)), None, None

    lookup.defvjp(forward, backward)
    return lookup


def _train_cache(spec, config, tables, grad_output, psw, offsets, bag, hit, location, grad_psw):
    """The cached rows' fused update, and their per-sample-weight gradient."""
    cache = tables.cache
    num_bags = offsets.shape[0] - 1
    grad_bags = batch_to_bags(grad_output.astype(jnp.float32), spec.num_features)
    g = grad_bags[jnp.clip(bag, 0, num_bags - 1)]  # [n, D]: each position's bag gradient
    unit = position_scale(offsets, None, bag, spec.pooling)  # 1 or 1/L
    scale = position_scale(offsets, psw if spec.weighted else None, bag, spec.pooling)
    cache_size = cache.rows.shape[0]
    target = jnp.where(hit, location, cache_size)
    row_grad = jax.ops.segment_sum(g * jnp.where(hit, scale, 0.0)[:, None], target,
                                   cache_size + 1)[:-1]
    rows, state = update_rows(config, tables.hparams, cache.rows, row_grad,
                              config.state_type(step=tables.step, **tables.cache_slots))
    if spec.weighted:
        own = jnp.sum(g * cache.rows[location], axis=1) * unit
        grad_psw = jnp.where(hit, own, grad_psw)
    slots = {k: getattr(state, k) for k in tables.cache_slots}
    return dataclasses.replace(tables, cache=dataclasses.replace(cache, rows=rows),
                               cache_slots=slots), grad_psw


def _trained(tables: TTEmbeddingTables) -> dict:
    """The fields a fused update changes: cores, slots and the cache."""
    fields = {"cores": tables.cores, "slots": tables.slots}
    if tables.cache is not None:
        fields.update(cache=tables.cache, cache_slots=tables.cache_slots)
    return fields


def _keep_unless(gate, updated: TTEmbeddingTables, old: TTEmbeddingTables) -> TTEmbeddingTables:
    """``updated``'s cores, slots and cache where ``gate``, else ``old``'s."""
    def pick(new, before):
        if getattr(new, "dtype", None) == jax.dtypes.float0:
            return new  # the cached ids: no gradient, populate alone moves them
        return jnp.where(gate, new, before)
    fields = _trained(updated)
    kept = jax.tree.map(pick, fields, {k: getattr(old, k) for k in fields})
    return dataclasses.replace(updated, **kept)


def _no_grad(x):
    return np.zeros(x.shape, jax.dtypes.float0)
