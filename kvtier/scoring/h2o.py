"""H2O: rank entries by the attention accumulated over every query written with them ("heavy hitters")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .attention_stats import received_attention_sum


@dataclass
class H2OScorer:
    """Attention summed over all queries of the write (causal), averaged over the group's heads.

    Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference", arXiv 2306.14048. Costs a
    causal ``q x q`` attention per layer at prefill, summed chunk by chunk. A `QueryScorer`: scored after
    attention.
    """

    name: str = "h2o"
    needs_query: ClassVar[bool] = True   # the `QueryScorer` marker, not a setting

    def score(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, layer_idx: int, *,
              query: torch.Tensor, context_keys: torch.Tensor, scaling: float,
              softcap: float | None = None) -> torch.Tensor:
        return received_attention_sum(query, context_keys, keys.shape[2], scaling,
                                      softcap=softcap).mean(dim=1).unsqueeze(0)
