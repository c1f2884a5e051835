"""Random ranking, seeded: the floor every other scorer must beat."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import ConfigError


_MASK = 0xFFFFFFFF
_MIX = 0x45D9F3B   # an odd multiplier under 2**27: products of 32-bit values stay inside int64


def _mix(x):
    """A 32-bit integer hash (two multiply-xorshift rounds) of `x` in [0, 2**32): an int, or an int64 tensor."""
    x = ((x >> 16) ^ x) * _MIX & _MASK
    x = ((x >> 16) ^ x) * _MIX & _MASK
    return (x >> 16) ^ x


@dataclass
class RandomScorer:
    """Uniform random scores, a hash of (seed, layer, KV head, position): the same entry gets the same score
    whatever was scored before it, so a run's result does not depend on the runs before it (an evaluation
    resumed midway gives the numbers of a whole run) and a prompt scored in chunks ranks as one scored whole.

    Parameters
    ----------
    seed
        Scores depend on it and on the entry, nothing else.
    """

    seed: int = 0
    name: str = "random"
    capturable: ClassVar[bool] = True   # a function of the positions: launches only (`scoring.capturable`)

    def __post_init__(self) -> None:
        # the hash takes 32 bits of it: a wider seed would score as another one does (2**32 as 0)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= _MASK:
            raise ConfigError(f"seed={self.seed!r}; allowed: a whole number from 0 to {_MASK:,}")

    def score(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              layer_idx: int) -> torch.Tensor:
        batch, heads, n = keys.shape[:3]
        pos = positions.to(device=keys.device, dtype=torch.int64).reshape(1, 1, -1) & _MASK
        head = torch.arange(heads, device=keys.device, dtype=torch.int64).reshape(1, -1, 1)
        salt = _mix((self.seed & _MASK) ^ (layer_idx * 0x9E3779B1 & _MASK))   # a Python int: no host copy
        h = _mix(_mix(pos ^ salt) ^ (head * 0x2545F491 & _MASK))
        return ((h >> 8).float() * 2.0 ** -24).expand(batch, heads, n)
