"""`ReadMark` off CUDA: reads by CPU work are done when queued, so nothing is noted or waited for."""

from __future__ import annotations

import torch

from kvtier.transfer.read_mark import ReadMark


def test_nothing_is_noted_off_cuda():
    mark = ReadMark()
    mark.note(torch.device("cpu"))
    assert not mark.pending and mark._event is None
    mark.synchronize()   # nothing to wait for
    assert not mark.pending
