"""Model-parallel embeddings over a device mesh: a sharding planner and sharded collections.

TorchRec's answer to tables that do not fit one GPU, on JAX's own engine
(``jax.sharding.Mesh``, ``shard_map`` and XLA collectives):

- ``ShardingType`` (DATA_PARALLEL, TABLE_WISE, ROW_WISE, COLUMN_WISE, TABLE_ROW_WISE),
  ``ParameterSharding``, ``ShardingPlan`` (JSON ``save`` / ``load``, ``table()``) and the
  hand-written plan helpers (``construct_plan`` with ``table_wise(rank)``, ``row_wise()``,
  ``column_wise(ranks)``, ``table_row_wise(host_index)``, ``data_parallel()``).
- ``EmbeddingShardingPlanner`` over a ``Topology``, honouring ``ParameterConstraints``.
- ``ShardedEmbeddingBagCollection`` (or ``shard(model, plan, mesh)``), ``shard_batch`` and
  ``make_forward``; a sharded model trains with ``jaxrec.nn.make_train_step``, one jitted
  step for the whole model.
- ``portable_state`` / ``load_portable_state``: checkpoints that restore on any mesh.
- ``initialize_distributed`` / ``launch``: several processes on one mesh
  (``jax.distributed``; ``jaxrec launch``), docs/multiprocess.md.

The planner and the types never import Flax; the sharded module is Flax NNX like
``jaxrec.nn``. Design, pictures and limits: docs/parallel.md.
"""

from jaxrec.parallel._estimator import PlanStats, estimate
from jaxrec.parallel._multiprocess import initialize_distributed, launch
from jaxrec.parallel._planner import EmbeddingShardingPlanner, PlannerError
from jaxrec.parallel._table_spec import TableSpec
from jaxrec.parallel._topology import ParameterConstraints, Topology
from jaxrec.parallel._types import (
    ParameterSharding,
    Shard,
    ShardingPlan,
    ShardingType,
    column_wise,
    construct_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)

__all__ = [
    "EmbeddingShardingPlanner",
    "ParameterConstraints",
    "ParameterSharding",
    "PlanStats",
    "PlannerError",
    "Shard",
    "ShardedEmbeddingBagCollection",
    "ShardingPlan",
    "ShardingType",
    "TableSpec",
    "Topology",
    "column_wise",
    "construct_plan",
    "data_parallel",
    "estimate",
    "initialize_distributed",
    "launch",
    "load_portable_state",
    "make_forward",
    "portable_state",
    "row_wise",
    "shard",
    "shard_batch",
    "table_row_wise",
    "table_wise",
]

_FLAX = {"ShardedEmbeddingBagCollection": "_sharded_ebc", "shard": "_sharded_ebc",
         "make_forward": "_train", "shard_batch": "_train",
         "portable_state": "_checkpoint", "load_portable_state": "_checkpoint"}


def __getattr__(name):  # the Flax layer loads on first use: the planner never imports Flax
    if name in _FLAX:
        import importlib

        return getattr(importlib.import_module(f"jaxrec.parallel.{_FLAX[name]}"), name)
    raise AttributeError(f"module 'jaxrec.parallel' has no attribute {name!r}")
