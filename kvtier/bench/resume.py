"""A conversation coming back from disk or host memory: the time from its return to its first token, with its
parked layers restored on demand at that step, or read back ahead (`TieredCache.prefetch_parked`; on the host,
their host slabs filled ahead) while the application waited.

Every row starts from a copy of the same prefilled cache (`copy.deepcopy`), parked (on disk, or in host memory)
and, for a cold disk, dropped from the operating system's page cache before the clock starts; the rows take
turns round by round, so a drift in the machine's speed meets them alike. A row of copies never parked gives the
step's own cost. Every row must give the same logits, bit for bit.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import CapacityError
from ..integrations.hf import cache_kwargs


@dataclass
class ResumeRow:
    name: str
    think_seconds: float | None        # None: restored on demand; for the row never parked, nothing to restore
    parked: str | None                 # where the conversation waits ("host", "disk"), None: never parked
    first_token_seconds: list[float] = field(default_factory=list)   # per round: return -> the step's logits
    restore_seconds: list[float] = field(default_factory=list)       # per round: return -> every layer back
    waited_seconds: list[float] = field(default_factory=list)        # per round: the restore waiting for reads
    layers_read_ahead: list[int] = field(default_factory=list)

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.first_token_seconds)


def drop_from_page_cache(folder: str) -> None:
    """Write every file of a cache's private folder back and drop it from the page cache (Linux), so that the
    next reads come from the disk itself."""
    if not hasattr(os, "posix_fadvise"):
        raise CapacityError("dropping files from the page cache needs posix_fadvise (Linux); not available here")
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rows_for(thinks: list[float]) -> list[ResumeRow]:
    """The rows a run times: never parked; parked on the host, restored on demand and with its host slabs filled
    ahead for each think time; parked on disk, restored on demand and read ahead for each think time."""
    rows = [ResumeRow("never parked", None, parked=None), ResumeRow("parked on the host", None, parked="host")]
    rows += [ResumeRow(f"host, prefetch {t * 1000:g} ms later", t, parked="host") for t in thinks]
    rows.append(ResumeRow("restored on demand", None, parked="disk"))
    rows += [ResumeRow(f"prefetch, {t * 1000:g} ms later", t, parked="disk") for t in thinks]
    return rows


@torch.no_grad()
def compare_resume(model: Any, prompt: torch.Tensor, make_cache: Callable[[], Any], thinks: list[float],
                   rounds: int, cold: bool, progress: Callable[[str], None] | None = None
                   ) -> tuple[list[ResumeRow], bool, dict]:
    """Prefill `prompt` once into `make_cache()`, then time, for `rounds` rounds, each row's first step after the
    conversation's return (the next token after the prompt), and apart, within it, the restore (`resume()`, called
    first, as an application's `SessionStore.resume` would be: what the step would otherwise do first). Returns the
    rows, whether every row's logits were
    the same bits, and `stats()` by name: "prefilled" (the cache that ran the prompt), "copy" (a row's copy of it,
    live, as each row starts: the copy packs its host pages into slabs of its own), "host" and "disk" (such a
    copy parked there: what a restore reads)."""
    say = progress or (lambda s: None)
    master = make_cache()
    try:
        logits = model(prompt, **cache_kwargs(master)).logits[:, -1:]
        token = logits.argmax(-1)
        rows = rows_for(thinks)
        reference, identical, parked_stats = None, True, {"prefilled": master.stats()}
        for r in range(rounds):
            for row in rows:
                cache = copy.deepcopy(master)
                try:
                    last = r == rounds - 1   # the memory figures are the last round's (outside the clock)
                    if last:
                        parked_stats["copy"] = cache.stats()
                    if row.parked is not None:
                        cache.park(row.parked)
                        if last:
                            parked_stats[row.parked] = cache.stats()
                    if cold and cache.disk_path is not None:
                        drop_from_page_cache(cache.disk_path)
                    if row.think_seconds is not None:
                        cache.prefetch_parked()
                        time.sleep(row.think_seconds)    # the application waits for its user; the reads go on
                    start = time.perf_counter()
                    cache.resume()   # what the step's first layer would do, timed on its own
                    if prompt.is_cuda:
                        torch.cuda.synchronize(prompt.device)
                    row.restore_seconds.append(time.perf_counter() - start)
                    out = model(token, **cache_kwargs(cache)).logits
                    if out.is_cuda:
                        torch.cuda.synchronize(out.device)
                    row.first_token_seconds.append(time.perf_counter() - start)
                    resumed = cache.stats()["resume_prefetch"]
                    row.waited_seconds.append(resumed["wait_seconds"])
                    row.layers_read_ahead.append(resumed["layers"])
                finally:
                    cache.close()
                if reference is None:
                    reference = out
                identical = identical and torch.equal(out, reference)
                say(f"  round {r + 1}/{rounds}  {row.name:<30}{row.first_token_seconds[-1] * 1000:9.1f} ms (restore "
                    f"{row.restore_seconds[-1] * 1000:.1f} ms)")
        return rows, identical, parked_stats
    finally:
        master.close()
