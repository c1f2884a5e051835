"""Per-entry input features of learned scorers: key, value and a smooth encoding of the absolute position."""

from __future__ import annotations

import math

import torch

POSITION_FEATURES = 8
_SCALE = math.log(8192.0)


def position_features(positions: torch.Tensor) -> torch.Tensor:
    """``[tokens]`` int -> ``[tokens, 8]`` float32: log-position, its square, and sines/cosines of it.

    Log-scaled so that positions far past the training lengths still map to nearby, ordered features
    (a learned table would saturate, as KVP's 6,000-entry table does).
    """
    lp = torch.log1p(positions.float()) / _SCALE
    waves = [f(lp * w * math.pi) for w in (1.0, 2.0, 4.0) for f in (torch.sin, torch.cos)]
    return torch.stack([lp, lp * lp, *waves], dim=-1)


def entry_features(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``keys, values`` ``[heads, tokens, dim]`` -> ``[heads, tokens, 2 * dim + 8]`` float32."""
    pos = position_features(positions.to(keys.device)).expand(keys.shape[0], -1, -1)
    return torch.cat([keys.float(), values.float(), pos], dim=-1)
