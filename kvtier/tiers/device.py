"""The device tier of one layer: the entries attention reads every step, per KV head, in position order."""

from __future__ import annotations

import torch


class DevicePool:
    """Preallocated K/V storage on the compute device (GPU, or plain memory on a CPU-only machine).

    Every head holds the same number of entries (budgets are per head and equal), so the pool is one
    rectangular tensor per kind. Entries ``[0, count)`` are committed; a step's new tokens may sit in
    ``[count, count + q)`` while attention runs, until the placement commits or demotes them.

    Shapes: ``k``, ``v`` ``[1, heads, capacity, head_dim]``; ``pos`` ``[heads, capacity]`` int64;
    ``score`` ``[heads, capacity]`` float32.
    """

    def __init__(self, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 0) -> None:
        self.heads, self.head_dim, self.dtype, self.device = heads, head_dim, dtype, device
        self.count = 0
        self._alloc(max(capacity, 0))

    def _alloc(self, capacity: int) -> None:
        self.k = torch.empty(1, self.heads, capacity, self.head_dim, dtype=self.dtype, device=self.device)
        self.v = torch.empty_like(self.k)
        self.pos = torch.empty(self.heads, capacity, dtype=torch.int64, device=self.device)
        self.score = torch.empty(self.heads, capacity, dtype=torch.float32, device=self.device)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, capacity: int) -> None:
        """Grow (never shrink) to hold `capacity` entries, keeping the committed ones."""
        if capacity <= self.capacity:
            return
        capacity = max(capacity, self.capacity + self.capacity // 2)
        old = (self.k, self.v, self.pos, self.score)
        self._alloc(capacity)
        n = self.count
        self.k[:, :, :n].copy_(old[0][:, :, :n])
        self.v[:, :, :n].copy_(old[1][:, :, :n])
        self.pos[:, :n].copy_(old[2][:, :n])
        self.score[:, :n].copy_(old[3][:, :n])

    def fits(self, extra: int) -> bool:
        return self.count + extra <= self.capacity

    def stage(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new K/V after the committed entries and return views over both (no commit yet)."""
        n, q = self.count, k.shape[2]
        self.k[:, :, n:n + q].copy_(k)
        self.v[:, :, n:n + q].copy_(v)
        return self.k[:, :, :n + q], self.v[:, :, :n + q]

    def committed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.count
        return self.k[:, :, :n], self.v[:, :, :n], self.pos[:, :n], self.score[:, :n]

    def replace(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, score: torch.Tensor) -> None:
        """Make ``k, v`` ``[heads, n, dim]`` (and their positions and scores) the committed entries."""
        n = k.shape[1]
        self.reserve(n)
        self.k[0, :, :n].copy_(k)
        self.v[0, :, :n].copy_(v)
        self.pos[:, :n].copy_(pos)
        self.score[:, :n].copy_(score)
        self.count = n

    def entry_bytes(self) -> int:
        """Bytes of one entry of one head: key, value, position and score."""
        return 2 * self.head_dim * self.k.element_size() + 8 + 4

    def reserved_bytes(self) -> int:
        return self.capacity * self.heads * self.entry_bytes()

    def clear(self) -> None:
        self.count = 0
        self._alloc(0)
