"""A small host cache of disk pages, filled by recall and by reading ahead.

Recall asks for the same pages step after step, and the pages it short-listed but did not take are the
likeliest to be wanted next. Both are kept here, keyed by their disk slot, in host memory counted in the
host budget: a hit costs a host gather instead of a read and a checksum. Reads ahead run on the disk
store's I/O threads while the model computes; a page read ahead is used only once its read has finished
and been verified.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import CancelledError, Future

import numpy as np
import torch

from .host import HostPool


class DiskReadAhead:
    """Up to `capacity` disk pages (of one layer) kept in host memory, least recently used dropped first."""

    def __init__(self, disk, capacity: int, page_size: int, head_dim: int, dtype: torch.dtype,
                 pin: bool) -> None:
        self.disk, self.capacity = disk, max(0, int(capacity))
        self.pool = HostPool(page_size, head_dim, dtype, pin)
        self._where: OrderedDict[int, int] = OrderedDict()     # disk slot -> host slot, oldest first
        self._pending: dict[int, tuple[Future, int]] = {}      # disk slot -> (read, index in it)
        self.hits = self.misses = self.read_ahead = 0

    def _insert(self, slots: np.ndarray, k: torch.Tensor, v: torch.Tensor, recent: bool) -> None:
        keep = [i for i, s in enumerate(slots.tolist()) if s not in self._where]
        if not keep or self.capacity == 0:
            return
        keep = keep[-self.capacity:]
        over = len(self._where) + len(keep) - self.capacity
        if over > 0:
            old = [self._where.popitem(last=False)[1] for _ in range(over)]
            self.pool.free(np.array(old, dtype=np.int64))
        idx = torch.tensor(keep)
        host = self.pool.store(k[idx], v[idx])
        for s, h in zip(slots[keep].tolist(), host.tolist()):
            self._where[s] = h
            if not recent:
                self._where.move_to_end(s, last=False)

    def _collect(self, wanted: set[int]) -> None:
        """Take finished reads ahead into the cache (waiting for those that hold a wanted page)."""
        for fut in {f for f, _ in self._pending.values()}:
            slots = np.array([s for s, (f, _) in self._pending.items() if f is fut], dtype=np.int64)
            if not fut.done() and not wanted.intersection(slots.tolist()):
                continue
            for s in slots.tolist():
                del self._pending[s]
            try:
                k, v = fut.result()
            except Exception:   # a failed read ahead is retried by the demand read, which raises properly
                continue
            order = [self._pending_index(fut, s) for s in slots.tolist()]
            self._insert(slots, k[order], v[order], recent=False)

    def _pending_index(self, fut: Future, slot: int) -> int:
        return fut.kvtier_slots.index(slot)   # type: ignore[attr-defined]

    def load(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Pages at disk `slots` ``[n]``: from the cache where held, else read (and kept)."""
        self._collect(set(slots.tolist()))
        hit = np.array([s in self._where for s in slots.tolist()], dtype=bool)
        n_hit = int(hit.sum())
        self.hits += n_hit
        self.misses += len(slots) - n_hit
        if n_hit == len(slots):
            host = np.array([self._where[s] for s in slots.tolist()], dtype=np.int64)
            for s in slots.tolist():
                self._where.move_to_end(s)
            return self.pool.load(host)
        k = torch.empty(len(slots), self.pool.page_size, self.pool.head_dim, dtype=self.pool.dtype)
        v = torch.empty_like(k)
        if n_hit:
            rows = torch.from_numpy(np.flatnonzero(hit))
            host = np.array([self._where[s] for s in slots[hit].tolist()], dtype=np.int64)
            k[rows], v[rows] = self.pool.load(host)
            for s in slots[hit].tolist():
                self._where.move_to_end(s)
        miss = slots[~hit]
        mk, mv = self.disk.load(miss)
        rows = torch.from_numpy(np.flatnonzero(~hit))
        k[rows], v[rows] = mk, mv
        self._insert(miss, mk, mv, recent=True)
        return k, v

    def prefetch(self, slots: np.ndarray) -> None:
        """Start reading pages at disk `slots` that are neither cached nor on their way."""
        todo = [s for s in dict.fromkeys(slots.tolist()) if s not in self._where and s not in self._pending]
        # at most a quarter of the cache a step: pages read ahead replace the least recently used ones
        todo = todo[:max(0, max(1, self.capacity // 4) - len(self._pending))]
        if not todo:
            return
        fut = self.disk.load_async(np.array(todo, dtype=np.int64))
        fut.kvtier_slots = todo   # type: ignore[attr-defined]
        for i, s in enumerate(todo):
            self._pending[s] = (fut, i)
        self.read_ahead += len(todo)

    def forget(self, slots: np.ndarray) -> None:
        """Drop cached copies of disk slots that are being freed (their next content is another page)."""
        self._collect(set(slots.tolist()))   # no read may land after its slot was reused
        drop = [self._where.pop(s) for s in slots.tolist() if s in self._where]
        if drop:
            self.pool.free(np.array(drop, dtype=np.int64))

    def clear(self) -> None:
        """Drop every cached page (reads under way are let finish and dropped too)."""
        self.forget(np.array(list(self._where) + list(self._pending), dtype=np.int64))

    def pages(self) -> int:
        return len(self._where)

    def nbytes(self) -> int:
        return self.pool.nbytes()

    def close(self) -> None:
        for fut, _ in list(self._pending.values()):
            fut.cancel()
            try:
                fut.result()
            except (Exception, CancelledError):  # the store is closing: nothing is left to read into
                pass
        self._pending.clear()
        self._where.clear()
        self.pool.close()
