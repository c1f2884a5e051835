"""One layer's cache: the life of a step.

`write` scores the step's new tokens and stages them on the device (what attention reads); `attend` picks
demoted pages for each block of the step's queries, brings them up and computes attention over the parts;
`commit` then places: whole pages of the lowest-ranked device entries go down the hierarchy (host memory,
then disk) or are dropped in evict mode. The engine holds no policy: plans come from `placement`, page
choices from `recall`, storage from `tiers`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import native
from ..config import TieredCacheConfig
from ..errors import CapacityError, ScorerError, UnsupportedError, is_resource_error
from ..placement import page_rank, plan_device_demotion, plan_host_overflow, protected_count
from ..placement.page_table import DISK, HOST, PageTable
from ..recall import PageIndex, grouped, select_pages
from ..recall.buffer import BufferLayout, RecallBuffer
from ..scoring import (QueryScorer, Scorer, capturable, checked_scores, nan_error, needs_query, ranking_scores,
                       scorer_name)
from ..tiers.device import DevicePool
from ..tiers.host import SLAB_BYTES, HostPool
from ..tiers.pinned import empty_pinned_cache
from ..tiers.readahead import DiskReadAhead
from .device_step import DeviceDecoding
from .fetch import PROMOTE_EVERY, PageFetching
from .graphs import StepGraphs
from .attention import attend_parts, attend_with_lse, finish_with_lse, sink_part
from .parking import ParkedLayer, check_target, parked_path
from .resources import SharedResources
from .steady_step import SteadySteps
from .weights import unpack_rows, weights_by_position

QUERY_BLOCK = 128     # query tokens that share one recall (a long query is attended block by block)
SLAB_TOKENS = 4096    # device entries per slab (at least; a fixed budget gets one slab that holds it)


@dataclass
class _Pending:
    """New tokens of the current step: staged on the device, not yet placed."""

    k: torch.Tensor          # [1, heads, q, dim]
    v: torch.Tensor
    pos: torch.Tensor        # [q]; a decode step's is rewritten by the next step (`SharedResources.positions`)
    start: int               # the first position
    score: torch.Tensor | None = None   # [heads, q]; None until scored (after attention, for scorers that need
                                        # the query)
    masked: torch.Tensor | None = None   # [q] bool: padding no query attends; dropped at commit
    staged: bool = False     # scored (unless the scorer needs the query) and staged in the device pool
    placed: bool = False     # a decode step's score committed on the device too (`_decode_on_device`)


class _Landing:
    """A demotion's copies to the host, as the page table's `add_later` fill: ready once every copy is done;
    called, it waits for them (on the host), raises if the scores it placed by were NaN, and returns the
    pages' ranks and positions."""

    def __init__(self, engine: LayerEngine, jobs: list[int], rank: torch.Tensor, where: torch.Tensor,
                 nan: torch.Tensor | None) -> None:
        self.engine, self.jobs, self.rank, self.where, self.nan = engine, jobs, rank, where, nan

    def ready(self) -> bool:
        return all(self.engine.transfer.done(j) for j in self.jobs)

    def __call__(self) -> tuple[np.ndarray, np.ndarray]:
        self.engine.transfer.wait(self.jobs)
        if self.nan is not None and bool(self.nan):
            raise nan_error(scorer_name(self.engine.scorer), self.engine.layer_idx)
        return self.rank.numpy(), self.where.numpy()


