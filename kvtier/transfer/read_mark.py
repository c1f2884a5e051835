"""The end of the last device read of host memory that the host will write again.

Pinned host memory read by kernels (recall reading host pages through their mapping, page choice reading the
pinned codes) may not be overwritten or let go before those kernels ran. Every decode step queues such reads,
so the mark is one CUDA event re-recorded after each (no event made and destroyed every step, which costs the
host a driver call each way): a wait on it waits for the last read noted before the wait, which follows every
earlier read of the same stream, and of any stream that waited for that one.
"""

from __future__ import annotations

import torch


class ReadMark:
    """Where the last noted device read of some host memory ends; nothing is noted off CUDA."""

    def __init__(self) -> None:
        self._event: torch.cuda.Event | None = None   # kept from note to note
        self.device: torch.device | None = None        # the device the event is recorded on
        self.pending = False                           # whether a read was noted since the last `synchronize`

    def note(self, device: torch.device) -> None:
        """Reads queued on `device`'s current stream so far are the last ones (no-op off CUDA)."""
        if device.type != "cuda":
            return
        if self._event is None or self.device != device:
            self._event, self.device = torch.cuda.Event(), device
        self._event.record(torch.cuda.current_stream(device))
        self.pending = True

    def synchronize(self) -> None:
        """Wait on the host until the noted reads are done; then nothing is noted."""
        if self.pending:
            self._event.synchronize()
            self.pending = False

    def order_before(self, stream: torch.cuda.Stream) -> None:
        """Work queued on `stream` from now on runs after the noted reads (they stay noted)."""
        if self.pending:
            stream.wait_event(self._event)
