"""Rows kept in fixed-size slabs: storage that grows by adding a slab, never by copying what it holds.

A growing tensor that is reallocated and copied costs a full copy at every growth, briefly holds twice the
memory, and (pinned, on CUDA) leaves the caching allocator with blocks rounded up to powers of two. Slabs
are allocated as needed and released on `close`; a row's address never changes.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import CapacityError


class SlabRows:
    """Rows of shape `row_shape` in slabs of `rows_per_slab` rows.

    Parameters
    ----------
    row_shape
        Shape of one row (e.g. ``(page_size, head_dim)`` for a page of one head).
    dtype, device
        Storage type and place.
    rows_per_slab
        Rows per slab; a slab is one allocation.
    pin
        Pin host slabs (page-locked, for true DMA to a GPU).
    """

    def __init__(self, row_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                 rows_per_slab: int, pin: bool = False) -> None:
        self.row_shape, self.dtype, self.device = tuple(row_shape), dtype, torch.device(device)
        self.rows_per_slab, self.pin = max(1, int(rows_per_slab)), pin
        self.slabs: list[torch.Tensor] = []

    @property
    def capacity(self) -> int:
        return len(self.slabs) * self.rows_per_slab

    def ensure(self, rows: int) -> None:
        """Add slabs until `rows` rows fit."""
        while self.capacity < rows:
            shape = (self.rows_per_slab, *self.row_shape)
            try:
                slab = torch.empty(shape, dtype=self.dtype, device=self.device,
                                   pin_memory=self.pin and self.device.type == "cpu")
            except RuntimeError as e:
                kind = "pinned host" if self.pin else self.device.type
                raise CapacityError(f"could not allocate a {kind} slab of {list(shape)} {self.dtype}: {e}; "
                                    "check free memory (and `ulimit -l`, the memlock limit, for pinned memory)"
                                    ) from e
            self.slabs.append(slab)

    def _groups(self, rows: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(slab, positions in rows, offsets in the slab)`` for each slab that `rows` touches."""
        r = rows.cpu().numpy()
        slab, off = np.divmod(r, self.rows_per_slab)
        order = np.argsort(slab, kind="stable")
        edges = np.searchsorted(slab[order], np.arange(len(self.slabs) + 1))
        out = []
        for s in range(len(self.slabs)):
            a, b = edges[s], edges[s + 1]
            if a < b:
                pos = order[a:b]
                out.append((s, torch.from_numpy(pos).to(rows.device), torch.from_numpy(off[pos]).to(rows.device)))
        return out

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``[n]`` (int64, on this storage's device) as ``[n, *row_shape]`` (into `out` when given).

        Copies run by run of rows in one slab: rows sorted by slab (or mostly so) gather in a few calls.
        """
        if len(self.slabs) == 1:
            return torch.index_select(self.slabs[0], 0, rows, out=out) if out is not None else \
                torch.index_select(self.slabs[0], 0, rows)
        if out is None:
            out = torch.empty((rows.shape[0], *self.row_shape), dtype=self.dtype, device=self.device)
        r = rows.cpu().numpy()
        slab, off = np.divmod(r, self.rows_per_slab)
        edges = np.flatnonzero(np.diff(slab)) + 1
        starts, ends = np.r_[0, edges], np.r_[edges, len(r)]
        if len(starts) > 8 + 2 * len(self.slabs):   # scattered: one grouped pass per slab instead
            for s, pos, o in self._groups(rows):
                out.index_copy_(0, pos, torch.index_select(self.slabs[s], 0, o))
            return out
        off_t = torch.from_numpy(off).to(rows.device)
        for a, b in zip(starts.tolist(), ends.tolist()):
            torch.index_select(self.slabs[int(slab[a])], 0, off_t[a:b], out=out[a:b])
        return out

    def scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` ``[n, *row_shape]`` at rows ``[n]``."""
        values = values.to(self.dtype)
        if len(self.slabs) == 1:
            self.slabs[0].index_copy_(0, rows, values)
            return
        for s, pos, off in self._groups(rows):
            self.slabs[s].index_copy_(0, off, torch.index_select(values, 0, pos))

    def spans(self, n: int) -> list[tuple[int, torch.Tensor]]:
        """``(first row, view)`` for the slabs covering rows ``[0, n)`` (the last view cut at `n`)."""
        out = []
        for i, slab in enumerate(self.slabs):
            start = i * self.rows_per_slab
            if start >= n:
                break
            out.append((start, slab[:n - start]))
        return out

    def nbytes(self) -> int:
        """Bytes allocated (all slabs)."""
        return sum(s.numel() * s.element_size() for s in self.slabs)

    def close(self) -> None:
        self.slabs = []
