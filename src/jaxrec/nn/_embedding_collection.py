"""``EmbeddingCollection``: TorchRec's sequence-embedding module (one embedding per id).

::

    ec = EmbeddingCollection([EmbeddingConfig(name="t_item", num_embeddings=500,
                                              embedding_dim=8, feature_names=["history"])],
                             rngs=nnx.Rngs(0))
    #              0       1     2  <-- batch
    # "history"    [3, 7]  []    [1]
    ec(kjt)["history"]  ->  JaggedTensor(values [capacity, 8] (rows of 3, 7, 1, then zeros),
                                         lengths [2, 0, 1])
"""

from __future__ import annotations

from collections.abc import Sequence

from flax import nnx

from jaxrec.nn._configs import EmbeddingBagConfig, EmbeddingConfig
from jaxrec.nn._tables import GroupedTables
from jaxrec.ops import BoundsCheckMode, PoolingMode
from jaxrec.ops.tbe_kjt import split_sequence_embeddings
from jaxrec.optim import OptimizerConfig
from jaxrec.sparse import JaggedTensor, KeyedJaggedTensor


class EmbeddingCollection(GroupedTables):
    """Per-id embeddings of a ``KeyedJaggedTensor``'s features, as ``{feature: JaggedTensor}``.

    The arguments are ``EmbeddingBagCollection``'s; the tables are ``EmbeddingConfig`` s and
    all of them need one ``embedding_dim`` (the rows of every feature share one buffer).
    Each output ``JaggedTensor`` has the input's capacity: its key's rows first, zeros after.
    """

    def __init__(self, tables: Sequence[EmbeddingConfig], *,
                 optimizer: OptimizerConfig | None = None, rngs: nnx.Rngs,
                 bounds_check_mode: BoundsCheckMode | str = BoundsCheckMode.WARNING,
                 backend: str = "auto", name: str = "ec"):
        tables = tuple(tables)
        pooled = [t.name for t in tables if isinstance(t, EmbeddingBagConfig)]
        if pooled:
            raise TypeError(f"EmbeddingCollection does not pool: tables {pooled} are "
                            "EmbeddingBagConfig; use EmbeddingConfig (or an EmbeddingBagCollection)")
        dims = sorted({t.embedding_dim for t in tables if isinstance(t, EmbeddingConfig)})
        if len(dims) > 1:
            raise ValueError(f"all tables of an EmbeddingCollection need one embedding_dim, got "
                             f"{dims}; use one collection per dim")
        super().__init__(tables, PoolingMode.NONE, optimizer=optimizer, rngs=rngs,
                         bounds_check_mode=bounds_check_mode, backend=backend, name=name)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return list(self.table_configs)

    def __call__(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        out = {}
        for i, (g, kjt) in enumerate(zip(self.groups, self.group_features(features))):
            out.update(split_sequence_embeddings(self.lookup(i, kjt, g.pooling), kjt))
        return {f: out[f] for f in self.feature_names}
