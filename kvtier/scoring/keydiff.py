"""KeyDiff ranking: keys that differ most from the average key are kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F


@dataclass
class KeyDiffScorer:
    """Ranks entries by the negated cosine similarity of their key to the mean key of the same write.

    Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction", arXiv 2504.15364. Attention-free. The
    mean is over the entries written together (the prompt at prefill), since scores are computed once.
    """

    name: str = "keydiff"
    capturable: ClassVar[bool] = True   # the new keys against their mean: launches only (`scoring.capturable`)

    def score(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              layer_idx: int) -> torch.Tensor:
        k = keys.float()
        anchor = k.mean(dim=2, keepdim=True)
        return -F.cosine_similarity(k, anchor, dim=-1)
