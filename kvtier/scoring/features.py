"""Per-entry input features of learned scorers: key, value and a smooth encoding of the absolute position;
and the age basis of their recency term (how long ago an entry was written, which changes every step)."""

from __future__ import annotations

import math

import torch

POSITION_FEATURES = 8
_SCALE = math.log(8192.0)


def position_features(positions: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[tokens]`` int -> ``[tokens, 8]`` float32: log-position, its square, and sines/cosines of it (into
    `out` when given).

    Log-scaled so that positions far past the training lengths still map to nearby, ordered features
    (a learned table would saturate, as KVP's 6,000-entry table does). Computed in a dozen tensor ops, one
    launch each on a GPU, as every layer scores every new token.
    """
    lp = torch.log1p(positions.float()) / _SCALE
    a = lp * math.pi
    x = torch.stack([a, a * 2.0, a * 4.0], dim=-1)      # lp * w * pi for w = 1, 2, 4 (doubling is exact)
    waves = torch.stack([x.sin(), x.cos()], dim=-1).flatten(-2)   # sin, cos of each in turn
    return torch.cat([lp[:, None], (lp * lp)[:, None], waves], dim=-1, out=out)


def entry_features(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                   position_feats: torch.Tensor | None = None) -> torch.Tensor:
    """``keys, values`` ``[heads, tokens, dim]`` -> ``[heads, tokens, 2 * dim + 8]`` float32 (`position_feats`:
    ``position_features(positions)`` when the caller has them already)."""
    if position_feats is None:
        position_feats = position_features(positions.to(keys.device))
    return torch.cat([keys.float(), values.float(), position_feats.expand(keys.shape[0], -1, -1)], dim=-1)


AGE_KNOTS = 22   # knots at log2(1 + age) = 0, 1, ..., 21: ages up to 2M tokens, flat beyond


def age_basis(ages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Piecewise-linear interpolation over log2(1 + age): ``(lower knot, upper knot, weight of the upper)``.

    A function of age is then ``table[lower] * (1 - w) + table[upper] * w``: one gather per entry, so a
    ranking can add it to scores computed once, at write time, and re-evaluate it at every placement.
    """
    u = torch.log2(1.0 + ages.clamp_min(0).float()).clamp_max(AGE_KNOTS - 1)
    lower = u.floor().long().clamp_max(AGE_KNOTS - 2)
    return lower, lower + 1, u - lower
