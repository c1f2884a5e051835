"""The transfer protocol: copies between tiers as jobs with ids.

Primitives (after vLLM's offloading handlers): ``submit(dst, src) -> job id`` starts ``dst.copy_(src)``;
``wait(ids)`` makes the current stream (or the host, for copies into host memory) wait until those jobs
are done; ``done(id)`` polls. ``run_ahead(work, uses)`` runs device work (a plan and the copies it makes) on
a side stream after what the current stream has queued so far, so it overlaps the compute queued next; its
job id is waited for like a copy's. ``order_after(ids)`` makes the current stream wait for those jobs on
the device only, even copies into host memory, whose host-side wait can then come later. Each manager
counts the bytes and the seconds spent waiting. The manager moves data; it never decides what to move.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence

import torch


def direction(src: torch.Tensor, dst: torch.Tensor) -> str:
    """``"h2d"``, ``"d2h"``, ``"d2d"`` or ``"h2h"``, by where the tensors live."""
    s = "h" if src.device.type == "cpu" else "d"
    d = "h" if dst.device.type == "cpu" else "d"
    return f"{s}2{d}"


@dataclass
class TransferCounters:
    """Bytes per direction and seconds the caller was blocked waiting for copies."""

    bytes: dict[str, int] = field(default_factory=lambda: {"h2d": 0, "d2h": 0, "d2d": 0, "h2h": 0})
    jobs: int = 0
    wait_seconds: float = 0.0


class TransferManager(Protocol):
    """Copies between the device and host tiers (see the module docstring)."""

    counters: TransferCounters

    def submit(self, dst: torch.Tensor, src: torch.Tensor) -> int: ...

    def run_ahead(self, work: Callable[[], None], uses: Sequence[torch.Tensor] = ()) -> int: ...

    def wait(self, job_ids: Iterable[int]) -> None: ...

    def order_after(self, job_ids: Iterable[int]) -> None: ...

    def done(self, job_id: int) -> bool: ...

    def close(self) -> None: ...
