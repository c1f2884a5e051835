"""Bringing chosen pages up to the device: what a layer's recall does once the pages are picked.

Pages the recall buffer already holds stay; the others are gathered from the host slabs and the disk store
(through the read-ahead cache) into staging and copied up; short-listed disk pages that were not taken are
read ahead for the next step. Part of `LayerEngine`, kept apart so the life of a step reads on its own.

Where recall is planned on the device, the buffer has spare slots and a step ends by prefetching: the pages
ranked right after its choice (the likeliest to be chosen next, as the query moves slowly) are copied into
the spare slots on a side stream, overlapping the other layers' compute; the next step waits for that copy on
the device, finds most of its choice already there and fetches only the rest on demand.

A layer with pages on disk plans on the device too, with one read back a step (disk reads are the host's):
its choice, the buffer's table and the short list come back, the chosen disk pages the buffer lacks are read
(through the read-ahead ring) into pinned memory (`_read_disk_pages`), the same plan and copy bring the host
pages up, and the disk pages follow into the slots the plan gave them (`_scatter_disk_pages`). Its prefetch
takes the next-ranked host pages only (the plan skips pages without a host slot); the read-ahead ring reads the
short-listed disk pages ahead instead.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

import numpy as np
import torch

from ..errors import CapacityError
from ..placement import plan_promotion
from ..placement.page_table import DISK, HOST
from .. import native
from ..recall.buffer import BufferLayout, RecallBuffer
from ..native import RecallPlan
from ..recall.device_plan import plan_on_device
from .graphs import StepKey, shapes


COOL_EVERY = 32      # recalls of a layer that bring pages up (from the host's view) between halvings of use counts
PROMOTE_EVERY = 4    # such recalls between rounds that keep disk pages on the host


class _Landing(NamedTuple):
    """What a device-planned step on a layer with disk pages read back and read from disk (`_read_disk_pages`)."""

    heads: np.ndarray          # the chosen pages the buffer lacked: the host's by slot, then the disk's by slot
    pids: np.ndarray
    cols: np.ndarray           # where each stands in its head's choice
    first: int                 # where the disk pages begin among them
    kv: torch.Tensor | None    # [2, pages, ...]: the disk pages' keys and values as read, in host memory (None: none)
    want: torch.Tensor         # the step's choice and short list, read back (for the read-ahead ring)
    shortlist: torch.Tensor


class PageFetching:
    """The fetch half of a `LayerEngine` (uses its table, tiers, recall buffer, transfers and counters)."""

    def _fetch(self, ids: torch.Tensor, shortlist: torch.Tensor,
               ahead: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | np.ndarray]:
        """Pages ``ids`` ``[heads, r]`` on the device: ``[heads, r * page_size, dim]`` keys and values, and the
        page id of each of their pages ``[heads, r]`` (the order attention reads them in). From a buffer that
        keeps pages no longer chosen (`RecallBuffer` `retain`), the whole buffer, whose `mask` hides the others.

        Pages the recall buffer already holds stay; only the others are brought up. `shortlist` ranks the
        candidates, best first; with `ahead` (the step's last query block) the next-ranked ones are prefetched.
        (A decode step whose attention reads the pages where the buffer holds them goes through
        `kvtier.engine.device_step` instead.)
        """
        H, r = ids.shape
        on_device = self.recalls_on_device()
        buf = self._recall_buffer(r, on_device)
        if on_device:
            return self._fetch_on_device(buf, ids, shortlist, ahead)
        want = ids.cpu().numpy()
        ages = buf.ages()
        heads, pids, slots = buf.plan(want)
        if len(pids):
            try:
                came = self._bring_into(buf, heads, pids, slots)
            except BaseException:   # a disk read failed, say: the step may be tried again as if never planned
                buf.restore_ages(ages)
                raise
            self._keep_on_host(*came)
        self._read_ahead(ids, shortlist)
        self.counters.pages_reused += H * r - len(pids)   # counted once the step has its pages
        self.counters.recall_steps += 1
        return buf.k, buf.v, buf.ids

    def _recall_buffer(self, r: int, on_device: bool) -> RecallBuffer:
        """The recall buffer for `r` chosen pages per KV head (and the prefetch's spare slots where recall is
        planned `on_device`; on the CPU, the slots that keep pages no longer chosen while there are such pages),
        made anew when its width or kind changes. Spare slots of either kind only while some pages go unchosen:
        a step that chooses every page (fewer pages than `recall_pages`) has nothing to prefetch or keep."""
        unchosen = self.index.n > r
        retain = self.cfg.retain(on_device) if self.device.type == "cpu" and unchosen else 0
        width = r + (self.cfg.prefetch(on_device) if unchosen else 0) + retain
        buf = self.recalled
        if buf is None or buf.pages != width or buf.on_device != on_device or buf.retain != retain:
            self._drop_recalled()
            buf = RecallBuffer(self.heads, width, self.cfg.page_size, self.head_dim, self.dtype, self.device,
                               on_device=on_device, retain=retain)
            layout, self.layout_kept = self.layout_kept, None
            if layout is not None and buf.fits(layout):   # after a park or a copy: the same pages in the same slots
                self._refill(buf, layout)
            self.recalled = buf
        return buf

    def recall_layout(self) -> BufferLayout | None:
        """The recall buffer's layout (`RecallBuffer.layout`: a buffer planned on the device reads its table back,
        after the prefetch into it), or the one kept for the next buffer."""
        if self.recalled is None:
            return self.layout_kept
        self._await_prefetch()
        return self.recalled.layout()

    def _refill(self, buf: RecallBuffer, layout: BufferLayout) -> None:
        """Bring `layout`'s pages up into its slots of the new buffer `buf`, and give `buf` its bookkeeping. The
        bytes count as moved; the pages not as recalled (no step chose them: the buffer is as it was before)."""
        self._bring_into(buf, *layout.filled(), recall=False)
        buf.adopt(layout)

    def _bring_into(self, buf: RecallBuffer, heads: np.ndarray, pids: np.ndarray,
                    slots: np.ndarray, recall: bool = True) -> tuple[np.ndarray, np.ndarray, tuple | None]:
        """Pages ``(heads[i], pids[i])`` brought up (`_bring_up`) into `buf`'s ``slots[i]``; returns the heads and
        page ids in the order they came, and `_bring_up`'s ``from_disk``."""
        order, k, v, from_disk = self._bring_up(heads, pids, recall)
        heads, pids = heads[order], pids[order]
        buf.fill(heads, pids, slots[order], k, v)
        return heads, pids, from_disk

    def recalls_on_device(self) -> bool:
        """Whether this layer's recall is planned and copied on the device: on CUDA (or when `device_recall`
        forces it). With no round-trip to the host while every demoted page is in host memory; with pages on
        disk, a step reads its choice back once (`holds_disk_pages`)."""
        wanted = self.device_recall if self.device_recall is not None else self.device.type == "cuda"
        return bool(wanted) and self.host is not None

    def holds_disk_pages(self) -> bool:
        """Whether any of this layer's demoted pages is on disk now: a device-planned step then reads its choice
        back (`_read_disk_pages`), so its launches are not replayed from a graph. Known per table version."""
        if self.disk is None or not self.table.n:
            return False
        version, held = self._disk_mark
        if version != self.table.version:
            held = self.table.pages(DISK) > 0
            self._disk_mark = (self.table.version, held)
        return held

    def _await_prefetch(self) -> None:
        """Order the current stream after the prefetch queued into the recall buffer, if any (on the device: the
        host does not wait); it writes the buffer's slots and counts into `device_counts`."""
        buf = self.recalled
        if buf is not None and buf.pending is not None:
            self.transfer.wait([buf.pending])
            buf.pending = None

    def _drop_recalled(self) -> None:
        """Let the recall buffer go, once the device has done the prefetch into it (if one is queued)."""
        self._await_prefetch()
        self._forget_recalled()

    def _forget_recalled(self) -> None:
        """Let the recall buffer go at once (a failed step: the next starts a new one), and the captured steps
        that read it (the layer's, and a whole model's step: `SharedResources.step_graphs`)."""
        self.recalled = None
        for graphs in (self.graphs, self.prefetch_graphs, *self.shared.step_graphs):
            if graphs is not None:
                graphs.clear()

    def _fetch_on_device(self, buf: RecallBuffer, ids: torch.Tensor, shortlist: torch.Tensor,
                         ahead: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Plan and copy the missing pages of ``ids`` ``[heads, r]`` into `buf` on the device; then, with
        `ahead` and spare slots, prefetch the pages `shortlist` ranks next (see `_fetch`)."""
        H, r = ids.shape
        R = buf.pages
        self._await_prefetch()
        sources = self._sources()
        spare = R > r
        try:
            plan = self._plan_and_copy(buf, ids, sources, spare, shortlist=shortlist)
        except BaseException:   # the table may name pages whose copy never ran: the next step starts a new buffer
            self._forget_recalled()
            raise
        self.counters.recall_steps += 1
        if not spare:   # the buffer holds exactly the chosen pages
            got = (buf.k, buf.v, plan.held_after)
        else:
            got = (*buf.chosen(plan.where), ids)
        if spare and ahead and shortlist.shape[1] > r:   # else nothing is ranked after the choice
            # the sources as the table is now: with disk pages, the step's promotion round may have moved some
            self._prefetch(buf, shortlist[:, :R], self._sources())
        return got

    def _plan_and_copy(self, buf: RecallBuffer, ids: torch.Tensor,
                       sources: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None], spare: bool,
                       note: bool = True, prefetch: bool = False,
                       shortlist: torch.Tensor | None = None) -> RecallPlan:
        """A step's recall of ``ids`` on the device: the plan (which also keeps the prefetch flags and the
        counters `stats()` reads, on the device, and writes the buffer's page table in place), then the copy
        of the missing pages into their slots (`note`: as for `_copy_up`). With `prefetch`, ``ids`` are the
        step's choice and the pages ranked after it, brought up ahead of the next step (see `_prefetch`).
        Where the layer has pages on disk, the chosen ones are read first (`_read_disk_pages`; the step's
        `shortlist` goes to the read-ahead ring) and copied into their slots after the host pages'
        (`_scatter_disk_pages`), and the step then counts and keeps what it read as the host-planned recall
        does. A failure after the plan leaves the buffer's table naming pages never copied: the callers then
        let the buffer go (`_forget_recalled`)."""
        landing = None
        if not prefetch and self.holds_disk_pages():
            landing = self._read_disk_pages(buf, ids, shortlist)
        # such a step (never captured, it reads back already) counts only once its copies are made: a failure
        # (a host slot's page not stored, say) takes back what the plan counted
        counted = None if landing is None or self.device_counts is None else self.device_counts.clone()
        try:
            plan = plan_on_device(ids, buf.held, self.table.n, sources[0], buf.ahead if spare else None,
                                  self.device_counts, prefetch=prefetch, in_place=True)
            # a page without a host slot is skipped: it comes next. A step that read disk pages notes the copy's
            # read of the host slabs at once: the promotion round below may store pages into host slots the copy
            # still reads, and `HostPool.store` waits only for the reads noted
            self._copy_up(buf, sources, plan, note or landing is not None)
            if landing is not None and landing.kv is not None:
                self._scatter_disk_pages(buf, plan, landing)
        except BaseException:
            if counted is not None:
                self.device_counts.copy_(counted)
            raise
        if landing is not None:
            self._landed_up(landing)
        return plan

    def _landed_up(self, landing: _Landing) -> None:
        """After a device-planned copy that read disk pages (`_read_disk_pages`): what the host-planned recall
        does after its own (`_fetch`): the disk pages counted (the device counts them among the pages it moved:
        `settle_counts` takes them out there), the pages' uses and promotion where pages came up, the read-ahead
        ring offered the short list."""
        if landing.kv is not None:
            m = len(landing.pids) - landing.first
            c = self.counters
            c.pages_recalled["disk"] += m
            c.bytes_moved["disk_to_device"] += m * self.host.page_bytes()
            self._landed += m
        if len(landing.pids):
            from_disk = None if landing.kv is None else (landing.first, landing.kv[0], landing.kv[1])
            self._keep_on_host(landing.heads, landing.pids, from_disk)
        self._read_ahead(landing.want, landing.shortlist)

    def _read_disk_pages(self, buf: RecallBuffer, ids: torch.Tensor, shortlist: torch.Tensor | None) -> _Landing:
        """Before a device-planned copy on a layer with pages on disk: the step's one read back (its choice,
        the buffer's table and its short list: the host must know which disk pages to read), then the chosen
        disk pages the buffer lacks read into pinned memory (through the read-ahead ring, in disk-slot order).
        Changes no table and no tier: the pages stay on disk."""
        H, r = ids.shape
        R = buf.pages
        parts = [ids, buf.held] if shortlist is None or shortlist is ids else [ids, buf.held, shortlist]
        back = torch.cat(parts, dim=1).cpu()   # the step's one wait for the device
        want = back[:, :r]
        listed = want if len(parts) == 2 else back[:, r + R:]
        chosen, held = want.numpy(), back[:, r:r + R].numpy()
        n = self.table.n   # head h's page p as h * (n + 1) + p; an empty slot then is h * (n + 1) - 1, no page
        step = np.arange(H, dtype=np.int64)[:, None] * (n + 1)
        lacking = ~np.isin(chosen + step, held + step)
        heads = np.broadcast_to(np.arange(H)[:, None], chosen.shape)[lacking]
        cols = np.broadcast_to(np.arange(r)[None, :], chosen.shape)[lacking]
        pids = chosen[lacking]
        tier, slot = self.table.lookup(heads, pids)
        order = np.lexsort((slot, tier))   # as `_bring_up` takes them: the host's by slot, then the disk's
        heads, cols, pids, tier, slot = heads[order], cols[order], pids[order], tier[order], slot[order]
        first = int(np.searchsorted(tier, DISK))
        m = len(pids) - first
        if m == 0:
            return _Landing(heads, pids, cols, first, None, want, listed)
        P, D = self.cfg.page_size, self.head_dim
        kv = torch.empty(2, m, P, D, dtype=self.dtype, pin_memory=self.pin)   # keys and values: one copy up
        self._load_disk(slot[first:], out=(kv[0], kv[1]))
        return _Landing(heads, pids, cols, first, kv, want, listed)

    def _scatter_disk_pages(self, buf: RecallBuffer, plan: RecallPlan, landing: _Landing) -> None:
        """The step's disk pages (`_read_disk_pages`) into the buffer slots the plan gave them (which its copy
        skipped: they have no host slot), after the copy in stream order: up from pinned memory without a wait."""
        H, R = buf.held.shape
        P, D = self.cfg.page_size, self.head_dim
        f, w = landing.first, plan.where.shape[1]
        heads = landing.heads[f:]
        at = torch.empty(2, len(heads), dtype=torch.int64, pin_memory=self.pin)
        at[0] = torch.from_numpy(heads * w + landing.cols[f:])   # each page's place in the plan's `where`
        at[1] = torch.from_numpy(heads * R)                      # its head's first buffer row
        at = at.to(self.device, non_blocking=True)
        rows = plan.where.reshape(-1).index_select(0, at[0]) + at[1]
        kv = landing.kv.to(self.device, non_blocking=True)
        buf.k.view(H * R, P, D).index_copy_(0, rows, kv[0])
        buf.v.view(H * R, P, D).index_copy_(0, rows, kv[1])

    def _sources(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """What a device-side copy up reads besides the plan: the host slot of every page and the key and value
        slabs' addresses (made on the current stream, before any side-stream work uses them)."""
        return self._host_slots(), self.host.k.addresses(self.device), self.host.v.addresses(self.device)

    def _copy_up(self, buf: RecallBuffer, sources: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
                 plan: RecallPlan, note: bool = True) -> None:
        """The plan's pages from the pinned host slabs into their buffer slots, on whichever stream is current
        (the `recall_pages` kernel reading the slabs through their mapping). Without `note` the caller notes
        the read of the host slabs (`HostPool.read_on`) after the work is queued (a CUDA graph's replay)."""
        H, R = buf.held.shape
        P, D = self.cfg.page_size, self.head_dim
        _, k_addresses, v_addresses = sources
        k, v = self.host.k, self.host.v   # keys and values in one launch
        native.recall_pages(k.slabs, k.rows_per_slab, plan.src_rows, plan.dst_rows, plan.count,
                            buf.k.view(H * R, P, D), k_addresses, pair=(v.slabs, buf.v.view(H * R, P, D), v_addresses))
        if note:
            self.host.read_on(self.device)

    def _prefetch(self, buf: RecallBuffer, target: torch.Tensor, sources: tuple,
                  recall_key: Callable[[], StepKey] | None = None) -> None:
        """Bring the pages of `target` ``[heads, w]`` (this step's choice and the pages ranked after it) into
        `buf` on the transfer manager's side stream; the next step's `_fetch_on_device` waits for it. `sources`
        are `_sources` of the table as it is now (the step's own where it moved no page; a step on a layer with
        disk pages makes them again after its promotion round), and `recall_key`, where given, says what
        `_recall_key` says of them and `buf` (the step's key computed it already)."""
        n, counts = self.table.n, self.device_counts
        if recall_key is None:
            recall_key = lambda: self._recall_key(buf, sources)   # noqa: E731

        def launches(want: torch.Tensor) -> tuple:
            plan = plan_on_device(want, buf.held, n, sources[0], buf.ahead, counts, prefetch=True, in_place=True)
            self._copy_up(buf, sources, plan, note=False)
            return ()

        def work() -> None:
            # launches only, so that a CUDA graph may replay them on the side stream (`prefetch_graphs`, a pool of
            # its own), `target` copied into the graph's input first: the replay then does not depend on where
            # the step's short list lies
            self.prefetch_graphs.run(lambda: self._prefetch_key(target, n, recall_key()), (target,), launches)
            self.host.read_on(self.device)

        uses = [target, buf.k, buf.v, buf.held, buf.ahead, counts, *(t for t in sources if t is not None)]
        try:
            buf.pending = self.transfer.run_ahead(work, uses)
        except BaseException:   # slots may hold pages `held` does not say: the next step starts a new buffer
            self._forget_recalled()
            raise

    def _prefetch_key(self, target: torch.Tensor, pages: int, recall_key: StepKey) -> StepKey:
        """Every tensor and scalar the prefetch's launches bake in (see `_prefetch`; `target` is copied in), with
        `recall_key` (`_recall_key` of its buffer and sources)."""
        return StepKey(recall_key.held, (shapes(target), pages, *recall_key.values))

    def _recall_key(self, buf: RecallBuffer, sources: tuple) -> StepKey:
        """What a plan and copy into `buf` bake in (a step's and a prefetch's alike): the buffer, the host slots'
        mirror and slabs' address tables (`sources`), the host slabs and the device counters."""
        host = self.host
        return StepKey((buf.k, buf.v, buf.held, buf.ahead, *sources, *host.k.slabs[:1], *host.v.slabs[:1],
                        self.device_counts), (len(sources), len(host.k.slabs)))

    def _host_slots(self) -> torch.Tensor:
        """``[heads, n]`` host slot of every page on the device (-1 elsewhere), rebuilt when the table changed."""
        mirror = self._slot_mirror
        if mirror is None or mirror[0] != self.table.version:
            slots = np.where(self.table.tier == HOST, self.table.slot, -1)
            t = torch.from_numpy(np.ascontiguousarray(slots))
            if self.device.type == "cuda":
                t = t.pin_memory()
            mirror = self._slot_mirror = (self.table.version, t.to(self.device, non_blocking=True))
        return mirror[1]

    def _bring_up(self, heads: np.ndarray, pids: np.ndarray, recall: bool = True
                  ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, tuple | None]:
        """Pages ``(heads[i], pids[i])`` from the host and disk tiers to the device (counted as recalled with
        `recall`; their bytes as moved either way).

        Returns ``(order, k, v, from_disk)``: the pages come in the order ``order`` of the request (by tier and
        slot, so gathers run over the same slab; on CUDA, with every page in host memory, as asked: one kernel
        reads them wherever they lie, and sorting thousands of pages would cost the host more than the copy),
        ``[n, page_size, dim]`` each; ``from_disk`` is None, or ``(first, k, v)``: the pages from ``first`` on
        (in that order) came from disk, and ``k, v`` are those pages as read, in host memory.
        """
        P, D = self.cfg.page_size, self.head_dim
        tier, slot = self.table.lookup(heads, pids)
        if self.device.type == "cuda" and not (tier == DISK).any():
            order = np.arange(len(pids))
        else:
            order = np.lexsort((slot, tier))
            tier, slot = tier[order], slot[order]
        on_host, on_disk = np.flatnonzero(tier == HOST), np.flatnonzero(tier == DISK)
        a = len(on_host)   # with disk pages, sorted by tier: the host's pages, then the disk's
        from_disk = None
        if self.device.type == "cuda":
            k_dev, v_dev, staged = self._bring_up_cuda(slot, on_host, on_disk)
            if staged is not None:
                from_disk = (a, *staged)
        else:   # host memory is the device's: gather and read straight into the pages attention reads
            k_dev = torch.empty(len(pids), P, D, dtype=self.dtype)
            v_dev = torch.empty_like(k_dev)
            if a:
                self.host.load(slot[:a], out=(k_dev[:a], v_dev[:a]))
            if len(on_disk):
                self._load_disk(slot[a:], out=(k_dev[a:], v_dev[a:]))
                from_disk = (a, k_dev[a:], v_dev[a:])
        page_bytes = self.host.page_bytes()
        c = self.counters
        c.bytes_moved["host_to_device"] += len(on_host) * page_bytes
        c.bytes_moved["disk_to_device"] += len(on_disk) * page_bytes
        if recall:
            c.pages_recalled["host"] += len(on_host)
            c.pages_recalled["disk"] += len(on_disk)
        return order, k_dev, v_dev, from_disk

    def _bring_up_cuda(self, slot: np.ndarray, on_host: np.ndarray,
                       on_disk: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
        """Host pages are read by the GPU from the pinned slabs straight into device memory (the gather kernel
        through the slabs' device mapping; no staging, no second copy); disk pages come through pinned
        staging and one copy per tensor on the transfer stream. Returns the pages, and the disk pages' staging
        (``(k, v)``, or None without disk pages)."""
        P, D = self.cfg.page_size, self.head_dim
        n = len(slot)
        k_dev = torch.empty(n, P, D, dtype=self.dtype, device=self.device)
        v_dev = torch.empty_like(k_dev)
        if len(on_disk) == 0:
            self.host.load(slot, out=(k_dev, v_dev))
            return k_dev, v_dev, None
        if len(on_host):
            hk = torch.empty(len(on_host), P, D, dtype=self.dtype, device=self.device)
            hv = torch.empty_like(hk)
            self.host.load(slot[on_host], out=(hk, hv))
            rows = self._rows_up(on_host)
            k_dev.index_copy_(0, rows, hk)
            v_dev.index_copy_(0, rows, hv)
        sk = torch.empty(len(on_disk), P, D, dtype=self.dtype, pin_memory=True)
        sv = torch.empty_like(sk, pin_memory=True)
        self._load_disk(slot[on_disk], out=(sk, sv))
        dk = torch.empty(sk.shape, dtype=self.dtype, device=self.device)
        dv = torch.empty_like(dk)
        self.transfer.wait([self.transfer.submit(dk, sk), self.transfer.submit(dv, sv)])
        rows = self._rows_up(on_disk)
        k_dev.index_copy_(0, rows, dk)
        v_dev.index_copy_(0, rows, dv)
        return k_dev, v_dev, (sk, sv)

    def _rows_up(self, rows: np.ndarray) -> torch.Tensor:
        """Row numbers on the device, copied from pinned memory on CUDA (a pageable copy can stall the host)."""
        host = torch.from_numpy(rows)
        return (host.pin_memory() if self.pin else host).to(self.device, non_blocking=True)

    def _keep_on_host(self, heads: np.ndarray, pids: np.ndarray, from_disk: tuple | None) -> None:
        """After recall brought pages ``(heads[i], pids[i])`` up (in `_bring_up`'s order, with its ``from_disk``):
        count their use, and every `promote_every` such steps (`PROMOTE_EVERY`) keep the disk pages among them
        in host memory where they are worth more than what the host holds (`plan_promotion`), their disk
        records kept as clean copies (`cfg.promote`). A page recall keeps asking for comes up again in a later
        round; a round now and then costs the host far less than one every step."""
        cfg = self.cfg
        budget = cfg.host_tokens(self.seen)
        if not cfg.promote or budget is None:
            return
        table = self.table
        table.touch(heads, pids)
        self._recall_clock += 1
        clock = self._recall_clock
        if clock % COOL_EVERY == 0:
            table.cool()
        if from_disk is None or clock % self.promote_every:
            return
        first, k, v = from_disk
        dh, dp = heads[first:], pids[first:]
        P = cfg.page_size
        room = max(0, budget - self._readahead_pages() * P) // P
        rank, landed = table.landed_rank()
        on_host = table.tier == HOST
        kept, down_h, down_p = plan_promotion(dh, dp, table.uses, rank, on_host, landed, table.copy_slot >= 0, room)
        if not kept.any():
            return
        try:
            # each move is all or nothing; where one cannot be made (a full disk for a host page without a clean
            # copy, no memory for a new host slab), the pages stay where they are: the step reads what it
            # brought up either way, and the next placement that needs the room tries again
            if len(down_p):
                self.move_down(down_h, down_p)
            at = np.flatnonzero(kept)
            copies = table.lookup(dh[at], dp[at])[1]
            rows = torch.from_numpy(at)
            slots = self.host.store(k.index_select(0, rows), v.index_select(0, rows))
        except CapacityError:
            self.counters.promotions_skipped += 1
            return
        table.place(dh[at], dp[at], HOST, np.asarray(slots, dtype=np.int64), copies=copies)
        self.counters.pages_promoted += len(at)

    def _load_disk(self, slots: np.ndarray, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Disk pages at `slots` into `out` (through the read-ahead ring, where there is one)."""
        t0 = time.perf_counter()
        try:
            (self.disk if self.readahead is None else self.readahead).load(slots, out=out)
        finally:
            self.counters.disk_wait_seconds += time.perf_counter() - t0

    def _read_ahead(self, ids: torch.Tensor, shortlist: torch.Tensor) -> None:
        """Start reading the short-listed disk pages that were not taken: the likeliest next ones."""
        if self.readahead is None or shortlist is ids:
            return

        def candidates() -> np.ndarray:
            H, n = shortlist.shape[0], self.table.n
            # best ranked first across heads (rank-major), so that a capped read ahead takes every head's best
            cand = (shortlist.cpu().numpy().T + np.arange(H) * n).reshape(-1)
            taken = ids.cpu().numpy() + np.arange(H)[:, None] * n
            cand = cand[~np.isin(cand, taken)]
            tier, slot = self.table.lookup(cand // n, cand % n)
            return slot[tier == DISK]

        self.readahead.offer(candidates)
