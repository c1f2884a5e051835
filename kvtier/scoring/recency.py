"""StreamingLLM-style ranking: attention sinks first, then the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import ConfigError


@dataclass
class RecencyScorer:
    """Ranks the first `sink_tokens` highest, then newer tokens above older ones.

    Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453.

    Parameters
    ----------
    sink_tokens
        How many of the first positions count as attention sinks.
    """

    sink_tokens: int = 4
    name: str = "recency"
    capturable: ClassVar[bool] = True   # a function of the positions: launches only (`scoring.capturable`)

    def __post_init__(self) -> None:
        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ConfigError(f"sink_tokens={self.sink_tokens!r}; allowed: a whole number >= 0")

    def score(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              layer_idx: int) -> torch.Tensor:
        score = positions.to(device=keys.device, dtype=torch.float64)
        score = torch.where(positions.to(keys.device) < self.sink_tokens, float("inf"), score)
        return score.float().expand(keys.shape[0], keys.shape[1], -1)