class LayerEngine(PageFetching, DeviceDecoding, SteadySteps):
    """The tiers, the page table and the placement of one layer."""

    def __init__(self, layer_idx: int, config: TieredCacheConfig, scorer: Scorer | QueryScorer,
                 shared: SharedResources) -> None:
        self.layer_idx, self.cfg, self.scorer, self.shared = layer_idx, config, scorer, shared
        self.counters = shared.counters
        self.heads, self.head_dim = config.shape.num_kv_heads, config.shape.head_dim
        self.seen = 0
        self.pool: DevicePool | None = None
        self.index: PageIndex | None = None
        self.table = PageTable(self.heads, config.page_size)
        self.tiers: list = [None, None]    # the hierarchy below the device, fastest first: [host, disk]
        self.readahead: DiskReadAhead | None = None
        self._ring_made = False   # whether `_disk` has sized the ring (none, or `readahead`) since the last reset
        self.pending: _Pending | None = None
        self.parked: ParkedLayer | None = None
        self.parking: tuple[ParkedLayer, BufferLayout | None, int] | None = None   # `prepare_park`'s, not settled
        self.torn = False   # a restore interrupted midway: the cache must say it is broken (`CacheState`)
        self.last_recall: torch.Tensor | None = None   # [heads, pages] ids recalled for the last query block
        self.recalled: RecallBuffer | None = None       # those pages, on the device
        # the layout of the recall buffer a park let go (or that of the layer a copy was made from): the next
        # buffer takes the same pages into the same slots, so its sums run in the same order
        self.layout_kept: BufferLayout | None = None
        self.device_recall: bool | None = None          # plan recall on the device (None: on CUDA, see fetch.py)
        self.select_kernels: bool | None = None         # page choice, pool attention and merge by native kernels
                                                        # (None: on CUDA, PageIndex; read when the index is made)
        self._slot_mirror: tuple[int, torch.Tensor] | None = None   # (table version, host slots on the device)
        self._disk_mark: tuple[int, bool] = (-1, False)   # (table version, whether a page is on disk then)
        self._landed = 0   # disk pages device-planned recall brought up since `settle_counts` (`_read_disk_pages`)
        # by device-planned recall: [pages moved on demand, pages reused, pages prefetched, prefetched pages chosen]
        self.device_counts: torch.Tensor | None = None
        # the scores' running maximum per head since the last check, NaN once one was (deferred on CUDA): None
        # when nothing was noted since, else `_nan_buf`, which is kept (folded into in place, -inf after a check)
        self._nan: torch.Tensor | None = None
        self._nan_buf: torch.Tensor | None = None
        self.defer_nan: bool | None = None              # defer the NaN check (None: on CUDA)
        # a decode step's scoring and staging done by its attention, with the rest of its device work, so that a
        # CUDA graph captures them too (None: wherever `_writes_in_attention` allows; False: never)
        self.write_in_attention: bool | None = None
        # capture decode steps' device work as CUDA graphs and replay them (`engine.graphs`; read when the layer
        # takes its first step)
        self.cuda_graphs = config.cuda_graphs
        self.graphs: StepGraphs | None = None
        self.prefetch_graphs: StepGraphs | None = None   # the prefetch's launches, replayed on its side stream
        # a decode step's prefetch as the last launches of its own device work, on its stream (None: where its
        # steps are captured as CUDA graphs; False: on the side stream, replayed there from `prefetch_graphs`)
        self.prefetch_in_step: bool | None = None
        self._masked_positions = np.empty(0, dtype=np.int64)   # padding positions, never stored
        self._unordered: list[int] = []   # demotion copies no device read has been ordered after yet
        # (scale, sinks, softcap, query, key and value shapes) of the last decode step whose launches scored and
        # staged its entry: what `plan_steady` takes the next step's to be
        self._steady_how: tuple | None = None
        self._recall_clock = 0   # recalls that brought pages up, to cool the page table's use counts every `COOL_EVERY`
        self.promote_every = PROMOTE_EVERY   # such recalls between rounds that keep disk pages on the host
        self.host_slab_bytes = SLAB_BYTES    # the host pool's slab size (read when the layer takes its first step)
        # host pages the disk refused (`_host_overflow`): demotions to let pass before trying again, and how many
        # tries in a row failed (the wait doubles with each, so a disk that stays full is not written to with the
        # whole backlog at every demotion)
        self._spill_wait, self._spill_failures = 0, 0

    # ------------------------------------------------------------------ write
    def _init(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.pin = device.type == "cuda"
        self.transfer = self.shared.transfer(device)
        budget = self.cfg.device_budget
        slab = SLAB_TOKENS if budget.is_fraction or budget.value > 65536 else \
            max(SLAB_TOKENS, int(budget.value) + 2 * self.cfg.page_size)   # a huge budget grows slab by slab
        # made aside, the pool set last: a failure (out of memory, Ctrl-C) leaves no half-made layer, whose next
        # write (a retry, or the first after a reset) would have skipped the rest
        pool = DevicePool(self.heads, self.head_dim, dtype, device, slab)
        counts = torch.zeros(4, dtype=torch.int64, device=device)
        graphs = StepGraphs(device, self.cuda_graphs, self.shared.graphs)
        prefetch_graphs = StepGraphs(device, self.cuda_graphs, self.shared.graphs)
        if self.cfg.mode == "tier":
            index = PageIndex(self.heads, self.cfg.page_size, self.head_dim, dtype, device, self.pin)
            index.native_select = self.select_kernels
            host = HostPool(self.cfg.page_size, self.head_dim, dtype, self.pin, self.host_slab_bytes)
            self.index, self.tiers[0] = index, host
        self.device_counts, self.graphs, self.prefetch_graphs = counts, graphs, prefetch_graphs
        self.pool = pool

    def take_gpu_path(self, plan_on_device: bool = True) -> None:
        """Take the decode path a CUDA device takes, on whatever device this layer runs: recall planned on the
        device (unless not `plan_on_device`), pages chosen and the pool attended by the kernels (their torch
        twins off CUDA), the NaN check deferred, and a scorer with a one-launch form scoring through it. So a
        machine without a GPU checks and counts the GPU's work (tests, `kvtier bench launches`)."""
        self.device_recall = plan_on_device
        self.select_kernels = self.defer_nan = True
        if self.index is not None:   # made already: it read `select_kernels` then
            self.index.native_select = True
        if hasattr(self.scorer, "native_score"):
            self.scorer.native_score = True

    @property
    def host(self) -> HostPool | None:
        return self.tiers[0]

    @property
    def disk(self):
        """The cache's disk store once this layer has used it."""
        return self.tiers[1]

    def _disk(self, ring_pages: int | None = None):
        """The disk store, and the read-ahead ring of `ring_pages` pages per head (by default what
        `TieredCacheConfig.read_ahead_pages` gives now), made at first use."""
        if self.tiers[1] is None:
            self.tiers[1] = self.shared.disk(self.cfg.page_size, self.head_dim, self.dtype)
        if not self._ring_made:
            pages = self.cfg.read_ahead_pages(self.seen) if ring_pages is None else ring_pages
            if pages:
                self.readahead = DiskReadAhead(self.tiers[1], pages * self.heads, self.cfg.page_size, self.head_dim,
                                               self.dtype, self.pin, adaptive=self.cfg.read_ahead is None)
            self._ring_made = True
        return self.tiers[1]

    def _readahead_pages(self) -> int:
        """Host pages per head set aside for the read-ahead ring: once the disk is in use, the ring's own size
        (fixed when it was made; none if no ring was made), before that what the setting gives now
        (`TieredCacheConfig.read_ahead_pages`), so that the first spill leaves room for the ring it makes."""
        if self._ring_made:
            return 0 if self.readahead is None else self.readahead.capacity // self.heads
        return self.cfg.read_ahead_pages(self.seen)

    def write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Take a step's new K/V ``[1, heads, q, dim]``; return what the model's own attention reads (device
        entries, new last; where `recalls`, `attend` reads the slabs instead and this has only their shape)."""
        if k.dim() != 4 or k.shape[0] != 1:
            raise UnsupportedError(f"batch size {k.shape[0] if k.dim() == 4 else '?'} (key shape "
                                   f"{list(k.shape)}) is not supported yet; allowed: batch size 1")
        if k.shape[1] != self.heads or k.shape[3] != self.head_dim:
            raise UnsupportedError(f"key shape {list(k.shape)} does not match the config: expected "
                                   f"[1, {self.heads}, tokens, {self.head_dim}]")
        self.flush()
        self.table.settle(ready_only=True)   # the last demotions' copies have landed by now: note them
        if self.pool is None:
            self._init(k.device, k.dtype)
        if self.parked is not None:
            self.restore()
        q = k.shape[2]
        positions = self.shared.positions(self.seen, q, k.device)   # the same tensor for every layer
        self.pending = p = _Pending(k, v, positions, self.seen)
        try:   # a step that fails here was not taken
            if self._writes_in_attention(k):
                # scored and staged by the step's attention (`_decode_on_device`), in the work a graph may replay;
                # nothing reads the new entry before then (the step recalls: the model's own attention does not run)
                self.pool.ensure(self.pool.count + q)
            else:
                self._stage(p)
        except BaseException:
            self.pending = None
            raise
        self.seen += q
        if not p.staged:
            return self.pool.placeholder(self.pool.count + q)
        if self.recalls() and self.pool.count + q > self.pool.slab_tokens:
            # the split attention reads the slabs where they are: what this returns is only claimed by it, so
            # no copy of the whole device tier is made every step (views of the right shape, not the entries)
            return self.pool.placeholder(self.pool.count + q)
        return self.pool.contiguous(self.pool.count + q)

    def _writes_in_attention(self, k: torch.Tensor) -> bool:
        """Whether this decode step's scoring and staging wait for its attention (`_decode_on_device`): where that
        attention runs on the device with recall (the pages chosen and recalled by the kernels), and the scorer
        and the NaN check are launches only. The step's attention does them, or `_stage` at the latest."""
        if self.write_in_attention is False or k.shape[2] != 1 or k.dtype != self.pool.dtype:
            return False
        return (self.recalls() and self.index.uses_kernels and self.recalls_on_device() and self._defer_nan()
                and capturable(self.scorer))

    def _stage(self, p: _Pending) -> None:
        """Score the pending tokens (unless the scorer needs the query) and stage them in the device pool, once."""
        if p.staged:
            return
        q = p.k.shape[2]
        pos = p.pos
        if q == 1 and not self.shared.holds_positions(p.start, q, self.device):
            pos = torch.full((1,), p.start, dtype=torch.int64, device=self.device)   # a later step's was written
        if not needs_query(self.scorer):
            p.score = self._checked(checked_scores(self.scorer, p.k, p.v, pos, self.layer_idx,
                                                   check_nan=not self._defer_nan()))
        self.pool.stage(p.k, p.v, pos.expand(self.heads, q))
        p.pos, p.staged = pos, True

    @property
    def stored(self) -> int:
        """Committed entries per head on the device (what `write` returns before the new tokens)."""
        if self.parked is not None:
            return self.parked.count
        return 0 if self.pool is None else self.pool.count

    def mask_new_tokens(self, masked: torch.Tensor) -> None:
        """Mark new tokens ``[q]`` that no query may ever attend (padding): they are dropped when placed.

        Only left padding is taken: the masked tokens, with any masked before, must be the sequence's first
        tokens. Later steps' masks are read at an offset of the tokens dropped (`get_mask_sizes`), which is right
        only where they all came first; padding after a real token would shift every later mask onto other
        entries. Once pages are demoted the split attention has no mask either. Refused, the step is undone
        (`drop_step`) by the caller where no other layer took it.
        """
        p = self.pending
        n = int(masked.sum())
        leading = bool(masked[:n].all()) and len(self._masked_positions) == p.start
        if not leading or (self.table.n and self.cfg.mode == "tier" and self.cfg.recall_pages):
            raise UnsupportedError("masked-out (padding) tokens after a real token; allowed: left padding (every "
                                   "masked token before the first real one, in the first step), or no padding")
        p.masked = masked

    def drop_step(self) -> None:
        """Undo `write` for a step whose attention was refused before it ran (nothing was placed yet): the layer's
        length is as before, and the staged entries are overwritten by the next step."""
        if self.pending is not None:
            self.seen = self.pending.start
            self.pending = None

    # ------------------------------------------------------------------ attention
    def recalls(self) -> bool:
        """Whether `attend` will run the split attention with recall this step (else the model's own runs)."""
        return (self.pending is not None and self.table.n > 0 and self.cfg.recall_pages > 0
                and self.cfg.mode == "tier")

    def attend(self, query: torch.Tensor, scaling: float | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None,
               weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Attention of the step's `query` ``[1, q_heads, q_len, dim]`` over the device entries, the new
        tokens and, per block of `QUERY_BLOCK` query tokens, the demoted pages recalled for that block.

        `softcap` and `sinks` (``[q_heads]`` logits) are the model's logit soft-cap and attention sinks.
        Returns ``(out [1, q_len, q_heads, dim], attention weights or None)``, or None when no page is
        demoted (the caller's own attention then runs over what `write` returned, bit-identical to a plain
        cache). With `weights`, the weights are ``[1, q_heads, q_len, seen]``, by token position.
        """
        if not self.recalls():
            return None
        if self._unordered:   # the last demotions' copies, long done by now: what reads their pages comes after
            self.transfer.order_after(self._unordered)
            self._unordered = []
        p = self.pending
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        q_len = query.shape[2]
        if q_len == 1 and not weights and self._pool_kernels(query) and self.recalls_on_device():
            # a decode step whose attention and recall are launches only (a CUDA graph can replay them)
            return self._decode_on_device(query, scale, softcap, sinks), None
        self._stage(p)
        outs, maps = [], []
        for b0 in range(0, q_len, QUERY_BLOCK):
            block = query[:, :, b0:b0 + QUERY_BLOCK]
            b1 = b0 + block.shape[2]
            # what the block reads anyway first: its log-sum-exp is the rest of the softmax's total, which
            # the page choice needs
            pool_kernels = q_len == 1 and self._pool_kernels(block)
            if q_len == 1:   # a decode step: its own token sits right after the device entries
                parts = self._attend_pool(block, scale, softcap, sinks, pool_kernels)
            else:
                parts = attend_parts(block, self.pool.spans(self.pool.count), p.k[:, :, :b1], p.v[:, :, :b1],
                                     b0, scale, softcap, sinks)
            resident = parts[0][1][0] if len(parts) == 1 else \
                torch.logsumexp(torch.stack([lse[0] for _, lse in parts]), dim=0)
            ids, shortlist = select_pages(grouped(block, self.heads), self.index, self.cfg.recall_pages, scale,
                                          resident_lse=resident)
            self.last_recall = ids
            packed = block.reshape(1, self.heads, -1, block.shape[3])
            rk, rv, order = self._fetch(ids, shortlist, ahead=b1 == q_len)
            mask = self.recalled.mask   # a buffer that keeps pages no longer chosen hides them (else None)
            parts.append(attend_with_lse(packed, rk[None], rv[None], scale, softcap=softcap, mask=mask))
            out, lse = finish_with_lse(parts, block, kernels=self.index.uses_kernels)
            outs.append(out)
            if weights:
                if mask is not None:   # weights by position read the chosen pages only
                    rk, order = self.recalled.chosen_pages()
                maps.append(self._weights(packed, lse, p, b0, b1, q_len, scale, softcap, query.shape[1], rk, order))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if not weights:
            return out, None
        return out, torch.cat(maps, dim=2).to(query.dtype)

    def _pool_kernels(self, query: torch.Tensor) -> bool:
        """Whether a decode step's attention runs through `native.attend_slabs` (and, with recall planned on
        the device, `native.attend_pages`): where the kernels choose pages, for queries of the cache's dtype, at
        most `native.ATTEND_ROWS` query heads per KV head (logits soft-capped or not: the kernels cap them)."""
        return self._pool_kernels_for(query.shape[1], query.dtype)

    def _pool_kernels_for(self, q_heads: int, dtype: torch.dtype) -> bool:
        """`_pool_kernels` for a query of `q_heads` heads and `dtype`."""
        return (self.index.uses_kernels and q_heads // self.heads <= native.ATTEND_ROWS and dtype == self.pool.dtype
                and not native.build_failed(self.device, "attend_slabs"))

    def _attend_pool(self, query: torch.Tensor, scale: float, softcap: float | None, sinks: torch.Tensor | None,
                     kernels: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A decode step's attention over the device entries and its own token, as parts to merge: one part
        from `native.attend_slabs` with `kernels` (`_pool_kernels`: every slab in one launch, split to fill the
        GPU), else one per slab."""
        n = self.pool.count + 1
        if not kernels:
            return attend_parts(query, self.pool.spans(n), None, None, 0, scale, softcap, sinks)
        packed = query.reshape(self.heads, query.shape[1] // self.heads, query.shape[3])
        # the count as the pool keeps it on the device: the same launch every step of a slab
        out, lse = native.attend_slabs(packed, self.pool.k, self.pool.v, n, scale, addresses=self.pool.addresses(),
                                       counted=self.pool.counted(1), softcap=softcap)
        parts = [(out[None], lse[None])]
        if sinks is not None:
            parts.append(sink_part(sinks, self.heads, 1, query.shape[3]))
        return parts

    def _weights(self, packed: torch.Tensor, lse: torch.Tensor, p: _Pending, b0: int, b1: int, q_len: int,
                 scale: float, softcap: float | None, q_heads: int, rk: torch.Tensor,
                 order: torch.Tensor | np.ndarray) -> torch.Tensor:
        """The block's attention weights by position (see `engine.weights`): ``[1, q_heads, b1 - b0, seen]``;
        `rk` are the recalled keys attention read, `order` the page id of each of their pages."""
        n = self.pool.count + (1 if q_len == 1 else 0)
        k, _ = self.pool.contiguous(n)
        sets = [(k[0], self.pool.meta(n)[0])]
        if q_len > 1:
            sets.append((p.k[0, :, :b1], p.pos[:b1].expand(self.heads, -1)))
        held = order.cpu().numpy() if isinstance(order, torch.Tensor) else order   # eager weights read the host
        pos = np.stack([np.stack([self.table.positions(h, pid) for pid in row]) for h, row in enumerate(held)])
        sets.append((rk, torch.from_numpy(pos.reshape(self.heads, -1)).to(self.device)))
        w = weights_by_position(packed, sets, lse, p.pos[b0:b1], self.seen, scale, softcap)
        return unpack_rows(w, q_heads)

    # ------------------------------------------------------------------ placement
    def flush(self) -> None:
        """Place the pending tokens, if any (normally done right after attention)."""
        if self.pending is not None:
            self.commit()

    def commit(self, query: torch.Tensor | None = None, scaling: float | None = None,
               softcap: float | None = None) -> None:
        """Place the step's new tokens: keep the best on the device, demote (or drop) whole pages of the rest.

        `query` (what attention used; with its `scaling` and logit `softcap`) is needed only by scorers that
        rank from attention weights.
        """
        p = self.pending
        if p is None:
            return
        q = p.k.shape[2]
        if p.placed:   # a decode step whose attention committed its score on the device: the host's part
            self.pending = None
            self.pool.note_commit()
            self._demote()
            return
        self._stage(p)   # a write left to an attention that did not run through kvtier
        if p.score is None:
            if query is None:  # the step stays pending: nothing is lost
                raise ScorerError(f"scorer {scorer_name(self.scorer)!r} needs the attention "
                                  "query, but this layer's attention did not run through kvtier; use the model "
                                  "whose config the TieredCache was built with")
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            context = self.pool.contiguous(self.pool.count + q)[0]
            pad = 0 if p.masked is None else int(p.masked.sum())   # the step's first tokens (`mask_new_tokens`)
            if pad:   # padding no query attended, nor is it scored: it leaves the cache below
                old = context.shape[2] - q
                context = torch.cat([context[:, :, :old], context[:, :, old + pad:]], dim=2)
            score = None if pad == q else checked_scores(
                self.scorer, p.k[:, :, pad:], p.v[:, :, pad:], p.pos[pad:], self.layer_idx, query=query[:, :, pad:],
                context_keys=context, scaling=scale, softcap=softcap, check_nan=not self._defer_nan())
            if pad:   # the padding's scores: any number, it leaves the cache below
                zeros = torch.zeros(1, self.heads, pad, device=p.k.device)
                score = zeros if score is None else torch.cat([zeros, score], dim=2)
            p.score = self._checked(score)
        self.pending = None
        self.pool.commit(q, p.score)
        if p.masked is not None:   # padding leaves the cache at once: nothing ever attends it
            where = torch.nonzero(p.masked).squeeze(1)
            self._masked_positions = np.union1d(self._masked_positions, p.pos[where].cpu().numpy())
            gone = where + (self.pool.count - q)
            self.pool.remove(gone.to(self.device).expand(self.heads, -1))
            self.counters.tokens_masked += gone.numel() * self.heads
        self._demote()

    def _defer_nan(self) -> bool:
        """On CUDA (or where `defer_nan` says so) whether the scores held a NaN goes down with the next
        demotion's copies and is read when they land, so a step reads nothing back; elsewhere the check is
        immediate."""
        if self.pool is None:
            return False
        return self.defer_nan if self.defer_nan is not None else self.device.type == "cuda"

    def _checked(self, scores: torch.Tensor) -> torch.Tensor:
        """``[heads, q]`` of checked scores, noting NaNs for later where the check is deferred: the running
        maximum per head propagates a NaN (torch's maximum does), one op a decode step, into the same buffer
        every step (so a decode step's launches stay the same from step to step)."""
        if self._defer_nan():
            peak = scores[0] if scores.shape[2] == 1 else scores[0].amax(dim=1, keepdim=True)
            self._nan = torch.maximum(self._nan_max(), peak, out=self._nan_buf)
        return scores[0]

    def _nan_max(self) -> torch.Tensor:
        """The kept buffer of the scores' running maximum per head, ``[heads, 1]`` float32 (made at first use)."""
        if self._nan_buf is None:
            self._nan_buf = torch.full((self.heads, 1), float("-inf"), device=self.device)
        return self._nan_buf

    def _nan_checked(self) -> None:
        """The noted scores were checked (their flag is on its way): start the running maximum again."""
        if self._nan is not None:
            self._nan.fill_(float("-inf"))
        self._nan = None

    def _nan_seen(self) -> torch.Tensor:
        """Whether a NaN was among the scores noted since the last check: a bool ``[1]`` on the device."""
        return torch.isnan(self._nan).any().reshape(1)

    def _device_budget(self) -> int:
        """`cfg.device_tokens` at the current length, computed once per length for every layer of the cache (each
        step's commit asks, in every layer, at the same length)."""
        memo = self.shared.budget_memo
        if memo[0] is not self.cfg or memo[1] != self.seen:
            memo = self.shared.budget_memo = (self.cfg, self.seen, self.cfg.device_tokens(self.seen))
        return memo[2]

    def _demote(self) -> None:
        cfg, pool = self.cfg, self.pool
        budget = self._device_budget()
        if pool.count <= budget:   # within budget: no ranking (and no age term) to compute this step
            return
        pos, score = pool.meta()
        defer = self._defer_nan()
        rank = ranking_scores(self.scorer, score, pos, self.seen, self.layer_idx, check_nan=not defer)
        if defer and rank is not score:   # an age term: its NaN goes down with the scores' (checked below)
            self._nan = torch.maximum(self._nan_max(), rank.amax(dim=1, keepdim=True), out=self._nan_buf)
        idx = plan_device_demotion(rank, pos, self.seen, budget, self._sink_end(),
                                   cfg.recent_tokens, cfg.page_size, kept=self._kept_on_device(),
                                   min_pages=cfg.demotion_pages(budget))
        if idx is None:
            return
        if self._nan is not None and cfg.mode == "evict":   # deferred NaN check, before those scores place
            bad = bool(self._nan_seen())                          # (tier mode reads it with its copies down)
            self._nan_checked()
            if bad:
                raise nan_error(scorer_name(self.scorer), self.layer_idx)
        if cfg.mode == "tier":
            k, v = pool.take(idx)
            # a host page keeps the rank its entries had when they left (the recency term included then)
            self._to_host(k, v, torch.gather(pos, 1, idx), torch.gather(rank, 1, idx))
        else:
            self.counters.tokens_dropped += idx.numel()
        pool.remove(idx)
        pool.trim()
        self.counters.demotions += 1   # once it took place: a failed copy down or NaN check left none
        if cfg.mode == "tier":
            self._host_overflow()

    def _sink_end(self) -> int:
        """The first position past the sinks: the sinks are the first `sink_tokens` stored tokens, after the
        left padding (every masked position comes first, `mask_new_tokens`), which is never stored."""
        return len(self._masked_positions) + self.cfg.sink_tokens

    def _kept_on_device(self) -> int:
        """Entries of a head in the always-kept set (sinks, recent window), counted on the host: every
        position in it is on the device (a kept entry is never demoted, and the window's start only moves
        forward), except padding that was never stored."""
        seen, cfg, sink_end = self.seen, self.cfg, self._sink_end()
        kept = protected_count(seen, sink_end, cfg.recent_tokens, cfg.device_tokens(seen))
        masked = self._masked_positions
        if masked.size:
            kept -= int(np.count_nonzero((masked < sink_end) | (masked >= seen - cfg.recent_window(seen))))
        return kept

    def _to_host(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, score: torch.Tensor) -> None:
        """Cut demoted entries ``[heads, m, ...]`` (position order, ``m`` whole pages) into pages on the host.

        Everything the host needs goes down as copies on the transfer manager's device-to-host stream,
        straight into where it stays (the pages into the host slabs, the key codes into the index), with the
        page ranks and positions for the page table and the deferred NaN flag of the scores beside them. The
        step does not wait for them: the layer's next recall, the first device read of those pages, is ordered
        after the copies on the device, and the page table learns the ranks and positions once they have
        landed (a `_Landing`, settled at the layer's next step, or at once by anything that reads them). A copy
        that cannot start frees the slots and places nothing.
        """
        H, m, D = k.shape
        P = self.cfg.page_size
        n = m // P
        k_pages, v_pages = k.reshape(H, n, P, D), v.reshape(H, n, P, D)
        slots = self.host.reserve(H * n)
        jobs: list[int] = []
        try:
            self.host.write_from(slots, k_pages.reshape(H * n, P, D), v_pages.reshape(H * n, P, D), self.transfer,
                                 jobs)
            self.index.stage(k_pages, self.transfer, jobs)
            rank = torch.empty((H, n), dtype=torch.float32, pin_memory=self.pin)
            where = torch.empty((H, n, P), dtype=torch.int64, pin_memory=self.pin)
            jobs += [self.transfer.submit(rank, page_rank(score.reshape(H, n, P)).float()),
                     self.transfer.submit(where, pos.reshape(H, n, P))]
            nan = None
            if self._nan is not None:
                nan = torch.empty(1, dtype=torch.bool, pin_memory=self.pin)
                jobs.append(self.transfer.submit(nan, self._nan_seen()))
        except BaseException:
            # copies already started may still write into the slots: they are free only once done (if that
            # wait fails too, the slots stay taken: leaked, never overwritten)
            self.transfer.wait(jobs)
            self.host.free(slots)
            raise
        self._nan_checked()
        self._unordered += jobs   # the layer's next recall waits for them on the device (see `attend`)
        self.index.commit(n)
        landing = _Landing(self, jobs, rank, where, nan)
        ids = self.table.add_later(n, landing)
        self.table.place(np.repeat(np.arange(H), n), np.tile(ids, H), HOST, slots)
        self.counters.bytes_moved["device_to_host"] += m * H * 2 * D * k.element_size()

    def _host_overflow(self) -> None:
        """Push the lowest-ranked host pages to disk until the host fits its budget.

        The pages of demotions whose copies are still landing stay where they are this time (their ranks are
        not known without waiting for the copies), unless the other host pages cannot make room.
        """
        budget = limit = self.cfg.host_tokens(self.seen)
        if budget is None or self.table.n == 0:
            return
        P = self.cfg.page_size
        ring = self._readahead_pages() * P   # host memory too: the pages' share is what it leaves
        budget = max(0, budget - ring)
        n = self.table.n
        on_host = self.table.tier == HOST
        per_head = on_host.sum(axis=1) * P
        over = per_head - budget
        if (over <= 0).all():
            return   # within budget: no ranks needed, so nothing waits for the last demotion's copies
        held = int(per_head.max()) + ring
        if self._spill_wait and held <= 2 * limit:   # the disk refused the last try: wait a while longer
            self._spill_wait -= 1
            return
        rank, landed = self.table.landed_rank()
        movable = on_host & landed[None, :]
        if (movable.sum(axis=1) * P < over).any():   # the landed pages cannot make room: wait for the others
            rank, movable = self.table.rank, on_host
        uses = self.table.uses if self.cfg.promote else None
        plans = plan_host_overflow(rank, np.full((self.heads, n), P), on_host, budget, 0, movable, uses)
        heads = np.concatenate([np.full(len(ids), h) for h, ids in enumerate(plans)]).astype(np.int64)
        if not len(heads):
            return
        try:
            self.move_down(heads, np.concatenate(plans).astype(np.int64))
        except CapacityError as e:
            # all or nothing: the pages stay on the host, over its budget, and the step goes on with the same
            # answers (a page is read the same from either tier), where breaking it would cost the whole context;
            # a later demotion tries again. Up to twice the budget: past that the error stands (a disk that stays
            # full, or refuses every page, must not let the host grow without end)
            if held > 2 * limit:
                raise CapacityError(f"{e}; the host already holds {held:,} tokens a head, over twice its budget "
                                    f"({limit:,}), so the pages cannot wait there for room on disk") from e
            self.shared.spill_deferred(self.layer_idx, e)
            self._spill_failures = min(self._spill_failures + 1, 4)
            self._spill_wait = 2 ** self._spill_failures - 1
            return
        self._spill_wait = self._spill_failures = 0   # a try past twice the budget may land while others wait
        self._compact_host()

    def _compact_host(self) -> None:
        """Give back the host pool's slabs that its pages no longer need: a prompt's demotion passes through the
        host on its way to disk, and the slabs it grew would otherwise stay for the cache's life. The pool keeps
        half a slab of room past its pages (`HostPool.compact`), more than a decode step's demotion adds before
        the spill that follows it, so slabs are not let go and taken again step after step."""
        host = self.host
        if not host.spare_slabs():
            return
        self.table.settle()   # copies still landing in the slots
        try:
            old, new = host.compact()
        except Exception as e:   # no memory for the copy: the pool stays as it was (only a memory figure waits)
            if isinstance(e, CapacityError) or is_resource_error(e):
                return
            raise
        if len(old):
            heads, pids = self.table.pages_in(HOST)
            slots = self.table.lookup(heads, pids)[1]
            order = np.argsort(slots)
            at = order[np.minimum(np.searchsorted(slots, old, sorter=order), len(slots) - 1)]
            if not np.array_equal(slots[at], old):   # never: the pool moved a page the table does not place there
                raise RuntimeError(f"layer {self.layer_idx}: the host pool moved pages from slots the page table "
                                   "does not name; the cache cannot go on")
            h, p = heads[at].astype(np.int64), pids[at].astype(np.int64)
            self.table.reslot(h, p, new)
        if self.pin:
            empty_pinned_cache()   # the slabs let go: to the system, not to torch's cache

    def move_down(self, heads: np.ndarray, pids: np.ndarray) -> None:
        """Move host pages ``(heads[i], pids[i])`` to disk, then free their host slots (all or nothing): a page
        with a clean copy there (brought up from disk, see `_keep_on_host`) goes back to it unwritten."""
        slots = self.table.lookup(heads, pids)[1]
        copies = self.table.copies(heads, pids)
        dirty = copies < 0
        disk_slots = copies.copy()   # `copies` (a new array: it gathers) stays as the table had it
        written = None
        if dirty.any():
            self.table.settle(pages=pids[dirty])    # read below: the copies to them must have landed
            written = self._disk().store(*self.host.load(slots[dirty]))
        try:
            if written is not None:
                disk_slots[dirty] = written
            self.table.place(heads, pids, DISK, disk_slots)
        except BaseException:   # (Ctrl-C, no memory) cut short, maybe after some chunks of the table: the pages
            self.table.place(heads, pids, HOST, slots, copies)   # are the host's again, and the store takes back
            if written is not None:                               # the records written, which no page names
                self._disk().free(written)
            raise
        self.host.free(slots)
        self.counters.bytes_moved["host_to_disk"] += int(dirty.sum()) * self.host.page_bytes()
        self.counters.pages_dropped_clean += int((~dirty).sum())

    # ------------------------------------------------------------------ parking
    def park(self, to: str) -> None:
        """Move what the layer holds on the device (and, for disk, on the host) down to `to`."""
        self.prepare_park(to)
        self.settle_park()

    def prepare_park(self, to: str) -> None:
        """The first step of `park`: everything that can fail (copies, writes), with nothing let go, so that
        `undo_park` puts the layer back as it was without reading anything. `settle_park` makes it final."""
        check_target(to)
        self.undo_park()   # one a park cut short (Ctrl-C) before this layer settled: the layer is as it was
        self.flush()
        self.table.settle()    # the host pages are read below: every copy to them must have landed
        if self.pool is None:
            return
        current = self.parked
        if current is not None and (current.where == to or current.where == "disk"):
            return
        layout = None
        if current is None:
            # the recall buffer's layout, read first (planned on the device, a read back: it may fail too)
            layout = self.recall_layout()
            n = self.pool.count
            k, v = self.pool.contiguous(n)
            pos, score = self.pool.meta()
            meta = {"pos": pos, "score": score}
            if self.index is not None:
                meta.update(self.index.state())
            current = ParkedLayer.take(k[0], v[0], meta, self.transfer, self.pin)
            if to == "host":
                current = current.with_host_pages(self.host, self.table)
        # the entries that leave the device (what a restore brings back); their index and positions come along
        moved = 0 if self.parked is not None else sum(t.numel() * t.element_size() for t in current.entries)
        if to == "disk":
            path = parked_path(self.shared.private_dir(), "layer", self.layer_idx)
            current = current.to_disk(self._disk(), self.host, self.table, path, self.cfg.page_size)
        self.parking = (current, layout, moved)

    def settle_park(self) -> None:
        """The park `prepare_park` made, made final: the device (and, for disk, the host) lets go. Bookkeeping
        only: nothing here fails."""
        if self.parking is None:
            return
        current, layout, moved = self.parking   # kept until the end: a reset after an interruption undoes it
        if current.where == "disk":
            written = 0 if current.unsettled is None else len(current.unsettled[2])   # host pages with no copy
            page = self.disk.payload_size
            self.counters.bytes_moved["host_to_disk"] += current.disk_bytes(page) + written * page
            current.settle(self.table, self.host)
        else:
            current.settle_host_pages(self.table, self.host)
        # a parked layer's pages are all in its own tensors or files: the ring's and the host pool's slabs go
        if self.readahead is not None:
            self.readahead.close()
        if self.host is not None:
            self.host.release()
        if self.parked is None:
            self.counters.bytes_moved["device_to_host"] += moved
            self.pool.clear()
            self._drop_recalled()
            self.layout_kept = layout
            if self.index is not None:
                self.index.release()
        self.parked = current
        self.parking = None

    def undo_park(self) -> None:
        """Drop the park `prepare_park` made: what it wrote is freed, and the layer is as it was before."""
        if self.parking is None:
            return
        current, self.parking = self.parking[0], None
        if current.where == "disk":
            current.undo(self.disk)

    def restore(self, got: dict | None = None) -> None:
        """Bring a parked layer back to the state it was parked in (`got`: what `ParkedLayer.read` read of it
        ahead, its host pages in slabs for this layer's pool, `kvtier.engine.unpark`; else it is read now)."""
        parked = self.parked
        if parked is None:
            return
        if got is None:
            got = parked.read(self.disk, self.table, self.cfg.page_size)
        meta = got["meta"]
        dev = self.device
        n = got["k"].shape[1]
        if "pinned" in got:   # read ahead into pinned memory: copied whole at the link's speed, cut on the device
            k, v = (t.to(dev)[:, :n] for t in got["pinned"])
        else:
            k, v = got["k"].to(dev), got["v"].to(dev)
        try:
            self.pool.replace(k, v, meta["pos"].to(dev), meta["score"].to(dev))
            if self.index is not None:
                self.index.load_state({name: meta[name] for name in ("bounds", "codes")})
            if self.host is not None and "slabs" not in got:   # before the release, after which nothing may fail
                self.host.reopen()   # (slabs read ahead are the pool's new ones)
            host_slots = parked.store_host_pages(got, self.host)
        except BaseException:
            # all or nothing: the device lets go of what it took back (its host pages could not come back, say),
            # and the layer stays parked as it was, the host pool too (the slabs `reopen` and `store` took go again)
            self.pool.clear()
            if self.index is not None:
                self.index.release()
            if self.host is not None:
                self.host.release()
            raise
        try:
            parked.release(got, host_slots, self.disk, self.table, self.readahead)
        except BaseException:
            # only bookkeeping is left, so only an interruption (Ctrl-C) lands here: the page table and the
            # parked layer may disagree, which the cache says from now on (`torn`)
            self.torn = True
            raise
        kind = "host_to_device" if parked.where == "host" else "disk_to_device"
        self.counters.bytes_moved[kind] += sum(t.numel() * t.element_size() for t in (got["k"], got["v"]))
        self.parked = None

    # ------------------------------------------------------------------ accounting
    def settle_counts(self) -> None:
        """Add what device-planned recall counted on the device to the shared counters (reads the device)."""
        if self.device_counts is None or self.host is None:
            return
        self._await_prefetch()   # a prefetch still counting
        moved, reused, ahead, used = (int(x) for x in self.device_counts.tolist())
        if moved or reused or ahead:
            self.device_counts.zero_()
            c = self.counters
            moved -= self._landed   # counted from disk when they were read
            self._landed = 0
            c.pages_recalled["host"] += moved + ahead
            c.bytes_moved["host_to_device"] += (moved + ahead) * self.host.page_bytes()
            c.pages_reused += reused
            c.pages_prefetched += ahead
            c.prefetch_used += used

    def usage(self) -> dict[str, dict[str, int]]:
        """Tokens (summed over heads) and bytes per tier, measured from the pools."""
        H = self.heads
        entry = 0 if self.pool is None else self.pool.entry_bytes()
        device_tokens = 0 if self.pool is None else self.pool.count * H
        host_tokens = int(self.table.tokens(HOST).sum())
        disk_tokens = int(self.table.tokens(DISK).sum())
        host_bytes = 0 if self.host is None else self.host.nbytes()
        host_bytes += 0 if self.index is None else self.index.host_bytes()
        # what lies on disk: the pages whose home it is, and the clean copies of host pages brought up from it
        disk_bytes = (disk_tokens + int((self.table.copy_slot >= 0).sum()) * self.cfg.page_size) * (entry - 12)
        if self.readahead is not None:
            host_bytes += self.readahead.nbytes()
        # allocated host memory: the host pool's and the ring's slabs, the index's code slabs, a parked layer's copy
        host_reserved = ((0 if self.host is None else self.host.reserved_bytes()) +
                         (0 if self.readahead is None else self.readahead.reserved_bytes()) +
                         (0 if self.index is None else self.index.codes.nbytes()))
        disk_reserved = 0   # its own files (the page file is the disk store's, the cache's to count)
        if self.parked is not None:
            tokens = self.parked.count * H
            if self.parked.where == "host":
                host_tokens += tokens
                host_bytes += self.parked.host_bytes()
                host_reserved += self.parked.host_bytes()
            else:
                disk_tokens += tokens
                disk_bytes += self.parked.disk_bytes(self.disk.payload_size)
                disk_reserved = self.parked.file_bytes()
        return {
            "device": {"tokens": device_tokens, "bytes": device_tokens * entry,
                       "reserved_bytes": 0 if self.pool is None else self.pool.reserved_bytes(),
                       "index_bytes": self.index_bytes(),
                       "recall_bytes": 0 if self.recalled is None else self.recalled.device_bytes()},
            "host": {"tokens": host_tokens, "bytes": host_bytes, "reserved_bytes": host_reserved},
            "disk": {"tokens": disk_tokens, "bytes": disk_bytes, "reserved_bytes": disk_reserved},
        }

    def index_bytes(self) -> int:
        """Device bytes of the recall index (the key bounds of the demoted pages)."""
        return 0 if self.index is None else self.index.device_bytes()

    def reset(self) -> None:
        """Forget every entry (the shared disk store stays open for reuse)."""
        self.undo_park()
        self.pending = None
        self._drop_recalled()
        self.layout_kept = None
        for landing in self.table.fills():   # copies still landing in slots about to be reused
            self.transfer.wait(landing.jobs)
        self._unordered = []
        self.last_recall = None
        self._slot_mirror = None
        self._nan = self._nan_buf = None
        self._steady_how = None
        self._recall_clock = 0
        self._spill_wait = self._spill_failures = 0
        self.settle_counts()
        if self.parked is not None:
            self.parked.discard(self.disk)
            self.parked = None
        self.torn = False
        if self.disk is not None:
            heads, pids = self.table.pages_in(DISK)
            slots = self.table.lookup(heads, pids)[1]
            copies = self.table.copy_slot
            slots = np.concatenate([slots, copies[copies >= 0]])   # the host pages' clean copies too
            if len(slots):
                if self.readahead is not None:
                    self.readahead.forget(slots)
                self.disk.free(slots)
        # the ring goes too: a fresh cache sizes it at its first spill, from its own length (the old one's size
        # had set aside other host pages); the shared store stays open
        self._close_ring()
        self._ring_made = False
        self.seen = 0
        self._masked_positions = np.empty(0, dtype=np.int64)
        self.table.clear()
        if self.pool is not None:
            self.pool.clear()
        if self.index is not None:
            self.index.release()
        if self.host is not None:
            self.host.clear()

    def _close_ring(self) -> None:
        if self.readahead is not None:
            ring, self.readahead = self.readahead, None
            ring.close()
            kept = self.counters.rings_closed   # its history stays in the stats
            for name, n in ring.counts().items():
                kept[name] += n

    def close(self) -> None:
        self.reset()
        self._close_ring()
        if self.host is not None:
            self.host.close()
        self.tiers = [None, None]
