"""An independent copy of one layer's cache, for ``copy.deepcopy(cache)``: the prefix-reuse pattern (prefill
a shared prompt once, copy the cache for each continuation).

Everything is copied tier by tier: the device entries, the recall index, the page table, and every host and
disk page into the copy's own pools and disk store, so the two caches share no storage and either can be
closed, reset or parked without the other noticing. A parked layer is not copied (its pages are mid-move).
"""

from __future__ import annotations

import numpy as np

from ..errors import UnsupportedError
from ..placement.page_table import DISK, EMPTY, HOST
from .layer import LayerEngine

_PAGES_PER_BATCH = 1024   # pages moved at a time, so a copy's extra memory stays bounded
_SWITCHES = ("device_recall", "select_kernels", "defer_nan", "write_in_attention", "prefetch_in_step", "cuda_graphs",
             "promote_every", "host_slab_bytes")


def copy_layer(src: LayerEngine, dst: LayerEngine) -> None:
    """Make the fresh engine `dst` hold what `src` holds (`src` is only read; its pending step is placed first)."""
    if src.parked is not None:
        raise UnsupportedError(f"copy.deepcopy of a parked TieredCache (layer {src.layer_idx} is parked in "
                               f"{src.parked.where}); call cache.resume() first")
    for name in _SWITCHES:   # the path its steps take (`take_gpu_path`, tests), read by `_init` and each step
        setattr(dst, name, getattr(src, name))
    src.flush()
    src.table.settle()     # the source's host pages and index codes are read below: its copies must have landed
    src.settle_counts()
    if src.pool is None:
        return
    dst._init(src.device, src.dtype)
    n = src.pool.count
    k, v = src.pool.contiguous(n)
    pos, score = src.pool.meta()
    dst.pool.replace(k[0].clone(), v[0].clone(), pos.clone(), score.clone())
    dst.seen = src.seen
    dst._masked_positions = src._masked_positions.copy()
    if src.index is not None:
        dst.index.load_state(src.index.state())
    dst.table.copy_from(src.table)
    # until a page is copied, the copy's table names no slot of its own: one that failed midway frees only what
    # it copied (the source's slot numbers mean nothing in the copy's stores); its host pages get no clean copies
    heads, pids = np.nonzero(dst.table.tier != EMPTY)
    dst.table.place(heads, pids, EMPTY, np.full(len(heads), -1, dtype=np.int64))
    if src._ring_made:   # the same ring, so the copy sets the same host room aside
        dst._disk(ring_pages=src._readahead_pages())
    for tier in (HOST, DISK):
        heads, pids = src.table.pages_in(tier)
        for i in range(0, len(heads), _PAGES_PER_BATCH):
            h, p = heads[i:i + _PAGES_PER_BATCH], pids[i:i + _PAGES_PER_BATCH]
            _copy_pages(src, dst, tier, h.astype(np.int64), p.astype(np.int64))
    if src._nan is not None:        # a NaN-score check still waiting (CUDA) waits in the copy too
        dst._nan = dst._nan_buf = src._nan.clone()
    if src.readahead is not None and dst.readahead is not None:
        for name in ("hits", "misses", "read_ahead", "steps_paused"):
            setattr(dst.readahead, name, getattr(src.readahead, name))
    for mine, theirs in ((dst.graphs, src.graphs), (dst.prefetch_graphs, src.prefetch_graphs)):
        if mine is not None and theirs is not None:   # what ran how (`stats()["cuda_graphs"]`), not the graphs
            mine.captures, mine.replays, mine.eager = theirs.captures, theirs.replays, theirs.eager
    dst._recall_clock = src._recall_clock
    dst._spill_wait, dst._spill_failures = src._spill_wait, src._spill_failures   # a disk that refused pages
    dst.layout_kept = src.recall_layout()   # the copy's first recall buffer holds the same pages in the same slots


def _copy_pages(src: LayerEngine, dst: LayerEngine, tier: int, heads: np.ndarray, pids: np.ndarray) -> None:
    slots = src.table.lookup(heads, pids)[1]
    if tier == HOST:
        k, v = src.host.load(slots)
        new = dst.host.store(k, v)
    else:
        k, v = src.disk.load(slots)
        new = dst._disk().store(k, v)
    dst.table.place(heads, pids, tier, np.asarray(new, dtype=np.int64))


def clone_counters(src, dst) -> None:
    """Carry the move counters over, so the copy's `stats()` tell the same history."""
    dst.bytes_moved.update(src.bytes_moved)
    dst.pages_recalled.update(src.pages_recalled)
    for name in ("recall_steps", "pages_reused", "pages_prefetched", "prefetch_used", "pages_promoted",
                 "pages_dropped_clean", "promotions_skipped", "spills_deferred", "spill_error", "tokens_dropped",
                 "demotions", "tokens_masked", "disk_wait_seconds", "copy_wait_seconds", "layers_read_before_resume",
                 "resume_reads_failed", "resume_wait_seconds"):
        setattr(dst, name, getattr(src, name))
    dst.rings_closed = dict(src.rings_closed)

