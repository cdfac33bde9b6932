"""Small, readable recommendation models built from ``jaxrec.nn`` (TorchRec's names).

- ``DLRM``: bottom MLP, pairwise dot interaction, top MLP (click-through rate).
- ``DLRM_DCN``: DLRM with DCN-v2's low-rank cross network as the interaction.
- ``TwoTower``: query and candidate towers over one collection; matrix factorisation when
  the towers are empty (ratings); ``embed`` gives both towers' outputs for retrieval.
- ``in_batch_softmax_loss`` (with the logQ correction) and ``bpr_loss``: retrieval losses
  over a batch of (query, candidate) pairs.
"""

from jaxrec.models._dlrm import DLRM, DLRM_DCN, OverArch
from jaxrec.models._retrieval_loss import bpr_loss, in_batch_softmax_loss
from jaxrec.models._two_tower import TwoTower

__all__ = ["DLRM", "DLRM_DCN", "OverArch", "TwoTower", "bpr_loss", "in_batch_softmax_loss"]
