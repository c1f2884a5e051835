"""Decode throughput: TieredCache against DynamicCache, same model, same prompt, same run.

Each cache prefills the same prompt, then decodes greedily for a fixed number of steps; only the decode
steps are timed. Rounds alternate between the caches so drift in machine speed hits both alike.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..integrations.hf import cache_kwargs


@dataclass
class DecodeResult:
    name: str
    seconds: list[float]            # per round
    new_tokens: int
    stats: dict[str, Any] | None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / statistics.median(self.seconds)


@torch.no_grad()
def time_decode(model: Any, input_ids: torch.Tensor, cache: Any, new_tokens: int, warmup: int = 0,
                before_timing: Callable[[], None] | None = None,
                before_step: Callable[[], float | None] | None = None) -> tuple[float, torch.Tensor]:
    """Prefill `input_ids` into `cache`, then time `new_tokens` greedy decode steps (after `warmup` untimed
    ones, then `before_timing`; `before_step` runs before each timed step, outside the timing but for the
    seconds it returns: work the step before left to finish); returns the seconds and the timed steps' tokens."""
    logits = model(input_ids, **cache_kwargs(cache)).logits[:, -1]
    for _ in range(warmup):
        logits = model(logits.argmax(-1, keepdim=True), **cache_kwargs(cache)).logits[:, -1]
    if before_timing is not None:
        before_timing()
    out = []
    sync = (lambda: torch.cuda.synchronize(input_ids.device)) if input_ids.is_cuda else (lambda: None)
    sync()
    seconds, start = 0.0, time.perf_counter()
    for _ in range(new_tokens):
        if before_step is not None:   # outside the timing
            sync()
            seconds += time.perf_counter() - start + (before_step() or 0.0)
            sync()
            start = time.perf_counter()
        nxt = logits.argmax(-1, keepdim=True)
        out.append(nxt)
        logits = model(nxt, **cache_kwargs(cache)).logits[:, -1]
    sync()
    return seconds + time.perf_counter() - start, torch.cat(out, dim=1)


def drop_cached_disk(cache: Any) -> float:
    """A cold disk for the next step: the cache's page file (if it has one) dropped from the page cache, once
    the reads ahead under way have finished; returns the seconds waited for them (the step's own, not the
    drop's: reading ahead gets no free time while the file is written back)."""
    shared = getattr(cache, "_shared", None)
    store = None if shared is None else shared.disk_store
    if store is None:
        return 0.0
    start = time.perf_counter()
    for engine in getattr(cache, "_engines", ()):
        if engine.readahead is not None:
            engine.readahead.settle()
    waited = time.perf_counter() - start
    store.drop_cached()
    return waited


def compare_decode(model: Any, input_ids: torch.Tensor, caches: dict[str, Callable[[], Any]], new_tokens: int,
                   rounds: int = 3, progress: Callable[[str], None] | None = None,
                   before_step: Callable[[Any], float | None] | None = None) -> list[DecodeResult]:
    """Time each cache factory `rounds` times, interleaved; returns one result per cache. `before_step(cache)`
    runs before each timed step, as in `time_decode` (every cache gets it, so the steps compare alike)."""
    results = {name: DecodeResult(name, [], new_tokens, None) for name in caches}
    for r in range(rounds):
        for name, factory in caches.items():
            cache = factory()
            step = None if before_step is None else (lambda c=cache: before_step(c))
            seconds, _ = time_decode(model, input_ids, cache, new_tokens, before_step=step)
            results[name].seconds.append(seconds)
            if hasattr(cache, "stats"):
                results[name].stats = cache.stats()
            if hasattr(cache, "close"):
                cache.close()
            if progress:
                progress(f"round {r + 1}/{rounds} {name}: {new_tokens / seconds:.1f} tokens/s")
    return list(results.values())
