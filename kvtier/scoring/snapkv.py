"""SnapKV: rank entries by the attention of an observation window of the latest queries, pooled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .attention_stats import received_attention


@dataclass
class SnapKVScorer:
    """Attention summed over the last `window` queries, average-pooled over `kernel` neighbours.

    Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv 2404.14469.
    A `QueryScorer`: scored after attention.

    Parameters
    ----------
    window
        How many of the latest queries vote.
    kernel
        Width of the average pooling over neighbouring entries; odd, so the pooled scores stay aligned.
    """

    window: int = 32
    kernel: int = 5
    name: str = "snapkv"
    needs_query: ClassVar[bool] = True   # the `QueryScorer` marker, not a setting

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ConfigError(f"window={self.window!r}; allowed: a whole number >= 1")
        if isinstance(self.kernel, bool) or not isinstance(self.kernel, int) or self.kernel < 1 or self.kernel % 2 == 0:
            raise ConfigError(f"kernel={self.kernel!r}; allowed: an odd whole number >= 1")

    def score(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, layer_idx: int, *,
              query: torch.Tensor, context_keys: torch.Tensor, scaling: float,
              softcap: float | None = None) -> torch.Tensor:
        att = received_attention(query, context_keys, keys.shape[2], scaling, slice(-self.window, None),
                                 softcap=softcap)
        votes = att.sum(dim=2).mean(dim=1)  # [kv_heads, new]
        # the mean of the votes there are: padding counted in had cut a one-token write's score by the kernel width
        pooled = F.avg_pool1d(votes[:, None], self.kernel, stride=1, padding=self.kernel // 2,
                              count_include_pad=False)[:, 0]
        return pooled[:, : keys.shape[2]].unsqueeze(0)
