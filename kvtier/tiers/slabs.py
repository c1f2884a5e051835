"""Rows kept in fixed-size slabs: storage that grows by adding a slab, never by copying what it holds.

A growing tensor that is reallocated and copied costs a full copy at every growth, briefly holds twice the
memory, and (pinned, on CUDA) leaves the caching allocator with blocks rounded up to powers of two. Slabs
are allocated as needed and released on `close` (or, once emptied, by `shrink`); a row's address never changes.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import native
from ..native.layout import write_rows
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
        self._addresses: tuple[torch.device, int, torch.Tensor | None] | None = None   # (device, slabs, table)

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

    def addresses(self, device: torch.device) -> torch.Tensor | None:
        """The slabs' addresses for kernels on `device` (`kvtier.native.slab_addresses`), kept until the
        slabs change (added, let go, or taken from another storage)."""
        if device.type != "cuda":
            return None
        if self._addresses is None or self._addresses[:2] != (device, len(self.slabs)):
            self._addresses = (device, len(self.slabs), native.slab_addresses(self.slabs, device))
        return self._addresses[2]

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None,
               pair: tuple[SlabRows, torch.Tensor] | None = None) -> torch.Tensor:
        """Rows ``[n]`` (int64, on the host or this storage's device) as ``[n, *row_shape]`` (into `out` when
        given, which may live on a CUDA device while the slabs are pinned host memory: a kernel then reads
        the rows through the mapping, with no staging copy). `pair`, ``(storage, its out)`` of a storage laid
        out as this one (values beside keys): the same rows of it into its out, in the same launch."""
        if out is None:
            out = torch.empty((rows.shape[0], *self.row_shape), dtype=self.dtype, device=self.device)
        both = None if pair is None else (pair[0].slabs, pair[1], pair[0].addresses(out.device))
        return native.gather_pages(self.slabs, self.rows_per_slab, rows, out, self.addresses(out.device), pair=both)

    def scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` ``[n, *row_shape]`` at distinct rows ``[n]``."""
        if values.dtype != self.dtype:
            values = values.to(self.dtype)
        native.scatter_pages(self.slabs, self.rows_per_slab, rows, values, self.addresses(self.device))

    def write_range(self, start: int, values: torch.Tensor) -> None:
        """Rows ``[start, start + n)`` = ``values`` ``[n, *row_shape]``, copied slab by slab on the current stream
        (no index tensor, nothing read back)."""
        if tuple(values.shape[1:]) != self.row_shape or start < 0 or start + values.shape[0] > self.capacity:
            raise ValueError(f"write_range: rows [{start}, {start + values.shape[0]}) of {list(values.shape[1:])}; "
                             f"allowed: rows within 0 .. {self.capacity - 1} of {list(self.row_shape)}")
        write_rows(self.slabs, self.rows_per_slab, start, values)

    def write_from(self, rows: np.ndarray, values: torch.Tensor, transfer, jobs: list[int]) -> None:
        """Start copying ``values`` ``[n, *row_shape]`` (from any device) into `rows` ``[n]`` through `transfer`
        (a `TransferManager`): one copy per run of consecutive rows in one slab, straight into the slab, no
        staging. Each copy's job id joins `jobs` as it starts (so a failure midway leaves the started ones to
        wait for); the rows are written once they are waited for."""
        if values.dtype != self.dtype:
            values = values.to(self.dtype)
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == 0:
            return
        slab, off = np.divmod(rows, self.rows_per_slab)
        cut = np.flatnonzero((np.diff(rows) != 1) | (np.diff(slab) != 0)) + 1
        for a, b in zip(np.r_[0, cut].tolist(), np.r_[cut, len(rows)].tolist()):
            s, o = int(slab[a]), int(off[a])
            jobs.append(transfer.submit(self.slabs[s][o:o + b - a], values[a:b]))

    def spans(self, n: int) -> list[tuple[int, torch.Tensor]]:
        """``(first row, view)`` for the slabs covering rows ``[0, n)`` (the last view cut at `n`)."""
        out = []
        for i, slab in enumerate(self.slabs):
            start = i * self.rows_per_slab
            if start >= n:
                break
            out.append((start, slab[:n - start]))
        return out

    def shrink(self, slabs: int) -> None:
        """Let the slabs past the first `slabs` go (the caller moved every row it needs below them)."""
        if len(self.slabs) > slabs:
            del self.slabs[slabs:]
            self._addresses = None   # a new table, so nothing keyed by the old one stands for the new slabs

    def adopt(self, other: SlabRows) -> None:
        """Take the slabs of `other` (laid out as these: the same rows per slab) in place of these, which go."""
        self.slabs, other.slabs = other.slabs, []
        self._addresses = None

    def nbytes(self) -> int:
        """Bytes allocated (all slabs)."""
        return sum(s.numel() * s.element_size() for s in self.slabs)

    def close(self) -> None:
        self.slabs = []
        self._addresses = None
