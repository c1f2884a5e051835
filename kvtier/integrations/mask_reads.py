"""What kvtier's own checks of an attention mask read back from it, kept for the mask's lifetime.

transformers builds a step's mask once and hands that same tensor to every layer of its kind, so a check
whose answer depends only on the mask's values reads them back (a host sync on a GPU) once a step, not once
a layer: 64 reads a step for a 32-layer model with eager attention, whose mask is a 4D float tensor at every
step. The verdicts are keyed on the tensor itself (a weak reference, so a freed mask's id never matches).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch


class MaskVerdicts:
    """The verdict of one check on the last few masks it read (a model's layer kinds each have their mask)."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._seen: list[tuple[weakref.ref, bool]] = []
        self._lock = threading.Lock()

    def verdict(self, mask: torch.Tensor, read: Callable[[torch.Tensor], bool]) -> bool:
        """``read(mask)``, or what it gave for this same tensor before."""
        with self._lock:
            for ref, value in self._seen:
                if ref() is mask:
                    return value
        value = bool(read(mask))
        with self._lock:
            alive = [(ref, v) for ref, v in self._seen if ref() is not None]
            self._seen = (alive + [(weakref.ref(mask), value)])[-self.keep:]
        return value
