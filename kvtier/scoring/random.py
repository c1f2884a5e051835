"""Random ranking, seeded: the floor every other scorer must beat."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import ConfigError


@dataclass
class RandomScorer:
    """Uniform random scores from a seeded generator, so two runs with the same seed rank alike.

    Parameters
    ----------
    seed
        Seed of the generator; scores depend on it and on the order of calls.
    """

    seed: int = 0
    name: str = "random"
    _generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed={self.seed!r}; allowed: a whole number")
        self._generator = torch.Generator().manual_seed(self.seed)

    def score(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              layer_idx: int) -> torch.Tensor:
        out = torch.rand(tuple(keys.shape[:3]), generator=self._generator)
        return out.to(keys.device)
