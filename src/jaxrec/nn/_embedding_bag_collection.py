"""``EmbeddingBagCollection``: TorchRec's pooled-embedding module over table-batched lookups.

::

    ebc = EmbeddingBagCollection([
        EmbeddingBagConfig(name="t_user", num_embeddings=1000, embedding_dim=16,
                           feature_names=["user"]),
        EmbeddingBagConfig(name="t_item", num_embeddings=500, embedding_dim=8,
                           feature_names=["item", "last_item"], pooling="MEAN"),
    ], optimizer=RowWiseAdagrad(learning_rate=0.05), rngs=nnx.Rngs(0))

    #              0       1        2  <-- batch
    # "user"       [3, 7]  []       [1]
    # "item"       [2]     [9]      [4, 4, 0]
    # "last_item"  [5]     [5]      []
    ebc(kjt)  ->  KeyedTensor(keys=["user", "item", "last_item"], values [3, 16 + 8 + 8])
"""

from __future__ import annotations

from collections.abc import Sequence

from flax import nnx

from jaxrec.nn._configs import EmbeddingBagConfig
from jaxrec.nn._tables import GroupedTables, concat_in_order
from jaxrec.ops import BoundsCheckMode
from jaxrec.optim import OptimizerConfig
from jaxrec.sparse import KeyedJaggedTensor, KeyedTensor


class EmbeddingBagCollection(GroupedTables):
    """Pooled embeddings of a ``KeyedJaggedTensor``'s features (TorchRec's module).

    Args:
      tables: the ``EmbeddingBagConfig`` s; the output keys are their feature names, table by
        table, in this order (TorchRec's order).
      optimizer: ``None``: tables are ``nnx.Param`` (trained by optax, dense gradients);
        a fused optimizer config (``jaxrec.optim.RowWiseAdagrad(...)``, ``SGD``, ...): tables
        are ``FusedTables`` updated in the backward pass (``jaxrec.nn.make_train_step``).
      rngs: initialises the tables (``rngs.params()``, one key per table).
      bounds_check_mode: how ids outside a table are handled (``jaxrec.ops.BoundsCheckMode``;
        the default WARNING maps them to row 0).
      backend: "auto", "kernel" or "reference" (``jaxrec.ops.embedding_bag_lookup``).
      name: the tables' name in fused mode, unique among the collections of one model.

    The input may hold more keys than the tables use, in any order; per-sample weights of the
    KJT, when present, weight the ids.
    """

    def __init__(self, tables: Sequence[EmbeddingBagConfig], *,
                 optimizer: OptimizerConfig | None = None, rngs: nnx.Rngs,
                 bounds_check_mode: BoundsCheckMode | str = BoundsCheckMode.WARNING,
                 backend: str = "auto", name: str = "ebc"):
        tables = tuple(tables)
        wrong = [t.name for t in tables if not isinstance(t, EmbeddingBagConfig)]
        if wrong:
            raise TypeError(f"EmbeddingBagCollection pools: tables {wrong} must be "
                            "EmbeddingBagConfig (EmbeddingConfig goes to EmbeddingCollection)")
        super().__init__(tables, None, optimizer=optimizer, rngs=rngs,
                         bounds_check_mode=bounds_check_mode, backend=backend, name=name)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self.table_configs)

    def __call__(self, features: KeyedJaggedTensor) -> KeyedTensor:
        dims = {f: t.embedding_dim for t in self.table_configs for f in t.feature_names}
        outputs = [self.lookup(i, kjt, g.pooling)
                   for i, (g, kjt) in enumerate(zip(self.groups, self.group_features(features)))]
        if len(outputs) == 1:
            values = outputs[0]
        else:
            blocks = []
            for g, out in zip(self.groups, outputs):
                offsets = g.layout.output_offsets
                blocks += [(f, out[:, offsets[k]:offsets[k + 1]]) for k, f in enumerate(g.feature_names)]
            values = concat_in_order(blocks, self.feature_names)
        return KeyedTensor(list(self.feature_names), [dims[f] for f in self.feature_names], values)
