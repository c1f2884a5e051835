"""Where each demoted page lives: host slot or disk record, its size, rank and checksum.

Pages are numbered per layer; every head gets the same number of pages at each demotion (budgets are
equal per head), so page ``p`` exists for all heads and the table is a ``[heads, pages]`` grid. Pages are
never destroyed in tier mode; they only move down.
"""

from __future__ import annotations

import numpy as np

EMPTY, HOST, DISK = 0, 1, 2
TIER_NAMES = {HOST: "host", DISK: "disk"}


class PageTable:
    """Metadata of the demoted pages of one layer (numpy, no tensors)."""

    def __init__(self, heads: int) -> None:
        self.heads = heads
        self.n = 0
        self._alloc(0)

    def _alloc(self, cap: int) -> None:
        self.tier = np.zeros((self.heads, cap), dtype=np.int8)
        self.slot = np.full((self.heads, cap), -1, dtype=np.int64)
        self.count = np.zeros((self.heads, cap), dtype=np.int64)
        self.rank = np.full((self.heads, cap), -np.inf, dtype=np.float32)
        self.crc = np.zeros((self.heads, cap), dtype=np.uint32)

    @property
    def capacity(self) -> int:
        return self.tier.shape[1]

    def add(self, n_new: int) -> np.ndarray:
        """Reserve `n_new` page ids (for every head); returns them."""
        if self.n + n_new > self.capacity:
            old = (self.tier, self.slot, self.count, self.rank, self.crc)
            self._alloc(max(self.n + n_new, 2 * self.capacity, 64))
            for new, prev in zip((self.tier, self.slot, self.count, self.rank, self.crc), old):
                new[:, : self.n] = prev[:, : self.n]
        ids = np.arange(self.n, self.n + n_new)
        self.n += n_new
        return ids

    def tokens(self, tier: int) -> np.ndarray:
        """Entries per head held in `tier`."""
        n = self.n
        return np.where(self.tier[:, :n] == tier, self.count[:, :n], 0).sum(axis=1)

    def pages(self, tier: int) -> int:
        return int((self.tier[:, : self.n] == tier).sum())

    def clear(self) -> None:
        self.n = 0
        self._alloc(0)
