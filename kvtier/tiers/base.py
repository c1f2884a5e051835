"""The tier protocol: what the engine may ask of any tier below the device.

A tier holds pages (``page_size`` entries of one KV head: keys and values) in numbered slots. Five calls:
``store(k, v) -> slots`` puts pages in (all or nothing), ``load(slots, out) -> (k, v)`` reads them back,
``free(slots)`` gives slots up, ``nbytes()`` is what it holds and ``close()`` releases everything. Which page
lives in which slot of which tier is the page table's business, not the tier's: a tier never decides.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class Tier(Protocol):
    """One level of the hierarchy below the device (host memory, disk)."""

    name: str

    def store(self, k: torch.Tensor, v: torch.Tensor) -> np.ndarray:
        """Keep pages ``k, v`` ``[n, page_size, head_dim]``; returns their slots ``[n]`` int64."""
        ...

    def load(self, slots: np.ndarray,
             out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages in `slots`, ``[n, page_size, head_dim]`` each (into `out` when given)."""
        ...

    def free(self, slots: np.ndarray) -> None: ...

    def nbytes(self) -> int: ...

    def close(self) -> None: ...


def slot_numbers(values, what: str, error: type[Exception] = ValueError) -> np.ndarray:
    """`values` as int64 ``[m]``: slot (or row) numbers, which are whole numbers; others are refused with
    `error`, never truncated (``0.9`` would have named slot 0)."""
    arr = np.asarray(values)
    if arr.size and not (np.issubdtype(arr.dtype, np.integer) and arr.dtype != np.bool_):
        raise error(f"{what} must be whole numbers; got an array of {arr.dtype}")
    return arr.astype(np.int64, copy=False).reshape(-1)
