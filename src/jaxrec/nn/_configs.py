"""TorchRec's table configs: ``EmbeddingBagConfig`` (pooled) and ``EmbeddingConfig`` (sequence).

A collection's tables are grouped into table-batched lookups as FBGEMM groups them: all
tables of one pooling and one dtype share one flat buffer and one kernel launch::

    # tables  t_user (SUM, f32)  t_item (SUM, f32)  t_hist (MEAN, f32)
    # groups  [t_user, t_item] -> one TableLayout, one lookup;  [t_hist] -> another
    # output keys: the feature names, table by table, in config order (TorchRec's order)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrec.ops import WEIGHT_DISTS, PoolingMode, TableLayout, TTLayout
from jaxrec.ops.hash_table import MAX_BUCKET_SIZE
from jaxrec.ops.hash_table import POLICIES as EVICTIONS
from jaxrec.ops.tbe_layout import as_pooling_mode
from jaxrec.optim import OptimizerConfig

_DTYPES = ("float32", "float16", "bfloat16")
PLACEMENTS = ("device", "host", "host_cached")
CACHE_POLICIES = ("lru", "lfu")
CACHE_BUCKET = 128  # cache rows come in buckets of this many (nn/host_cache.py)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingConfig:
    """One table and the features that look it up (TorchRec's ``EmbeddingConfig``)."""

    name: str
    """The table's name; unique within a collection."""
    num_embeddings: int
    """Rows of the table."""
    embedding_dim: int
    """Columns of the table."""
    feature_names: tuple[str, ...]
    """The KJT keys that look this table up (several features may share it)."""
    weight_init_min: float | None = None
    """Lower bound of the uniform initialiser; default ``-sqrt(1 / num_embeddings)``."""
    weight_init_max: float | None = None
    """Upper bound of the uniform initialiser; default ``sqrt(1 / num_embeddings)``."""
    init_fn: Callable[[jax.Array, tuple[int, int], jnp.dtype], jax.Array] | None = None
    """``init_fn(key, (rows, dim), float32) -> array``; replaces the uniform initialiser. It
    runs under ``jax.jit`` (jax operations, no NumPy on the key)."""
    dtype: str = "float32"
    """Storage dtype of the table: float32, float16 or bfloat16 (outputs are float32)."""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got {self.name!r}")
        for field in ("num_embeddings", "embedding_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"table {self.name!r}: {field} must be an int >= 1, got {value!r}")
        names = self.feature_names
        if isinstance(names, str):
            raise TypeError(f"table {self.name!r}: feature_names must be a list of str, got the "
                            f"str {names!r}; write feature_names=[{names!r}]")
        object.__setattr__(self, "feature_names", tuple(names))
        if not self.feature_names or not all(isinstance(f, str) and f for f in self.feature_names):
            raise ValueError(f"table {self.name!r}: feature_names must list at least one non-empty "
                             f"str, got {list(self.feature_names)}")
        dtype = jnp.dtype(self.dtype).name
        if dtype not in _DTYPES:
            raise ValueError(f"table {self.name!r}: dtype must be one of {_DTYPES}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)

    def init(self, key: jax.Array, rows: int | None = None) -> jax.Array:
        """The initial ``[num_embeddings, embedding_dim]`` table, in float32; ``rows``: that
        many rows drawn alike (a dynamic table's new rows)."""
        shape = (self.num_embeddings if rows is None else rows, self.embedding_dim)
        if self.init_fn is not None:  # jitted: the same values here as inside a jitted draw
            table = jnp.asarray(jax.jit(self.init_fn, static_argnums=(1, 2))(key, shape, jnp.float32))
            if table.shape != shape:
                raise ValueError(f"table {self.name!r}: init_fn returned shape {table.shape}, "
                                 f"expected {shape}")
            return table.astype(jnp.float32)
        low, high = self.init_bounds()
        return jax.random.uniform(key, shape, jnp.float32, low, high)

    def init_bounds(self) -> tuple[float, float]:
        """``(low, high)`` of the default uniform init: ``weight_init_min`` /
        ``weight_init_max``, else TorchRec's ``-+sqrt(1 / num_embeddings)``."""
        bound = math.sqrt(1.0 / self.num_embeddings)
        low = -bound if self.weight_init_min is None else self.weight_init_min
        high = bound if self.weight_init_max is None else self.weight_init_max
        return low, high


@dataclasses.dataclass(frozen=True, kw_only=True)
class TTConfig:
    """Makes a pooled table tensor-train compressed (``EmbeddingBagConfig(tt=TTConfig(...))``).

    The fields are FBTT's ``TTEmbeddingBag`` arguments; see ``jaxrec.nn.TTEmbeddingBag``.
    """

    tt_ranks: tuple[int, ...]
    """The T - 1 inner ranks (2 to 4 cores)."""
    tt_p_shapes: tuple[int, ...] | None = None
    """Row factorisation (prod >= num_embeddings); None picks the most even one."""
    tt_q_shapes: tuple[int, ...] | None = None
    """Column factorisation (prod == embedding_dim); None picks the most even one."""
    weight_dist: str = "approx-normal"
    """Initial distribution (``jaxrec.ops.tt_init``)."""
    optimizer: OptimizerConfig | None = None
    """The table's fused optimizer (SGD or Adagrad) when it differs from the collection's,
    e.g. a collection trained by RowWiseAdagrad whose TT table uses Adagrad."""

    def __post_init__(self):
        for field in ("tt_ranks", "tt_p_shapes", "tt_q_shapes"):
            value = getattr(self, field)
            if value is not None:
                object.__setattr__(self, field, tuple(value))
        if self.weight_dist not in WEIGHT_DISTS:
            raise ValueError(f"weight_dist must be one of {WEIGHT_DISTS}, got {self.weight_dist!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamicVocab:
    """Makes a pooled table a dynamic vocabulary (``EmbeddingBagConfig(dynamic=DynamicVocab())``):
    its ids are any int32 (int64 with ``jax_enable_x64``) values, each given its own row
    by a hash table (``jaxrec.ops.hash_table``) of ``num_embeddings`` slots, inserted while
    training, evicted by ``eviction`` when their bucket is full (docs/dynamic_vocab.md)."""

    eviction: str = "lru"
    """``"lru"`` (last step seen), ``"lfu"`` (times seen) or ``"none"`` (a full bucket
    refuses new ids: they look up nothing)."""
    bucket_size: int = 128
    """Slots per bucket (at most 1024); ``num_embeddings`` must be a multiple of it."""

    def __post_init__(self):
        if self.eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {self.eviction!r}")
        if (isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int)
                or not 1 <= self.bucket_size <= MAX_BUCKET_SIZE):
            raise ValueError(f"bucket_size must be an int in [1, {MAX_BUCKET_SIZE}], got {self.bucket_size!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingBagConfig(EmbeddingConfig):
    """A pooled table (TorchRec's ``EmbeddingBagConfig``): each bag of ids becomes one row."""

    pooling: PoolingMode | str = PoolingMode.SUM
    """SUM or MEAN (NONE is for ``EmbeddingCollection``)."""
    tt: TTConfig | None = None
    """Store the table as tensor-train cores (FBTT) instead of a dense matrix; float32 only.
    A TT table is looked up on its own (not batched with the dense tables)."""
    dynamic: DynamicVocab | None = None
    """Take raw ids, each mapped to its own row by a hash table (a dynamic vocabulary);
    looked up with the collection's other dynamic tables of the same ``dynamic_group_key``,
    apart from ordinary tables. Needs a fused optimizer."""
    placement: str = "device"
    """Where the rows and their optimizer state live (docs/host_memory.md): ``"device"``
    (device memory), ``"host"`` (host memory, each batch's rows read over PCIe; FBGEMM's
    ``MANAGED``) or ``"host_cached"`` (host memory, with a cache of ``cache_size()`` rows in
    device memory; FBGEMM's ``MANAGED_CACHING``). Tables in host memory need a fused
    optimizer and are looked up with the collection's other tables of the same placement
    and ``host_cache_group_key``."""
    cache_rows: int | None = None
    """Rows of a host-cached table's cache (rounded up to a multiple of 128)."""
    cache_load_factor: float | None = None
    """The cache's rows as a fraction of ``num_embeddings`` (TorchRec's name), when
    ``cache_rows`` is not given; default 0.2."""
    cache_policy: str = "lru"
    """Which cached row a new one replaces: ``"lru"`` (least recently used) or ``"lfu"``
    (least often used)."""

    def __post_init__(self):
        super().__post_init__()
        pooling = as_pooling_mode(self.pooling)
        if pooling == PoolingMode.NONE:
            raise ValueError(f"table {self.name!r}: an EmbeddingBagConfig pools (SUM or MEAN); for "
                             "one embedding per id use EmbeddingConfig in an EmbeddingCollection")
        object.__setattr__(self, "pooling", pooling)
        if self.tt is not None:
            if not isinstance(self.tt, TTConfig):
                raise TypeError(f"table {self.name!r}: tt must be a jaxrec.nn.TTConfig, got "
                                f"{type(self.tt).__name__}")
            if self.dtype != "float32":
                raise ValueError(f"table {self.name!r}: TT tables are float32, got dtype={self.dtype!r}")
            self.tt_layout()  # validates the factorisation now, not at the first lookup
        if self.dynamic is not None:
            if not isinstance(self.dynamic, DynamicVocab):
                raise TypeError(f"table {self.name!r}: dynamic must be a jaxrec.nn.DynamicVocab, got "
                                f"{type(self.dynamic).__name__}")
            if self.tt is not None:
                raise ValueError(f"table {self.name!r}: a table is either TT or dynamic, not both")
            if self.num_embeddings % self.dynamic.bucket_size:
                raise ValueError(f"table {self.name!r}: a dynamic table's num_embeddings (its slots) must "
                                 f"be a multiple of bucket_size={self.dynamic.bucket_size}, got "
                                 f"{self.num_embeddings}")
        self._check_placement()

    def _check_placement(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"table {self.name!r}: placement must be one of {PLACEMENTS}, got {self.placement!r}")
        cache_fields = {"cache_rows": self.cache_rows, "cache_load_factor": self.cache_load_factor}
        if self.placement != "host_cached":
            given = [k for k, v in cache_fields.items() if v is not None]
            if given:
                raise ValueError(f"table {self.name!r}: {given} apply to placement='host_cached' only; the "
                                 f"table's placement is {self.placement!r}")
        if self.placement == "device":
            return
        if self.tt is not None or self.dynamic is not None:
            raise ValueError(f"table {self.name!r}: a table in host memory is an ordinary table (not TT, not "
                             f"dynamic); placement={self.placement!r}")
        if self.cache_policy not in CACHE_POLICIES:
            raise ValueError(f"table {self.name!r}: cache_policy must be one of {CACHE_POLICIES}, got "
                             f"{self.cache_policy!r}")
        if self.cache_rows is not None and self.cache_load_factor is not None:
            raise ValueError(f"table {self.name!r}: give cache_rows or cache_load_factor, not both")
        rows = self.cache_rows
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 1):
            raise ValueError(f"table {self.name!r}: cache_rows must be an int >= 1, got {rows!r}")
        factor = self.cache_load_factor
        if factor is not None and not (isinstance(factor, (int, float)) and 0 < factor <= 1):
            raise ValueError(f"table {self.name!r}: cache_load_factor must lie in (0, 1], got {factor!r}")
        if self.num_embeddings >= 2**31:
            raise ValueError(f"table {self.name!r}: a table in host memory holds fewer than 2**31 rows, got "
                             f"{self.num_embeddings}")

    def cache_size(self) -> int:
        """A host-cached table's cache rows: ``cache_rows``, or ``cache_load_factor`` (0.2)
        of ``num_embeddings``, rounded up to a multiple of 128, at most the table's rows
        rounded up so."""
        wanted = self.cache_rows or math.ceil((self.cache_load_factor or 0.2) * self.num_embeddings)
        whole = -(-self.num_embeddings // CACHE_BUCKET) * CACHE_BUCKET
        return min(-(-wanted // CACHE_BUCKET) * CACHE_BUCKET, whole)

    def tt_layout(self) -> TTLayout:
        """The table's ``TTLayout`` (for a TT table)."""
        tt = self.tt
        return TTLayout.create(self.num_embeddings, self.embedding_dim, tt.tt_ranks,
                               tt.tt_p_shapes, tt.tt_q_shapes)


@dataclasses.dataclass(frozen=True)
class TableGroup:
    """Tables looked up together: one ``TableLayout`` (one flat buffer) and its features."""

    tables: tuple[EmbeddingConfig, ...]
    pooling: PoolingMode
    dtype: str
    layout: TableLayout
    feature_names: tuple[str, ...]

    @property
    def tt(self) -> bool:
        """Whether the group is one TT table (looked up by ``TTEmbeddingBag``)."""
        return getattr(self.tables[0], "tt", None) is not None

    @property
    def dynamic(self) -> bool:
        """Whether the group's tables are dynamic vocabularies (ids mapped by one hash index)."""
        return getattr(self.tables[0], "dynamic", None) is not None

    @property
    def host_cached(self) -> bool:
        """Whether the group's tables live in host memory with a device cache (``layout``
        is then the cache's; nn/host_cache.py)."""
        return self.placement == "host_cached"

    @property
    def placement(self) -> str:
        """``"device"``, ``"host"`` or ``"host_cached"`` (``EmbeddingBagConfig.placement``)."""
        return getattr(self.tables[0], "placement", "device")

    @property
    def in_host_memory(self) -> bool:
        """Whether the group's full tables live in host memory (placed or cached there)."""
        return self.placement != "device"


def group_tables(tables: Sequence[EmbeddingConfig], pooling: PoolingMode | None = None
                 ) -> tuple[TableGroup, ...]:
    """Checks ``tables`` and groups them by (pooling, dtype), in order of first appearance;
    each TT table is a group of its own, dynamic tables are grouped apart from the others
    by ``dynamic_group_key`` too, tables in host memory by their placement and
    ``host_cache_group_key``. A host-cached group's layout is its cache's (``cache_size()`` rows per table).

    ``pooling`` overrides the tables' own (``PoolingMode.NONE`` for sequence embeddings).
    """
    tables = tuple(tables)
    if not tables or not all(isinstance(t, EmbeddingConfig) for t in tables):
        raise TypeError(f"tables must be a non-empty list of EmbeddingConfig / EmbeddingBagConfig, "
                        f"got {tables!r}")
    _check_unique([t.name for t in tables], "table names")
    _check_unique([f for t in tables for f in t.feature_names], "feature names")
    order: dict[tuple, list[EmbeddingConfig]] = {}
    for t in tables:
        p = pooling if pooling is not None else t.pooling
        if getattr(t, "tt", None) is not None:  # TT tables: a group each
            key = ("tt", t.name)
        elif getattr(t, "dynamic", None) is not None:  # one index per group (nn/dynamic.py)
            key = ("dynamic", p, t.dtype, *dynamic_group_key(t))
        elif getattr(t, "placement", "device") != "device":  # host_cached: one cache per group
            key = (t.placement, p, t.dtype, *host_cache_group_key(t))
        else:
            key = (p, t.dtype)
        order.setdefault(key, []).append(t)
    groups = []
    for members in order.values():
        p = pooling if pooling is not None else members[0].pooling
        dtype = members[0].dtype
        features = tuple(f for t in members for f in t.feature_names)
        cached = getattr(members[0], "placement", "device") == "host_cached"
        layout = TableLayout(rows=tuple(t.cache_size() if cached else t.num_embeddings for t in members),
                             dims=tuple(t.embedding_dim for t in members),
                             feature_table_map=tuple(i for i, t in enumerate(members)
                                                     for _ in t.feature_names))
        groups.append(TableGroup(tuple(members), p, dtype, layout, features))
    return tuple(groups)


def dynamic_group_key(config) -> tuple:
    """What dynamic tables must share to be one group (one index, one lookup,
    nn/dynamic.py): the index's bucket size and policy, and the row width (a new id's row
    is reset at ``row * width``); a table with its own ``init_fn`` draws its rows alone."""
    return (config.dynamic.bucket_size, config.dynamic.eviction, config.embedding_dim,
            config.name if config.init_fn is not None else None)


def host_cache_group_key(config) -> tuple:
    """What tables of one host placement must share to be one group (one lookup; host-cached:
    one index, one cache, nn/host_cache.py): the policy and the row width (a row is
    exchanged whole)."""
    return (config.cache_policy, config.embedding_dim)


def _check_unique(names: list[str], what: str) -> None:
    seen, repeated = set(), []
    for n in names:
        if n in seen:
            repeated.append(n)
        seen.add(n)
    if repeated:
        raise ValueError(f"{what} must be unique within a collection; {sorted(set(repeated))} "
                         "appear more than once. To let several features read one table, list them "
                         "in that table's feature_names")
