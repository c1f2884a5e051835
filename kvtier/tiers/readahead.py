"""Disk pages read ahead of need into a small ring of host memory.

A decode step short-lists more pages than it takes, and the pages it did not take are the likeliest to be
wanted next. Those on disk are read ahead on the disk store's I/O threads while the model computes, straight
into a ring of page slots in host memory (counted in the host budget), and served once their read has
finished and been verified; newer reads take the place of the oldest pages. Pages recalled on demand are not
kept here: the recall buffer already holds what a step took, and a page cached on demand would push out a
page read ahead before its use.

Reading ahead costs the decoding thread a little every step (choosing the pages, queueing the reads), and the
reads' own work on the I/O threads competes with the model's for the CPU and the interpreter; it pays only
where a read on demand is slow. Where the disk answers from the operating system's page cache, a demand read
costs about what a hit does, and reading ahead is a loss. So the ring measures both sides over a window of
steps (the decoding thread's time spent on it and the I/O threads' CPU time for its reads; the hits times what
a demand read of a page costs more than a hit) and pauses reading ahead for a while when it did not pay, then
tries again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import CorruptPageError
from .base import slot_numbers
from .slabs import SlabRows

COUNTS = ("hits", "misses", "pages_read_ahead", "steps_paused")   # what `DiskReadAhead.counts` counts


@dataclass
class _Read:
    """A read ahead under way: disk `slots` into ring positions ``first .. first + len(slots)``; `cpu` gets the
    I/O thread's CPU seconds for it."""
    slots: np.ndarray
    first: int
    future: Future
    cpu: list = field(default_factory=list)

    def overlaps(self, a: int, b: int) -> bool:
        return self.first < b and a < self.first + len(self.slots)


@dataclass
class _Payoff:
    """What reading ahead cost and saved over the current window of steps."""
    steps: int = 0
    spent: float = 0.0          # seconds spent choosing, queueing (decoding thread) and reading (I/O thread)
    read: int = 0               # pages read ahead
    hits: int = 0
    hit_seconds: float = 0.0    # serving those hits from the ring
    demand_pages: int = 0
    demand_seconds: float = 0.0  # reading pages on demand

    def pays(self, demand_cost: float) -> bool:
        """Whether the window's hits saved more than reading ahead cost (`demand_cost`: seconds a page read on
        demand takes, measured in this window or before)."""
        hit_cost = self.hit_seconds / self.hits if self.hits else 0.0
        return self.hits * max(0.0, demand_cost - hit_cost) >= self.spent


