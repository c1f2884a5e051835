"""One layer's cache: write new KV, score it, place it in the tiers, and recall demoted pages for a query.

Life of a step: `write` scores the new tokens and returns the device entries followed by the new ones
(what attention reads); `recall` picks demoted pages for the step's query and brings them to the device;
`commit` then runs the placement: entries over the device budget go to host pages (or are dropped in
evict mode), host pages over the host budget go to disk.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..config import TieredCacheConfig
from ..errors import ScorerError, UnsupportedError
from ..placement import plan_device_demotion, plan_host_overflow, protected_count
from ..placement.page_table import DISK, HOST, PageTable
from ..recall import PageIndex, select_pages
from ..scoring import Scorer, checked_scores
from ..tiers.device import DevicePool
from ..tiers.disk import DiskStore
from ..tiers.host import HostPool
from ..transfer import TransferManager
from . import parking
from .stats import MoveCounters


@dataclass
class _Pending:
    """New tokens of the current step, returned to attention but not yet placed."""

    k: torch.Tensor          # [1, heads, q, dim]
    v: torch.Tensor
    pos: torch.Tensor        # [heads, q]
    score: torch.Tensor | None  # [heads, q]; None until attention for scorers that need the query
    staged: bool             # written into the device pool right after the committed entries
    returned: tuple[torch.Tensor, torch.Tensor]


@dataclass
class Recalled:
    """Pages brought back for one step: ``k, v`` ``[heads, r, dim]``, ``valid`` ``[heads, r]``."""

    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor
    page_ids: torch.Tensor   # [heads, pages]


class LayerEngine:
    """The tiers, the page table and the placement of one layer."""

    def __init__(self, layer_idx: int, config: TieredCacheConfig, scorer: Scorer,
                 transfer: Callable[[torch.device], TransferManager], disk_dir: Callable[[], str],
                 counters: MoveCounters) -> None:
        self.layer_idx, self.cfg, self.scorer = layer_idx, config, scorer
        self.heads, self.head_dim = config.shape.num_kv_heads, config.shape.head_dim
        self._transfer_for, self._disk_dir, self.counters = transfer, disk_dir, counters
        self.seen = 0
        self.pool: DevicePool | None = None
        self.host: HostPool | None = None
        self.disk: DiskStore | None = None
        self.table = PageTable(self.heads)
        self.index: PageIndex | None = None   # what recall reads about the demoted pages, on the device
        self.pending: _Pending | None = None
        self.parked = None            # a parking.Parked while the layer is parked between turns
        self.parking: DiskStore | None = None

    # ------------------------------------------------------------------ write
    def _init(self, k: torch.Tensor) -> None:
        self.device, self.dtype = k.device, k.dtype
        self.transfer = self._transfer_for(k.device)
        self.pool = DevicePool(self.heads, self.head_dim, k.dtype, k.device)
        if self.cfg.mode == "tier":
            self.host = HostPool(self.heads, self.cfg.page_size, self.head_dim, k.dtype,
                                 pin=k.device.type == "cuda")
        self.index = PageIndex.empty(self.heads, self.cfg.page_size, self.head_dim, k.dtype, k.device)

    def write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Take a step's new K/V ``[1, heads, q, dim]``; return what attention reads."""
        if k.dim() != 4 or k.shape[0] != 1:
            raise UnsupportedError(f"batch size {k.shape[0] if k.dim() == 4 else '?'} (key shape "
                                   f"{list(k.shape)}) is not supported yet; allowed: batch size 1")
        if k.shape[1] != self.heads or k.shape[3] != self.head_dim:
            raise UnsupportedError(f"key shape {list(k.shape)} does not match the config: expected "
                                   f"[1, {self.heads}, tokens, {self.head_dim}]")
        self.flush()
        if self.pool is None:
            self._init(k)
        if self.parked is not None:
            parking.restore(self)
        q = k.shape[2]
        positions = torch.arange(self.seen, self.seen + q, device=k.device)
        score = None  # scored after attention, with the query, by attention-based scorers
        if not getattr(self.scorer, "needs_query", False):
            score = checked_scores(self.scorer, k, v, positions, self.layer_idx)[0]
        staged = self.pool.fits(q)
        if staged:
            returned = self.pool.stage(k, v)
        else:
            ck, cv, _, _ = self.pool.committed()
            returned = (torch.cat([ck, k], dim=2), torch.cat([cv, v], dim=2))
        self.pending = _Pending(k, v, positions.expand(self.heads, q), score, staged, returned)
        self.seen += q
        return returned

    @property
    def stored(self) -> int:
        """Committed entries per head on the device (what `write` returns before the new tokens)."""
        if self.parked is not None:
            return self.parked.count
        return 0 if self.pool is None else self.pool.count

    # ------------------------------------------------------------------ recall
    def recall(self, query: torch.Tensor, scaling: float | None = None) -> Recalled | None:
        """Bring back the demoted pages most likely to matter to `query` ``[1, q_heads, q_len, dim]``."""
        n = self.table.n
        if n == 0 or self.cfg.recall_pages == 0 or self.cfg.mode != "tier":
            return None
        # what attention reads anyway: the device entries and the step's new tokens
        resident = self.pending.returned[0][0] if self.pending is not None else self.pool.committed()[0][0]
        index = self.index.first(n)
        ids = select_pages(query, index.lo, index.hi, index.codes, index.counts, self.cfg.recall_pages, scaling,
                           resident=resident)
        r = ids.shape[1]
        heads = np.repeat(np.arange(self.heads), r)
        pids = ids.cpu().numpy().reshape(-1)
        tiers = self.table.tier[heads, pids]
        P, D = self.cfg.page_size, self.head_dim
        pin = self.device.type == "cuda"
        on_host = np.flatnonzero(tiers == HOST)
        on_disk = np.flatnonzero(tiers == DISK)
        if len(on_disk) == 0:  # the common case: one gather, straight into the staging buffer
            out = None
            if pin:
                out = (torch.empty(len(pids), P, D, dtype=self.dtype, pin_memory=True),
                       torch.empty(len(pids), P, D, dtype=self.dtype, pin_memory=True))
            stage_k, stage_v = self.host.load(heads, self.table.slot[heads, pids], out=out)
        else:
            stage_k = torch.empty(len(pids), P, D, dtype=self.dtype, pin_memory=pin)
            stage_v = torch.empty_like(stage_k, pin_memory=pin)
            if len(on_host):
                hk, hv = self.host.load(heads[on_host], self.table.slot[heads[on_host], pids[on_host]])
                rows = torch.from_numpy(on_host)
                stage_k[rows], stage_v[rows] = hk, hv
            t0 = time.perf_counter()
            dk, dv, _, _, _ = self.disk.read_many(heads[on_disk], pids[on_disk],
                                                  self.table.crc[heads[on_disk], pids[on_disk]])
            self.counters.disk_wait_seconds += time.perf_counter() - t0
            rows = torch.from_numpy(on_disk)
            stage_k[rows], stage_v[rows] = dk, dv
        if self.device.type == "cpu":
            k_dev, v_dev = stage_k, stage_v
        else:
            k_dev = torch.empty(stage_k.shape, dtype=self.dtype, device=self.device)
            v_dev = torch.empty_like(k_dev)
            self.transfer.wait([self.transfer.submit(k_dev, stage_k), self.transfer.submit(v_dev, stage_v)])
        page_bytes = 2 * P * D * stage_k.element_size()
        self.counters.bytes_moved["host_to_device"] += len(on_host) * page_bytes
        self.counters.bytes_moved["disk_to_device"] += len(on_disk) * page_bytes
        self.counters.pages_recalled["host"] += len(on_host)
        self.counters.pages_recalled["disk"] += len(on_disk)
        self.counters.recall_steps += 1
        counts = torch.from_numpy(self.table.count[heads, pids]).to(self.device)
        valid = torch.arange(P, device=self.device) < counts[:, None]
        return Recalled(k_dev.view(self.heads, r * P, D), v_dev.view(self.heads, r * P, D),
                        valid.view(self.heads, r * P), ids)

    # ------------------------------------------------------------------ placement
    def flush(self) -> None:
        """Place the pending tokens, if any (normally done right after attention)."""
        if self.pending is not None:
            self.commit()

    def commit(self, query: torch.Tensor | None = None, scaling: float | None = None) -> None:
        """Place the step's new tokens: keep the best on the device, demote (or drop) the rest.

        `query` (what attention used) is needed only by scorers that rank from attention weights.
        """
        p = self.pending
        if p is None:
            return
        if p.score is None:
            if query is None:  # the step stays pending: nothing is lost
                raise ScorerError(f"scorer {getattr(self.scorer, 'name', self.scorer)!r} needs the attention "
                                  "query, but this layer's attention did not run through kvtier; use the model "
                                  "whose config the TieredCache was built with")
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            p.score = checked_scores(self.scorer, p.k, p.v, p.pos[0], self.layer_idx, query=query,
                                     context_keys=p.returned[0], scaling=scale)[0]
        self.pending = None
        pool, cfg = self.pool, self.cfg
        q = p.k.shape[2]
        if p.staged:
            n = pool.count + q
            pool.pos[:, pool.count:n] = p.pos
            pool.score[:, pool.count:n] = p.score
            k_all, v_all = pool.k[:, :, :n], pool.v[:, :, :n]
            pos_all, score_all = pool.pos[:, :n], pool.score[:, :n]
        else:
            k_all, v_all = p.returned
            pos_all = torch.cat([pool.pos[:, :pool.count], p.pos], dim=1)
            score_all = torch.cat([pool.score[:, :pool.count], p.score], dim=1)
        budget = cfg.device_tokens(self.seen)
        slack = max(0, min(cfg.page_size, budget - protected_count(self.seen, cfg.sink_tokens,
                                                                   cfg.recent_tokens)))
        plan = plan_device_demotion(score_all, pos_all, self.seen, budget, cfg.sink_tokens,
                                    cfg.recent_tokens, slack)
        if plan is None:
            if p.staged:
                pool.count += q
            else:
                pool.replace(k_all[0], v_all[0], pos_all, score_all)
        else:
            keep, demote = plan
            demoted = [_take(t, demote) for t in (k_all[0], v_all[0], pos_all, score_all)]
            kept = [_take(t, keep) for t in (k_all[0], v_all[0], pos_all, score_all)]
            pool.replace(*kept)
            if cfg.mode == "tier":
                self._to_host(*demoted)
                self._host_overflow()
            else:
                self.counters.tokens_dropped += demote.numel()
        pool.reserve(budget + cfg.page_size + 1)

    def _to_host(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, score: torch.Tensor) -> None:
        """Cut demoted entries ``[heads, m, ...]`` (in position order) into pages and store them on the host."""
        H, m, D = k.shape
        P = self.cfg.page_size
        n_pages = math.ceil(m / P)
        pad = n_pages * P - m
        if pad:
            k = torch.cat([k, k.new_zeros(H, pad, D)], dim=1)
            v = torch.cat([v, v.new_zeros(H, pad, D)], dim=1)
            pos = torch.cat([pos, pos.new_full((H, pad), -1)], dim=1)
            score = torch.cat([score, score.new_full((H, pad), float("-inf"))], dim=1)
        counts = np.full(n_pages, P, dtype=np.int64)
        counts[-1] = P - pad
        k, v = k.reshape(H, n_pages, P, D), v.reshape(H, n_pages, P, D)
        pos, score = pos.reshape(H, n_pages, P), score.reshape(H, n_pages, P)
        ids = self.table.add(n_pages)
        self.index.add(int(ids[0]), k, torch.from_numpy(counts).to(k.device).expand(H, n_pages),
                       self.table.capacity)
        rank = score.amax(dim=2)
        pin = self.device.type == "cuda"
        staged = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in (k, v, pos, score, rank)]
        jobs = [self.transfer.submit(dst, src) for dst, src in zip(staged, (k, v, pos, score, rank))]
        self.transfer.wait(jobs)
        hk, hv, hpos, hscore, hrank = staged
        heads = np.repeat(np.arange(H), n_pages)
        slots = self.host.store(heads, hk.reshape(-1, P, D), hv.reshape(-1, P, D), hpos.reshape(-1, P),
                                hscore.reshape(-1, P))
        cols = np.tile(ids, H)
        self.table.tier[heads, cols] = HOST
        self.table.slot[heads, cols] = slots
        self.table.count[:, ids] = counts
        self.table.rank[:, ids] = hrank.numpy()
        self.counters.bytes_moved["device_to_host"] += m * H * 2 * D * k.element_size()

    def _host_overflow(self) -> None:
        """Push the lowest-ranked host pages to disk until the host fits its budget."""
        budget = self.cfg.host_tokens(self.seen)
        if budget is None or self.table.n == 0:
            return
        n = self.table.n
        plans = plan_host_overflow(self.table.rank[:, :n], self.table.count[:, :n],
                                   self.table.tier[:, :n] == HOST, budget, min(self.cfg.page_size, budget))
        heads = np.concatenate([np.full(len(ids), h) for h, ids in enumerate(plans)]).astype(np.int64)
        if len(heads) == 0:
            return
        self.move_host_pages_to_disk(heads, np.concatenate(plans).astype(np.int64))

    def move_host_pages_to_disk(self, heads: np.ndarray, pids: np.ndarray) -> None:
        """Write the given host pages (one per ``(head, page id)``) to disk and free their host slots."""
        slots = self.table.slot[heads, pids]
        k, v = self.host.load(heads, slots)
        pos, score = self.host.load_meta(heads, slots)
        disk = self._disk_store()
        counts = self.table.count[heads, pids]
        crcs = disk.write_many(heads, pids, counts, k, v, pos, score)
        self.table.crc[heads, pids] = crcs
        self.table.tier[heads, pids] = DISK
        self.table.slot[heads, pids] = -1
        self.host.free(heads, slots)
        self.counters.bytes_moved["host_to_disk"] += len(pids) * disk.payload_size

    def bring_disk_pages_to_host(self, heads: np.ndarray, pids: np.ndarray) -> None:
        """Read the given disk pages back into the host pool (the disk records stay valid)."""
        k, v, pos, score, _ = self.disk.read_many(heads, pids, self.table.crc[heads, pids])
        slots = self.host.store(heads, k, v, pos, score)
        self.table.tier[heads, pids] = HOST
        self.table.slot[heads, pids] = slots

    def _disk_store(self) -> DiskStore:
        if self.disk is None:
            self.disk = DiskStore(self._disk_dir(), self.layer_idx, self.heads, self.cfg.page_size,
                                  self.head_dim, self.dtype)
        return self.disk

    # ------------------------------------------------------------------ accounting
    def usage(self) -> dict[str, dict[str, int]]:
        """Tokens (summed over heads) and bytes per tier, measured from the pools."""
        device_tokens = 0 if self.pool is None else self.pool.count * self.heads
        entry = 0 if self.pool is None else self.pool.entry_bytes()
        host_tokens = 0 if self.host is None else int(self.host.held_tokens().sum())
        disk_tokens = int(self.table.tokens(DISK).sum())
        host_index = disk_index = 0
        if self.parked is not None:  # the device entries and the recall index wait on the host or on disk
            parked = self.parked.count * self.heads
            host_tokens += parked if self.parked.where == "host" else 0
            disk_tokens += parked if self.parked.where == "disk" else 0
            if self.parked.index is not None:
                host_index = self.parked.index.nbytes()
            disk_index = self.parked.index_file_bytes
        return {
            "device": {"tokens": device_tokens, "bytes": device_tokens * entry,
                       "reserved_bytes": 0 if self.pool is None else self.pool.reserved_bytes(),
                       "index_bytes": self.index_bytes()},
            "host": {"tokens": host_tokens, "bytes": host_tokens * entry + host_index,
                     "reserved_bytes": 0 if self.host is None else self.host.reserved_bytes()},
            "disk": {"tokens": disk_tokens, "bytes": disk_tokens * entry + disk_index,
                     "reserved_bytes": 0 if self.disk is None else self.disk.file_bytes()},
        }

    def index_bytes(self) -> int:
        """Device bytes of the recall index (bounds, codes, counts) of the pages in use."""
        return 0 if self.index is None else self.index.first(self.table.n).nbytes()

    def reset(self) -> None:
        """Forget every entry (the files stay open for reuse)."""
        self.pending = None
        parking.forget(self)
        self.seen = 0
        self.table.clear()
        if self.pool is not None:
            self.pool.clear()
            self.index = self.index.first(0)
        if self.host is not None:
            self.host.clear()

    def close(self) -> None:
        self.reset()
        for store in (self.disk, self.parking):
            if store is not None:
                store.close()
        self.disk = self.parking = None


def _take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Gather ``t`` ``[heads, n, ...]`` at ``idx`` ``[heads, m]`` along the token axis."""
    if t.dim() == 3:
        return torch.gather(t, 1, idx[..., None].expand(-1, -1, t.shape[2]))
    return torch.gather(t, 1, idx)
