"""TOVA: rank entries by the attention the latest query gives them (attention-based baseline)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .attention_stats import received_attention


@dataclass
class TOVAScorer:
    """Attention weight from the last query written with the entries, averaged over the group's heads.

    Oren et al., "Transformers are Multi-State RNNs", arXiv 2401.06104. A `QueryScorer`: scored after attention.
    """

    name: str = "tova"
    needs_query: ClassVar[bool] = True   # the `QueryScorer` marker, not a setting

    def score(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, layer_idx: int, *,
              query: torch.Tensor, context_keys: torch.Tensor, scaling: float,
              softcap: float | None = None) -> torch.Tensor:
        att = received_attention(query, context_keys, keys.shape[2], scaling, slice(-1, None), softcap=softcap)
        return att[:, :, 0].mean(dim=1).unsqueeze(0)