class DiskReadAhead:
    """Up to `capacity` disk pages (of one layer) read ahead into host memory; the oldest are replaced first.

    At most half of the ring is read ahead a step, so a page read ahead usually stays until the step after next
    (sooner where a read does not fit before the ring's end and starts again at its beginning). The ring is
    allocated at the first read ahead (pinned where `pin`) and released by `close`. Each `offer` is a step:
    every `WINDOW` steps reading ahead is judged (`_Payoff`), and where it did not pay (`adaptive`) paused for
    `PAUSE` steps, twice as long each time it fails again (up to `MAX_PAUSE`). Without `adaptive` it never
    pauses.
    """

    WINDOW, PAUSE, MAX_PAUSE = 8, 64, 1024

    def __init__(self, disk, capacity: int, page_size: int, head_dim: int, dtype: torch.dtype,
                 pin: bool, adaptive: bool = True) -> None:
        self.disk, self.capacity, self.adaptive = disk, max(0, int(capacity)), adaptive
        self.page_size, self.head_dim, self.dtype = page_size, head_dim, dtype
        self.k = SlabRows((page_size, head_dim), dtype, "cpu", max(1, self.capacity), pin)
        self.v = SlabRows((page_size, head_dim), dtype, "cpu", max(1, self.capacity), pin)
        self._where: dict[int, int] = {}                     # disk slot -> ring position, read and verified
        self._at = np.full(self.capacity, -1, dtype=np.int64)   # disk slot held or being read at each position
        self._reads: list[_Read] = []                        # reads under way, oldest first
        self._head = 0                                       # the next position a read ahead fills
        self.hits = self.misses = self.read_ahead = 0
        self.steps_paused = 0                                # steps whose reading ahead was skipped
        self._window, self._paused = _Payoff(), 0
        self._demand_cost: float | None = None               # seconds a page read on demand takes
        self._pause = self.PAUSE                             # the next pause, in steps

    def _collect(self, wait: Callable[[_Read], bool]) -> None:
        """Serve the reads ahead that have finished, and those `wait` names once they finish."""
        left = []
        for read in self._reads:
            if not read.future.done() and not wait(read):
                left.append(read)
                continue
            b = read.first + len(read.slots)
            try:
                read.future.result()
                self._window.spent += sum(read.cpu)   # the I/O thread's work competes with the model's
            except (Exception, CancelledError):   # a failed read ahead is retried by the demand read, which raises
                self._at[read.first:b] = -1
                continue
            self._where.update(zip(read.slots.tolist(), range(read.first, b)))
        self._reads = left

    def _wait_for(self, slots: np.ndarray) -> None:
        """Finish the reads ahead that hold any of `slots`."""
        wanted = set(slots.tolist())
        self._collect(lambda read: not wanted.isdisjoint(read.slots.tolist()))

    def load(self, slots: np.ndarray, out: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pages at disk `slots` ``[n]``, in their order: from the ring where read ahead, else from the disk
        (`DiskStore.load`, which raises on a bad page). Into `out` when given: host memory of the pages' shape
        and dtype (e.g. the rows attention reads)."""
        slots = slot_numbers(slots, f"slots of {self.disk.path}", CorruptPageError)
        n = len(slots)
        want = (n, self.page_size, self.head_dim)
        if out is not None and (len(out) != 2 or any(tuple(t.shape) != want or t.dtype != self.dtype
                                                      or t.device.type != "cpu" for t in out)):
            raise ValueError(f"out must be two {self.dtype} tensors {list(want)} in host memory; got "
                             f"{[(tuple(t.shape), t.dtype, t.device.type) for t in out]}")
        self._wait_for(slots)
        where = self._where
        pos = np.fromiter((where.get(s, -1) for s in slots.tolist()), dtype=np.int64, count=n)
        hit = pos >= 0
        n_hit = int(hit.sum())
        if out is None:
            k = torch.empty(n, self.page_size, self.head_dim, dtype=self.dtype)
            out = (k, torch.empty_like(k))
        w, t0 = self._window, time.perf_counter()
        if n_hit == n:
            self.k.gather(torch.from_numpy(pos), out=out[0], pair=(self.v, out[1]))
        elif n_hit:
            held = torch.from_numpy(pos[hit])
            rows = torch.from_numpy(np.flatnonzero(hit))
            out[0][rows], out[1][rows] = self.k.gather(held), self.v.gather(held)
        t1 = time.perf_counter()
        if n_hit < n:
            if n_hit:   # straight into the rows the ring did not fill
                miss = np.flatnonzero(~hit)
                self.disk.load(slots[miss], out=out, rows=miss)
            else:
                self.disk.load(slots, out=out)
            w.demand_pages += n - n_hit
            w.demand_seconds += time.perf_counter() - t1
        w.hits += n_hit
        w.hit_seconds += t1 - t0
        self.hits += n_hit   # counted once the pages are read, as the pages recalled are
        self.misses += n - n_hit
        return out

    def counts(self) -> dict[str, int]:
        """What the ring did, by the names `stats()["read_ahead"]` gives them (`COUNTS`)."""
        return dict(zip(COUNTS, (self.hits, self.misses, self.read_ahead, self.steps_paused)))

    def offer(self, candidates: Callable[[], np.ndarray]) -> None:
        """A step's chance to read ahead: the disk slots `candidates()` gives (best first), unless reading ahead
        is paused because it did not pay (then `candidates` is not called)."""
        if self.capacity == 0:
            return
        if self._paused:
            self._paused -= 1
            self.steps_paused += 1
            if not self._paused:
                # the pause's demand reads tell what a page costs without reading ahead; the next window judges
                self._note_demand_cost()
                self._window = _Payoff()
            return
        t0 = time.perf_counter()
        self.prefetch(candidates())
        w = self._window
        w.spent += time.perf_counter() - t0
        w.steps += 1
        if w.steps < self.WINDOW:
            return
        self._note_demand_cost()
        if not w.read and not w.hits or self._demand_cost is None:
            pass   # nothing to judge: nothing was on disk to read ahead, or no demand read was timed yet
        elif not self.adaptive or w.pays(self._demand_cost):
            self._pause = self.PAUSE
        else:
            self._paused, self._pause = self._pause, min(2 * self._pause, self.MAX_PAUSE)
        self._window = _Payoff()

    def _note_demand_cost(self) -> None:
        w = self._window
        if w.demand_pages:
            self._demand_cost = w.demand_seconds / w.demand_pages

    def prefetch(self, slots: np.ndarray) -> None:
        """Start reading pages at disk `slots` (best first) that are neither held nor on their way."""
        slots = slot_numbers(slots, f"slots of {self.disk.path}", CorruptPageError)
        first = np.unique(slots, return_index=True)[1]
        slots = slots[np.sort(first)]
        slots = slots[~np.isin(slots, self._at)]
        self._collect(lambda read: False)
        under_way = sum(len(r.slots) for r in self._reads)
        n = min(len(slots), self.capacity // 2 - under_way)
        if n <= 0:
            return
        if self._head + n > self.capacity:   # runs do not wrap: the tail's pages stay until the next lap
            self._head = 0
        a, b = self._head, self._head + n
        self._collect(lambda read: read.overlaps(a, b))   # a read into these positions lands first
        self.k.ensure(self.capacity)
        self.v.ensure(self.capacity)
        for s in self._at[a:b].tolist():   # their pages give way
            if s >= 0:
                self._where.pop(s, None)
        self._at[a:b] = -1
        cpu: list = []
        future = self.disk.load_async(slots[:n], out=(self.k.slabs[0][a:b], self.v.slabs[0][a:b]), cpu=cpu)
        self._at[a:b] = slots[:n]   # once the read is queued (a failure to queue it leaves these positions free)
        self._reads.append(_Read(slots[:n], a, future, cpu))
        self._head = b
        self.read_ahead += n
        self._window.read += n

    def settle(self) -> None:
        """Wait for the reads under way (a benchmark's step boundary: their time is the step's)."""
        self._collect(lambda read: True)

    def forget(self, slots: np.ndarray) -> None:
        """Drop the pages of disk slots that are being freed (their next content is another page)."""
        slots = slot_numbers(slots, f"slots of {self.disk.path}", CorruptPageError)
        self._wait_for(slots)   # no read may land after its slot was reused
        for s in slots.tolist():
            p = self._where.pop(s, None)
            if p is not None:
                self._at[p] = -1

    def clear(self) -> None:
        """Drop every page (reads under way are let finish and dropped too)."""
        self._collect(lambda read: True)
        self._where.clear()
        self._at[:] = -1
        self._head = 0

    def pages(self) -> int:
        return len(self._where)

    def nbytes(self) -> int:
        """Bytes of the pages held (a page's keys and values: the disk store's payload)."""
        return self.pages() * self.disk.payload_size

    def reserved_bytes(self) -> int:
        """Bytes of the ring (none before the first read ahead)."""
        return self.k.nbytes() + self.v.nbytes()

    def close(self) -> None:
        """Wait for the reads under way (they write into the ring), then let the ring go."""
        self.clear()
        self.k.close()
        self.v.close()
