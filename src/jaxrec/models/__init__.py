"""Small, readable recommendation models built from ``jaxrec.nn`` (TorchRec's names).

- ``DLRM``: bottom MLP, pairwise dot interaction, top MLP (click-through rate).
- ``DLRM_DCN``: DLRM with DCN-v2's low-rank cross network as the interaction.
- ``TwoTower``: query and candidate towers over one collection; matrix factorisation when
  the towers are empty (ratings).
"""

from jaxrec.models._dlrm import DLRM, DLRM_DCN, OverArch
from jaxrec.models._two_tower import TwoTower

__all__ = ["DLRM", "DLRM_DCN", "OverArch", "TwoTower"]
