"""``FusedTables``: the NNX variable that holds fused tables.

Its own module so that the collections (_tables.py) and the TT module
(_tt_embedding_bag.py) both build on it without importing each other.
"""

from flax import nnx


class FusedTables(nnx.Variable):
    """A ``FusedEmbeddingTables``: tables and optimizer slots updated by the fused backward."""
