"""Key-norm ranking: keys with a small L2 norm tend to draw more attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass
class KeyNormScorer:
    """Ranks entries by the negated L2 norm of their (post-RoPE) key.

    Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", arXiv 2406.11430.
    """

    name: str = "keynorm"
    capturable: ClassVar[bool] = True   # one norm of the new keys: launches only (`scoring.capturable`)

    def score(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              layer_idx: int) -> torch.Tensor:
        return -torch.linalg.vector_norm(keys.float(), dim=-1)
