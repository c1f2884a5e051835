"""The host tier: pages of demoted entries in host memory (pinned on CUDA machines), in fixed-size slabs.

A page is ``page_size`` entries of one KV head, keys and values each contiguous, so a recall moves whole
blocks. Slots are shared by all heads of a layer, handed out from the freed ones, then from the never used ones
in order; the pool grows a slab at a time (about `slab_bytes` each) and never copies what it holds.

`load` into device memory lets a kernel read pinned pages through their mapping, after the call returns
(in stream order); the pool then waits for those reads before it overwrites a slot or lets its slabs go.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import check_whole
from ..transfer.read_mark import ReadMark
from .base import slot_numbers
from .slabs import SlabRows

SLAB_BYTES = 4 << 20
COMPACT_BATCH = 1024   # pages `compact` moves at a time


@dataclass
class FilledSlabs:
    """Pages in slabs made apart from any pool (`HostPool.new_slabs`), rows ``0 .. count - 1``: filled off the
    step's path (a thread reading a parked layer back ahead), then taken whole by an empty pool (`HostPool.adopt`)."""

    k: SlabRows
    v: SlabRows
    count: int

    def nbytes(self) -> int:
        return self.k.nbytes() + self.v.nbytes()

    def pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages ``[count, page_size, head_dim]`` (a copy)."""
        rows = torch.arange(self.count)
        return self.k.gather(rows), self.v.gather(rows)


class HostPool:
    """Host-memory page slots (the `Tier` protocol).

    Shapes: a page is ``[page_size, head_dim]`` keys plus as many values.
    """

    name = "host"

    def __init__(self, page_size: int, head_dim: int, dtype: torch.dtype, pin: bool,
                 slab_bytes: int = SLAB_BYTES) -> None:
        for name, size in (("page_size", page_size), ("head_dim", head_dim), ("slab_bytes", slab_bytes)):
            check_whole(name, size, 1)
        self.page_size, self.head_dim, self.dtype, self.pin = page_size, head_dim, dtype, pin
        page_bytes = page_size * head_dim * torch.empty((), dtype=dtype).element_size()
        per_slab = max(1, slab_bytes // page_bytes)
        self.k = SlabRows((page_size, head_dim), dtype, "cpu", per_slab, pin)
        self.v = SlabRows((page_size, head_dim), dtype, "cpu", per_slab, pin)
        self._free: list[int] = []      # slots freed for reuse, a stack: the lowest on top
        self._held = np.zeros(0, dtype=bool)   # whether each slot below `_next` holds a page
        self._next = 0                  # slots from here on were never handed out (or all freed by `clear`)
        self._used = 0
        self._reads = ReadMark()   # the end of the last device read of the slabs
        self._written = 0    # slots from here on have never held a page (so no device read of them is queued)
        self._released = False   # the slabs were let go by `release`

    def _take(self, n: int) -> np.ndarray:
        """`n` slots: freed ones first, lowest first, then never used ones in order (a range: a demotion's batch of
        thousands of pages costs no Python loop, and its copies down run over consecutive slots)."""
        reuse = min(n, len(self._free))
        fresh = n - reuse
        if fresh:
            self.k.ensure(self._next + fresh)
            self.v.ensure(self.k.capacity)
        slots = np.empty(n, dtype=np.int64)
        if reuse:   # the top of the stack, as popping them one by one would hand them out
            slots[:reuse] = self._free[len(self._free) - reuse:][::-1]
            del self._free[len(self._free) - reuse:]
        slots[reuse:] = np.arange(self._next, self._next + fresh)
        self._next += fresh
        if len(self._held) < self._next:
            self._held = np.concatenate([self._held, np.zeros(max(self._next, 2 * len(self._held)) - len(self._held),
                                                              dtype=bool)])
        self._held[slots] = True
        self._used += n
        return slots

    def _settle(self) -> None:
        """Wait until device reads of the slabs queued by `load` are done (before the host writes them)."""
        self._reads.synchronize()

    def store(self, k: torch.Tensor, v: torch.Tensor) -> np.ndarray:
        """Keep pages ``k, v`` ``[n, page_size, head_dim]``; returns their slots. All or nothing: a failure
        (a wrong shape, no memory for a slab) leaves the pool as it was."""
        shape = (self.page_size, self.head_dim)
        if k.dim() != 3 or tuple(k.shape[1:]) != shape or k.shape != v.shape:
            raise ValueError(f"the host pool keeps pages [n, {shape[0]}, {shape[1]}]; got k {tuple(k.shape)}, "
                             f"v {tuple(v.shape)}")
        self._settle()
        # never used slots, in order (no freed one to reuse): a range, copied slab by slab from host memory (a copy
        # from a device would be asynchronous there)
        fresh = not self._free and k.device.type == "cpu" and v.device.type == "cpu"
        slots = self._take(k.shape[0])
        try:
            if len(slots):
                self._written = max(self._written, int(slots.max()) + 1)
            if fresh and len(slots):
                self.k.write_range(int(slots[0]), k.to(self.dtype))
                self.v.write_range(int(slots[0]), v.to(self.dtype))
            else:
                rows = torch.from_numpy(slots)
                self.k.scatter(rows, k)
                self.v.scatter(rows, v)
        except BaseException:
            self.free(slots)
            raise
        return slots

    def reserve(self, n: int) -> np.ndarray:
        """`n` free slots for pages that `write_from` will fill (give them back with `free` if that fails)."""
        return self._take(n)

    def write_from(self, slots: np.ndarray, k: torch.Tensor, v: torch.Tensor, transfer, jobs: list[int]) -> None:
        """Start copying pages ``k, v`` ``[n, page_size, head_dim]`` (on the device) into `slots` through
        `transfer`, straight into the slabs; the job ids join `jobs`. A slot used before (freed, then handed
        out again) may still be read by the device: copies into such slots are ordered after the reads queued
        so far, on the device. Slots never used before need no wait (a decoding layer's usual case)."""
        if not len(slots):
            return
        if self._reads.pending and int(np.min(slots)) < self._written:
            self._reads.order_before(torch.cuda.current_stream(self._reads.device))
        self._written = max(self._written, int(np.max(slots)) + 1)
        self.k.write_from(slots, k, transfer, jobs)
        self.v.write_from(slots, v, transfer, jobs)

    def load(self, slots: np.ndarray,
             out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather pages ``[n, page_size, head_dim]`` (into `out` when given: pinned staging, or device memory
        that a kernel fills straight from the pinned slabs)."""
        rows = torch.from_numpy(self._held_slots(slots))
        if out is None:
            return self.k.gather(rows), self.v.gather(rows)
        self.k.gather(rows, out=out[0], pair=(self.v, out[1]))   # keys and values in one launch
        self.read_on(out[0].device)
        return out

    def _held_slots(self, slots, twice: bool = False) -> np.ndarray:
        """`slots` as contiguous int64, each holding a page (with `twice`, sorted `slots` none of which is given
        twice); else a `ValueError` naming the first that does not (a freed slot's stale page is no answer)."""
        s = np.ascontiguousarray(slot_numbers(slots, "host slots"))
        inside = (s >= 0) & (s < self._next)
        bad = ~inside
        if twice and len(s):
            bad |= np.concatenate([[False], s[1:] == s[:-1]])
        bad[inside] |= ~self._held[s[inside]]
        if bad.any():
            raise ValueError(f"host slot {int(s[bad][0])} holds no page (freed already, never handed out"
                             f"{', or given twice' if twice else ''}); nothing was {'freed' if twice else 'read'}")
        return s

    def read_on(self, device: torch.device) -> None:
        """Note that kernels queued on `device`'s current stream read the slabs: `store` waits for them."""
        if self.pin:
            self._reads.note(device)

    def free(self, slots: np.ndarray) -> None:
        """Give slots back; a slot that holds no page (freed already, never handed out, given twice) is refused
        before anything changes: two pages would share it."""
        s = np.sort(slot_numbers(slots, "host slots"))
        if not len(s):
            return
        self._held_slots(s, twice=True)
        # the last slots handed out go back to the never-used range (a failed demotion's, given back at once,
        # leaves the pool as it was); the others onto the stack, the lowest on top
        back = s[::-1] == np.arange(self._next - 1, self._next - 1 - len(s), -1)
        n = len(s) if back.all() else int(np.argmin(back))
        stacked = s[:len(s) - n][::-1].tolist()
        used, next_, free = self._used, self._next, len(self._free)
        try:   # an interruption between these leaves the pool as it was
            self._held[s] = False
            self._used = used - len(s)
            self._next = next_ - n
            self._free.extend(stacked)
        except BaseException:
            self._held[s] = True
            self._used, self._next = used, next_
            del self._free[free:]
            raise

    def _slabs_needed(self) -> int:
        """Slabs for the pages held and half a slab more (so that the pages a demotion adds before the next
        spill to disk fit without a new slab); one at least (a layer's steps read the first)."""
        per = self.k.rows_per_slab
        return max(1, -(-(self._used + per // 2) // per))

    def spare_slabs(self) -> int:
        """Slabs more than `compact` would keep."""
        return max(0, len(self.k.slabs) - self._slabs_needed())

    def compact(self) -> tuple[np.ndarray, np.ndarray]:
        """Move the pages held past the slabs the pool needs into the lowest free slots below, and let the slabs
        emptied go (the device's reads of them are waited for first). Returns the moved pages' old and new
        slots, for the caller's page table. The pages are copied before anything else changes: a copy that
        fails (no memory for it) leaves the pool as it was."""
        per = self.k.rows_per_slab
        keep = self._slabs_needed()
        none = np.empty(0, dtype=np.int64)
        if len(self.k.slabs) <= keep:
            return none, none
        self._settle()
        cut = keep * per
        held = np.flatnonzero(self._held[:self._next])
        old = held[held >= cut]
        new = np.flatnonzero(~self._held[:cut])[:len(old)]
        # the bookkeeping after the move, worked out first (what may fail, an allocation, before anything changes)
        after = self._held[:cut].copy()
        after[new] = True
        now = np.flatnonzero(after)
        next_slot = int(now[-1]) + 1 if len(now) else 0
        free = np.flatnonzero(~after[:next_slot])[::-1].tolist()   # a stack, the lowest on top
        for a in range(0, len(old), COMPACT_BATCH):   # a batch at a time: the copy's memory stays bounded
            src = torch.from_numpy(old[a:a + COMPACT_BATCH])
            rows = torch.from_numpy(new[a:a + COMPACT_BATCH])
            self.k.scatter(rows, self.k.gather(src))   # into free slots: a failure leaves every page where it was
            self.v.scatter(rows, self.v.gather(src))
        self._held[:cut] = after
        self._held[cut:] = False
        self._next, self._free = next_slot, free
        self._written = min(self._written, cut)   # slots past it will lie in new slabs, never read
        self.k.shrink(keep)
        self.v.shrink(keep)
        return old, new

    def new_slabs(self, n: int) -> FilledSlabs:
        """Slabs for `n` pages laid out as this pool's (pinned as its are), apart from it: the pool does not change,
        so another thread may fill them (rows ``0 .. n - 1``) while the pool's layer is parked."""
        k = SlabRows(self.k.row_shape, self.dtype, "cpu", self.k.rows_per_slab, self.pin)
        v = SlabRows(self.v.row_shape, self.dtype, "cpu", self.v.rows_per_slab, self.pin)
        k.ensure(max(1, n))
        v.ensure(k.capacity)
        return FilledSlabs(k, v, n)

    def adopt(self, filled: FilledSlabs) -> np.ndarray:
        """Keep the pages of `filled` (`new_slabs`, filled since); returns their slots. An empty pool takes the
        slabs themselves, so nothing is copied: the pages hold slots ``0 .. n - 1`` and the pool the slabs `store`
        would have grown, as `store` would have left them. A pool holding pages stores copies of them (`store`)."""
        n = filled.count
        if self._used or self._next or filled.k.rows_per_slab != self.k.rows_per_slab:
            return self.store(*filled.pages())
        held = np.ones(n, dtype=bool)
        slots = np.arange(n, dtype=np.int64)
        self._settle()   # device reads of the slabs let go
        self.k.adopt(filled.k)
        self.v.adopt(filled.v)
        self._held, self._free, self._next, self._used, self._written = held, [], n, n, n
        self._released = False
        return slots

    def pages(self) -> int:
        return self._used

    def nbytes(self) -> int:
        """Bytes of the pages held."""
        return self._used * self.page_bytes()

    def page_bytes(self) -> int:
        return 2 * self.page_size * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def reserved_bytes(self) -> int:
        return self.k.nbytes() + self.v.nbytes()

    def clear(self) -> None:
        """Forget every page (the slabs stay for reuse)."""
        self._settle()
        self._free, self._next, self._used = [], 0, 0
        self._held[:] = False

    def release(self) -> None:
        """Let the slabs go while no page is held (a layer parked on disk); `reopen` takes one back."""
        if not self._used:
            self._released = self._released or bool(self.k.slabs)
            self.close()

    def reopen(self) -> None:
        """After `release`, a slab again, as the pool had (the layer is back: its steps' work reads the first slab
        whether or not a page is on the host)."""
        if self._released:
            self._released = False
            self.k.ensure(1)
            self.v.ensure(self.k.capacity)

    def close(self) -> None:
        self._settle()
        self.k.close()
        self.v.close()
        self._free, self._next, self._used, self._written = [], 0, 0, 0
        self._held = np.zeros(0, dtype=bool)
