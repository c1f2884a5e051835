"""Timing and the plumbing every measurement shares: a clock that waits for the device, progress on
stderr, rows that fail becoming skipped rows (so the run still writes its JSON), units and rounding.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from typing import Any, Callable, Iterable

import torch

GiB, MiB = 2**30, 2**20


class Clock:
    """Wall-clock timing that waits for the device first and last (CUDA), or plain (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], Any]) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def time_parts(self, fn: Callable[[], Any], streams: Iterable[Any] = ()) -> dict[str, float | None]:
        """`fn()` timed three ways: ``seconds`` on the wall clock until the device is done (as `time`),
        ``issue_seconds`` until `fn` returned, and ``device_seconds`` between CUDA events recorded on the
        current stream before the call and after it, once that stream has waited for `streams` (where `fn`
        queues work of its own; None off CUDA). The device's figure leaves out the host's work after the last
        launch, not the time the device waited for the host to issue the first ones."""
        self.sync()
        start = end = None
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(self.device))
        t0 = time.perf_counter()
        fn()
        issue = time.perf_counter() - t0
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            for stream in streams:
                current.wait_stream(stream)
            end.record(current)
        self.sync()
        wall = time.perf_counter() - t0
        device = start.elapsed_time(end) / 1e3 if self.cuda else None
        return {"seconds": wall, "issue_seconds": issue, "device_seconds": device}


class Progress:
    """Progress lines and bars on stderr (tqdm); silent when disabled."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled, self.start = enabled, time.perf_counter()

    def say(self, message: str) -> None:
        if self.enabled:
            from tqdm import tqdm

            tqdm.write(f"[{time.perf_counter() - self.start:7.1f} s] {message}", file=sys.stderr)

    def bar(self, items: Iterable, desc: str, total: int | None = None) -> Iterable:
        from tqdm import tqdm

        return tqdm(items, desc=desc, total=total, file=sys.stderr, disable=not self.enabled, leave=False)


class Skip(Exception):
    """A row that does not apply here (e.g. offloading on cpu): recorded as skipped with this reason."""


def _free(device: torch.device, host: bool = False) -> str | None:
    """Give cached device memory back (and, with `host`, the pinned blocks torch's host allocator caches); None,
    or why it could not (a device left in an error state by a failed row fails every later call: the rows after
    it are then recorded as failed, and the JSON is still written)."""
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            empty_host = getattr(torch._C, "_host_emptyCache", None)
            if host and empty_host is not None:
                empty_host()
        except RuntimeError as e:
            return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return None


def _attempt(what: str, fn: Callable[[], dict[str, Any]], device: torch.device,
             progress: Progress) -> dict[str, Any]:
    """Run one row; a failure (out of memory, a missing feature, a bug in one row) becomes a skipped row with
    its reason, so the other rows still run and the JSON is still written."""
    try:
        return fn()
    except Exception as e:   # recorded in the output, never swallowed silently
        text = " ".join(str(e).split())[:400]
        reason = text if isinstance(e, Skip) else f"{type(e).__name__}: {text}"
        stuck = _free(device)
        if stuck is not None:
            reason += f"; the device could not be freed after it ({stuck})"
        progress.say(f"{what}: skipped ({reason})")
        return {"skipped": reason}


def _gbps(nbytes: float, seconds: float) -> float | None:
    return None if seconds <= 0 else nbytes / seconds / 1e9


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(float(x), digits)
