"""Copies on dedicated CUDA streams, one per direction, so they overlap compute.

Each job is ordered after the work already queued on the current stream (its source is ready), runs
on its direction's stream, and records an event. ``wait`` makes the current stream wait on the event
for copies into device memory (no host stall), and blocks the host for copies into host memory (the
host is about to read them). Events come from a pool and are reused.

`run_ahead` puts device work (a recall's plan and copies) on a side stream of its own: it starts once the
current stream has done what was queued before the call and overlaps whatever is queued after; the tensors it
touches are marked as used by that stream, so the allocator keeps them until it is done.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Iterable, Sequence

import torch

from ..errors import NativeUnavailableError, TransferError
from .base import TransferCounters, direction


class CudaTransferManager:
    """Asynchronous copies between pinned host memory and one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise NativeUnavailableError("CudaTransferManager needs a CUDA device; use SyncTransferManager")
        self.device = torch.device(device)
        self.counters = TransferCounters()
        self._streams = {d: torch.cuda.Stream(device=self.device) for d in ("h2d", "d2h", "d2d", "ahead")}
        self._ids = itertools.count(1)
        self._jobs: dict[int, tuple[str, torch.cuda.Event]] = {}
        self._spare: list[torch.cuda.Event] = []
        # one event re-recorded on the current stream whenever a side stream must start after what it queued: a
        # wait takes the event's state when it is queued, so re-recording it later moves no earlier wait (where
        # `Stream.wait_stream` makes and destroys an event every time, a driver call each way). One manager serves
        # one device (an indexed one: the tensors' own) from one thread, as every transfer manager here does.
        self._fence = torch.cuda.Event()

    def _after_current(self, stream: torch.cuda.Stream) -> torch.cuda.Stream:
        """Order `stream` after the work queued so far on the current stream; returns the current stream."""
        current = torch.cuda.current_stream(self.device)
        self._fence.record(current)
        stream.wait_event(self._fence)
        return current

    def submit(self, dst: torch.Tensor, src: torch.Tensor) -> int:
        kind = direction(src, dst)
        if kind == "h2h":
            dst.copy_(src)
            self.counters.bytes[kind] += src.numel() * src.element_size()
            self.counters.jobs += 1   # counted as the synchronous manager counts it
            return next(self._ids)
        if kind in ("h2d",) and not src.is_pinned():
            raise TransferError("host-to-device copies need pinned source memory for true async DMA")
        stream = self._streams[kind]
        self._after_current(stream)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = self._spare.pop() if self._spare else torch.cuda.Event()
            event.record(stream)
        for t in (src, dst):
            if t.is_cuda:
                t.record_stream(stream)
        job = next(self._ids)
        self._jobs[job] = (kind, event)
        self.counters.bytes[kind] += src.numel() * src.element_size()
        self.counters.jobs += 1
        return job

    def run_ahead(self, work: Callable[[], None], uses: Sequence[torch.Tensor] = ()) -> int:
        stream = self._streams["ahead"]
        current = self._after_current(stream)
        event = self._spare.pop() if self._spare else torch.cuda.Event()
        failed = True
        try:
            with torch.cuda.stream(stream):
                work()
            failed = False
        finally:   # what `work` queued before any failure is still kept alive, and ordered before what follows
            event.record(stream)
            for t in uses:
                if t.is_cuda:
                    t.record_stream(stream)
            if failed:
                current.wait_event(event)
        job = next(self._ids)
        self._jobs[job] = ("ahead", event)
        self.counters.jobs += 1
        return job

    def wait(self, job_ids: Iterable[int]) -> None:
        start = time.perf_counter()
        current = torch.cuda.current_stream(self.device)
        for job in job_ids:
            entry = self._jobs.pop(job, None)
            if entry is None:
                continue
            kind, event = entry
            if kind == "d2h":
                event.synchronize()
            else:
                current.wait_event(event)
            self._spare.append(event)
        self.counters.wait_seconds += time.perf_counter() - start

    def order_after(self, job_ids: Iterable[int]) -> None:
        """The current stream waits for the jobs' events on the device; the jobs stay for a later `wait`."""
        current = torch.cuda.current_stream(self.device)
        for job in job_ids:
            entry = self._jobs.get(job)
            if entry is not None:
                current.wait_event(entry[1])

    def done(self, job_id: int) -> bool:
        entry = self._jobs.get(job_id)
        return entry is None or entry[1].query()

    def close(self) -> None:
        for kind, event in self._jobs.values():
            event.synchronize()
        self._jobs.clear()
