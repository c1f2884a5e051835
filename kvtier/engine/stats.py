"""Counters shared by the layers of one cache: what moved where, what was recalled, how long we waited."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..tiers.readahead import COUNTS

MOVES = ("device_to_host", "host_to_disk", "host_to_device", "disk_to_device")


@dataclass
class MoveCounters:
    """Bytes moved between tiers, pages recalled, tokens dropped, seconds blocked on copies and reads."""

    bytes_moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MOVES, 0))
    pages_recalled: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    recall_steps: int = 0
    pages_reused: int = 0        # chosen pages already on the device when chosen (kept or prefetched)
    pages_prefetched: int = 0    # pages brought up ahead of need (counted in pages_recalled too)
    prefetch_used: int = 0       # of those, pages a later step chose
    pages_promoted: int = 0      # disk pages recall brought up that the host tier then kept
    pages_dropped_clean: int = 0  # host pages moved down to their clean disk copy, unwritten
    promotions_skipped: int = 0   # rounds stopped by a full disk or no memory (pages stay where each move left them)
    spills_deferred: int = 0     # moves of host pages to disk the disk refused (the pages stayed on the host)
    spill_error: str | None = None   # what the last one said
    tokens_dropped: int = 0
    demotions: int = 0           # demotions (or drops) from the device tier, summed over layers
    tokens_masked: int = 0       # padding the attention mask left out, never stored
    disk_wait_seconds: float = 0.0
    copy_wait_seconds: float = 0.0   # waits on copies of transfer managers let go (at close; an original's, in a copy)
    layers_read_before_resume: int = 0    # parked layers restored from reads made ahead (`TieredCache.prefetch_parked`)
    resume_reads_failed: int = 0          # of those reads, the ones that failed (the restore read them again)
    resume_wait_seconds: float = 0.0      # restores waiting for reads made ahead to finish
    # the read-ahead rings' counts when they were let go (`LayerEngine.close`, `DiskReadAhead.counts`)
    rings_closed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))

    def reset(self) -> None:
        self.__init__()
