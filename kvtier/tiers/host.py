"""The host tier of one layer: fixed-size pages in (pinned, on CUDA machines) host memory."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import CapacityError


class HostPool:
    """Pages of demoted entries, ``page_size`` tokens each, one free list per KV head.

    Pages of a head are whole and contiguous (``page_size * head_dim`` elements), so a recall copies
    large blocks. The pool grows in chunks; on a CUDA machine its memory is pinned so copies to the
    GPU are true DMA.

    Shapes: ``k``, ``v`` ``[heads, capacity, page_size, head_dim]``; ``pos`` ``[heads, capacity,
    page_size]`` int64; ``score`` float32 likewise.
    """

    def __init__(self, heads: int, page_size: int, head_dim: int, dtype: torch.dtype, pin: bool,
                 chunk_pages: int = 64) -> None:
        self.heads, self.page_size, self.head_dim, self.dtype = heads, page_size, head_dim, dtype
        self.pin, self.chunk_pages = pin, chunk_pages
        self._free: list[list[int]] = [[] for _ in range(heads)]
        self.k = self._empty((heads, 0, page_size, head_dim), dtype)
        self.v = self._empty((heads, 0, page_size, head_dim), dtype)
        self.pos = self._empty((heads, 0, page_size), torch.int64)  # -1 marks an empty row
        self.score = self._empty((heads, 0, page_size), torch.float32)

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=self.pin)
        except RuntimeError as e:
            raise CapacityError(f"could not allocate {'pinned ' if self.pin else ''}host memory for "
                                f"{shape} {dtype}: {e}; check `ulimit -l` (memlock) and free memory") from e

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def held_pages(self, head: int) -> int:
        return self.capacity - len(self._free[head])

    def _grow(self, need: int) -> None:
        old_cap = self.capacity
        new_cap = max(old_cap + need, old_cap + self.chunk_pages, old_cap * 3 // 2)
        for name in ("k", "v", "pos", "score"):
            old = getattr(self, name)
            new = self._empty((old.shape[0], new_cap, *old.shape[2:]), old.dtype)
            new[:, :old_cap].copy_(old)
            if name == "pos":
                new[:, old_cap:] = -1
            setattr(self, name, new)
        for free in self._free:
            free.extend(range(new_cap - 1, old_cap - 1, -1))

    def store(self, heads: np.ndarray, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
              score: torch.Tensor) -> np.ndarray:
        """Store pages ``k, v`` ``[n, page_size, dim]`` for the given heads; returns their slots."""
        need = max((int((heads == h).sum()) - len(self._free[h]) for h in range(self.heads)), default=0)
        if need > 0:
            self._grow(need)
        slots = np.array([self._free[int(h)].pop() for h in heads], dtype=np.int64)
        hi, si = torch.from_numpy(heads.astype(np.int64)), torch.from_numpy(slots)
        self.k[hi, si] = k
        self.v[hi, si] = v
        self.pos[hi, si] = pos
        self.score[hi, si] = score
        return slots

    def load(self, heads: np.ndarray, slots: np.ndarray,
             out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather pages ``[n, page_size, dim]`` (into `out` when given, e.g. pinned staging)."""
        flat = torch.from_numpy(heads.astype(np.int64) * self.capacity + slots.astype(np.int64))
        k = self.k.view(-1, self.page_size, self.head_dim)
        v = self.v.view(-1, self.page_size, self.head_dim)
        if out is None:
            return torch.index_select(k, 0, flat), torch.index_select(v, 0, flat)
        torch.index_select(k, 0, flat, out=out[0])
        torch.index_select(v, 0, flat, out=out[1])
        return out

    def load_meta(self, heads: np.ndarray, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        hi, si = torch.from_numpy(heads.astype(np.int64)), torch.from_numpy(slots.astype(np.int64))
        return self.pos[hi, si], self.score[hi, si]

    def free(self, heads: np.ndarray, slots: np.ndarray) -> None:
        self.pos[torch.from_numpy(heads.astype(np.int64)), torch.from_numpy(slots.astype(np.int64))] = -1
        for h, s in zip(heads.tolist(), slots.tolist()):
            self._free[h].append(s)

    def slot_positions(self, head: int, slot: int) -> torch.Tensor:
        """Positions stored in one page (-1 for empty rows)."""
        return self.pos[head, slot]

    def held_tokens(self) -> torch.Tensor:
        """Entries held per head, counted from the pool itself: ``[heads]``."""
        return (self.pos >= 0).sum(dim=(1, 2))

    def page_bytes(self) -> int:
        return self.page_size * (2 * self.head_dim * self.k.element_size() + 8 + 4)

    def reserved_bytes(self) -> int:
        return self.capacity * self.heads * self.page_bytes()

    def clear(self) -> None:
        self.__init__(self.heads, self.page_size, self.head_dim, self.dtype, self.pin, self.chunk_pages)
