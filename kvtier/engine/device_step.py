"""A decode step's attention with recall, all on the device: the part of a step a CUDA graph can stand for.

Where recall is planned on the device and the native kernels choose pages and attend, a decode step's
attention is a fixed run of launches: the device pool attended in one pass (`attend_slabs`, the count read on
the device), the bounds of every demoted page, their top-k and ranking, the recall plan and its copy, and the
recalled pages attended where the buffer holds them, merged with the pool's part (`attend_pages`). Where the
scorer's work is launches only too (`scoring.capturable`), the step's write joins the run: `write` leaves the
new entry's scoring and staging to it, so the run begins with them (the scores, the NaN check's running
maximum, the three copies into the pool at the count it keeps on the device) and ends with the score's
commit (its copy, and the count moved on on the device). That run is split here from the host's bookkeeping
around it:

- before it, on the host: the recall buffer made or kept, the prefetch queued into it waited for on the device,
  the host slots' mirror and the slabs' address tables made (so the run itself allocates nothing it must
  read later, and reads nothing back);
- the run itself, `_decode_launches`: launches only, no host state changed, so that a CUDA graph may replay
  it (`kvtier.engine.graphs`);
- after it, on the host: the step's choice noted, the pool's count (in `commit`), the counters, the events that
  say the pinned storages are being read, and, where the step's work is run eagerly, the prefetch of the
  next-ranked pages on the side stream (`_prefetch`: it overlaps the other layers' compute).

Where the steps are captured as CUDA graphs (`_prefetches_in_step`), the prefetch is the run's last two launches
instead, on the step's stream, after the step's attention has read its pages: the host then pays nothing for it
(a prefetch of its own on the side stream cost the host its stream switch, events, key, input copy and replay,
about as much as the rest of the replayed step on an H200), and a step bound by the host leaves the device
time for those copies. Either way the plan and the copy are the same launches, so the buffer ends each step the
same.

The key under which a run is captured holds every address and scalar the run's launches use: two steps with
the same key issue the same launches (`tests/integration/test_decode_launches_repeat.py` holds them to it).
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import native
from ..recall import grouped, select_pages
from ..scoring import checked_scores
from .attention import finish_with_lse, merge_with_lse, sink_part
from .graphs import KeyOnce, StepKey, shapes


class DeviceDecoding:
    """The decode step on the device, a part of `LayerEngine` (uses its pool, index, table, recall buffer,
    transfers, counters and `graphs`)."""

    def _decode_on_device(self, query: torch.Tensor, scale: float, softcap: float | None,
                          sinks: torch.Tensor | None) -> torch.Tensor:
        """A decode step's attention over the device entries, its own token and the recalled pages:
        ``[1, 1, q_heads, dim]`` in the query's dtype (the graph's own tensor where one was replayed: read it
        within the step). Where `write` left it the step's scoring and staging (`_writes_in_attention`), they
        run here first, and the step's score is committed on the device after, in the same run of launches."""
        p = self.pending
        writes = not p.staged
        inputs = (query, p.k, p.v) if writes else (query,)
        if writes:   # what a step planned whole before the model runs (`plan_steady`) assumes of the next one
            self._steady_how = (scale, sinks, softcap, *(shapes(t) for t in inputs))
        # a step on a layer with disk pages reads its choice back: its launches are not replayed, and its prefetch
        # is queued after them, from the table as the step leaves it (a promotion round may have moved pages)
        disk = self.holds_disk_pages()
        run, sources, recall_key = self._prepare_decode(scale, softcap, sinks, p.pos if writes else None,
                                                        self._prefetches_in_step() and not disk)
        buf, spare, ahead = run[3], run[5], run[11]
        try:
            if disk:   # counted among the steps run eagerly, once it ran (as `StepGraphs` counts its own)
                out, ids, shortlist = self._decode_launches(run, *inputs)
                self.graphs.eager += 1
            else:
                out, ids, shortlist = self.graphs.run(lambda: self._decode_key(tuple(map(shapes, inputs)), run,
                                                                               recall_key()), inputs,
                                                      lambda *given: self._decode_launches(run, *given))
        except BaseException:   # the table may name pages whose copy never ran: the next step starts a new buffer
            self._forget_recalled()
            self.pool.forget_at()
            raise
        if writes:   # the host's part of what the launches did: scored and staged, the score committed
            p.staged = p.placed = True
        self._decoded(ids, writes)
        if spare and not ahead and shortlist.shape[1] > ids.shape[1]:   # else nothing is ranked after the choice
            if disk:
                sources, recall_key = self._sources(), None
            self._prefetch(buf, shortlist[:, :buf.pages], sources, recall_key)
        return out

    def _prepare_decode(self, scale: float, softcap: float | None, sinks: torch.Tensor | None,
                        positions: torch.Tensor | None, in_step: bool) -> tuple[tuple, tuple, Callable[[], StepKey]]:
        """The host's part of a decode step before its launches: the recall buffer made or kept, the prefetch
        queued into it waited for on the device, the host slots' mirror and the address tables made. Returns
        ``(run, sources, recall_key)``: `_decode_launches`' arguments (`positions`: the step's, where its launches
        score and stage its entry; `in_step`: its prefetch at their end where the buffer has spare slots), the
        sources of its copy, and `_recall_key` of them, made once on first use (the step's key and its
        prefetch's share it). Changes nothing a step's outcome depends on: what it makes, any step would."""
        r = min(self.cfg.recall_pages, self.index.n)
        buf = self._recall_buffer(r, on_device=True)
        self._await_prefetch()
        sources = self._sources()
        spare = buf.pages > r
        if positions is not None:
            self._nan_max()   # made before the launches: kept from step to step
        run = (scale, softcap, sinks, buf, sources, spare, self.pool.counted(1), self.pool.addresses(),
               self.index.bounds.addresses(self.device), self.index.codes.addresses(self.device),
               positions, spare and in_step)
        return run, sources, KeyOnce(lambda: self._recall_key(buf, sources))

    def _decoded(self, ids: torch.Tensor, writes: bool) -> None:
        """The host's part of a decode step after its launches are queued: the NaN check's buffer noted, the
        step's choice, the counters, the marks that say the index and the pinned storages are being read."""
        if writes:
            self._nan = self._nan_buf
        self.last_recall = ids
        self.counters.recall_steps += 1
        self.index.note_reads()
        self.host.read_on(self.device)

    def _prefetches_in_step(self) -> bool:
        """Whether a step's prefetch is the end of its own run of launches (`prefetch_in_step`; by default where
        the steps are captured as CUDA graphs, while none failed) rather than queued on the side stream."""
        if self.prefetch_in_step is not None:
            return self.prefetch_in_step
        g = self.graphs
        return g is not None and g.enabled and g.failed is None

    def _decode_launches(self, run: tuple, query: torch.Tensor, k: torch.Tensor | None = None,
                         v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's launches: ``(attention out, chosen pages, short list)``. With the step's keys and values,
        first their scores, the NaN check's running maximum and their staging in the pool, and last the score's
        commit. Reads the engine's storages, writes the pool, the recall buffer and the device counters, and
        changes no host state (the addresses are made by the caller; they are passed only to say what the run
        reads). With `ahead` in `run`, the run ends with the prefetch of the pages ranked after the choice.
        Where the layer has pages on disk, the plan reads the choice back and reads the chosen disk pages first
        (`_read_disk_pages`): the run then waits for the device once and is run eagerly, never replayed."""
        scale, softcap, sinks, buf, sources, spare, counted, pool_addresses, _, _, positions, ahead = run
        H = self.heads
        if k is not None:
            score = checked_scores(self.scorer, k, v, positions, self.layer_idx, check_nan=False)[0]
            torch.maximum(self._nan_buf, score, out=self._nan_buf)
            self.pool.stage(k, v, positions.expand(H, 1))
        packed = query.reshape(H, query.shape[1] // H, query.shape[3])
        out, lse = native.attend_slabs(packed, self.pool.k, self.pool.v, self.pool.count + 1, scale,
                                       addresses=pool_addresses, counted=counted, softcap=softcap)
        parts = [(out[None], lse[None])]
        if sinks is not None:
            parts.append(sink_part(sinks, H, 1, query.shape[3]))
        # what the step reads anyway: its log-sum-exp is the rest of the softmax's total, which the choice needs
        resident = parts[0][1][0] if len(parts) == 1 else \
            torch.logsumexp(torch.stack([lse[0] for _, lse in parts]), dim=0)
        ids, shortlist = select_pages(grouped(query, H), self.index, self.cfg.recall_pages, scale,
                                      resident_lse=resident, note=False)
        plan = self._plan_and_copy(buf, ids, sources, spare, note=False, shortlist=shortlist)
        whole = parts[0] if len(parts) == 1 else merge_with_lse(parts, kernels=True)
        out, lse = native.attend_pages(packed, buf.k, buf.v, plan.where, self.cfg.page_size, scale,
                                       whole=(whole[0][0], whole[1][0]), softcap=softcap)
        if k is not None:
            self.pool.commit_launches(score)
        if ahead and shortlist.shape[1] > ids.shape[1]:   # the choice read: the next-ranked pages into spare slots
            self._plan_and_copy(buf, shortlist[:, :buf.pages], sources, spare, note=False, prefetch=True)
        return finish_with_lse([(out[None], lse[None])], query)[0], ids, shortlist

    def _decode_key(self, inputs: tuple[tuple, ...], run: tuple, recall_key: StepKey) -> StepKey:
        """Every tensor and scalar `_decode_launches` bakes into its launches, for `run` (its arguments) and its
        inputs (copied into a graph's own buffers: `inputs` are their `shapes`), with `recall_key` (`_recall_key`
        of the run's buffer and sources): two steps with the same key issue the same launches."""
        (scale, softcap, sinks, buf, sources, spare, (at, base), pool_addresses, bounds_at, codes_at, positions,
         ahead) = run
        pool, index = self.pool, self.index
        pool_addresses = pool_addresses or ()
        held = (
            pool.k[0], pool.v[0], *pool_addresses, at,   # the device pool: slabs, address tables, count
            index.bounds.slabs[0], index.codes.slabs[0], bounds_at, codes_at,   # the recall index likewise
        )
        values = (
            *inputs, scale, softcap, spare, ahead,
            # the model's sinks by address (a caller may hand a new tensor at the same place every step)
            None if sinks is None else (sinks.data_ptr(), *shapes(sinks)), len(pool.k), len(pool_addresses), base,
            index.n, index.uses_kernels, len(index.bounds.slabs), len(index.codes.slabs),
            self.cfg.recall_pages, self.table.n,   # the pages asked and demoted
        )
        if positions is not None:   # the step's entry: where it goes, its score, the scorer, the NaN check
            s = pool.count // pool.slab_tokens
            held += (positions, self.scorer, self._nan_buf, pool.k[s], pool.v[s], pool.pos[s], pool.score[s])
            values += (s, (pool.count + 1) % pool.slab_tokens != 0)
        # then the recall: the copy's buffer, sources and counters
        return StepKey(held + recall_key.held, values + recall_key.values)
