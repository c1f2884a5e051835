"""A synchronous transfer manager: the CPU-only twin of the CUDA one, same interface."""

from __future__ import annotations

import itertools
from typing import Callable, Iterable, Sequence

import torch

from .base import TransferCounters, direction


class SyncTransferManager:
    """Copies at once on submit; waiting is free. Used where there is no CUDA device."""

    def __init__(self) -> None:
        self.counters = TransferCounters()
        self._ids = itertools.count(1)

    def submit(self, dst: torch.Tensor, src: torch.Tensor) -> int:
        dst.copy_(src)
        self.counters.bytes[direction(src, dst)] += src.numel() * src.element_size()
        self.counters.jobs += 1
        return next(self._ids)

    def run_ahead(self, work: Callable[[], None], uses: Sequence[torch.Tensor] = ()) -> int:
        """Run `work` now: without a side stream, ahead of need means before the caller goes on."""
        work()
        self.counters.jobs += 1
        return next(self._ids)

    def wait(self, job_ids: Iterable[int]) -> None:
        return None

    def order_after(self, job_ids: Iterable[int]) -> None:
        return None

    def done(self, job_id: int) -> bool:
        return True

    def close(self) -> None:
        return None
