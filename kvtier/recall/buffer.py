"""The pages recalled for the last query block, kept on the device between steps.

Consecutive decode steps ask for nearly the same pages (the query moves slowly), so a step fetches only the
pages that are not in the buffer yet, into the slots of the pages no longer wanted. Attention reads the
buffer as a set of keys: which slot a page sits in changes what is attended in no way, only the order of the
sums (see the end). Pages never change once demoted, so a buffered copy stays right until the layer is reset
or parked.

A buffer planned on the device may have more slots than a step chooses: the spare ones hold the pages ranked
right after the choice, brought up ahead of the next step (`LayerEngine` prefetch). Attention then reads the
chosen pages in page-id order, gathered (`chosen`) or where they sit through their slots
(`kvtier.native.attend_pages`), so what it computes never depends on which slots they happen to sit in.

A buffer planned on the host may keep pages after a step stops choosing them (`retain` spare slots): the choice
near its edge swings back and forth from step to step, and a page chosen again a few steps later is then found in
the buffer instead of read again from host memory or disk. Nothing moves for it: attention reads the whole
buffer with the slots not chosen masked out (`mask`), and a page brought up takes the slot whose page has gone
unchosen longest.

Such a buffer is read in slot order (so is one planned on the device without spare slots, by a step of several
tokens), and a sum in another order rounds otherwise: where its pages are let go (a park) or not carried (a copy),
its `BufferLayout` is kept, and the next buffer like it takes the same pages into the same slots (`adopt`), so
decoding goes on bit for bit as if nothing had happened.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import native

_TAKEN = np.iinfo(np.int64).max   # sorts a slot whose page stays chosen after every free one


@dataclass(frozen=True)
class BufferLayout:
    """Which page each slot of a buffer held (``-1``: none), and what its plans read besides the pages: where it
    retains, each slot's age, the clock and the slots the last plan chose; planned on the device, the slots a
    prefetch filled that no step has chosen since."""

    ids: np.ndarray
    on_device: bool
    retain: int
    last: np.ndarray | None
    clock: int
    chosen: np.ndarray | None
    ahead: np.ndarray | None

    def filled(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(heads, page ids, slots)`` of the slots that hold a page."""
        heads, slots = np.nonzero(self.ids >= 0)
        return heads.astype(np.int64), self.ids[heads, slots], slots.astype(np.int64)


class RecallBuffer:
    """``[heads, pages * page_size, dim]`` keys and values on the device, and which page each slot holds."""

    def __init__(self, heads: int, pages: int, page_size: int, dim: int, dtype: torch.dtype,
                 device: torch.device, on_device: bool = False, retain: int = 0) -> None:
        if retain and (on_device or not 0 < retain < pages):
            raise ValueError(f"retain={retain}: only a buffer planned on the host retains, 0 < retain < {pages}")
        self.page_size, self.retain = page_size, retain
        # a buffer that retains is read whole, masked: its empty slots must hold numbers (0 * NaN is NaN)
        alloc = torch.zeros if retain else torch.empty
        self.k = alloc(heads, pages * page_size, dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k) if retain else torch.empty_like(self.k)
        self.ids = np.full((heads, pages), -1, dtype=np.int64)
        # a buffer planned on the device (`recall.device_plan`) keeps which page each slot holds there instead
        self.on_device = on_device
        self.held = torch.full((heads, pages), -1, dtype=torch.int64, device=device) if on_device else None
        # slots whose page a prefetch brought up and no step has chosen since (device-planned buffers only)
        self.ahead = torch.zeros((heads, pages), dtype=torch.bool, device=device) if on_device else None
        self.pending: int | None = None   # the transfer job of a prefetch into this buffer not yet waited for
        self._row_base: torch.Tensor | None = None
        # with `retain`: the step each slot's page was last chosen at (-1: never, or empty), which slots the last
        # `plan` chose (bool ``[heads, pages]``) and the additive mask that hides the others from attention
        self._last = np.full((heads, pages), -1, dtype=np.int64) if retain else None
        self._clock = 0
        self._chosen: np.ndarray | None = None
        self.mask: torch.Tensor | None = None

    @property
    def pages(self) -> int:
        return self.ids.shape[1]

    def device_bytes(self) -> int:
        """Bytes this buffer holds where attention reads it: its keys and values, and the tables and mask kept
        beside them there."""
        kept = (self.k, self.v, self.held, self.ahead, self.mask, self._row_base)
        return sum(t.numel() * t.element_size() for t in kept if t is not None)

    def layout(self) -> BufferLayout | None:
        """This buffer's `BufferLayout` (None where it holds no page). Planned on the device, its tables are read
        back: the caller orders this after any prefetch into it."""
        ids = self.held.cpu().numpy() if self.on_device else self.ids
        if not (ids >= 0).any():
            return None
        ahead = self.ahead.cpu().numpy() if self.on_device else None
        copy = (lambda a: None if a is None else a.copy())   # the live arrays (on the CPU, `cpu()` is no copy)
        return BufferLayout(copy(ids), self.on_device, self.retain, copy(self._last), self._clock,
                            copy(self._chosen), copy(ahead))

    def fits(self, layout: BufferLayout) -> bool:
        """Whether `layout` came from a buffer like this one (planned where this one is, as many slots, retaining
        as many)."""
        return (layout.on_device == self.on_device and layout.ids.shape == self.ids.shape
                and layout.retain == self.retain)

    def adopt(self, layout: BufferLayout) -> None:
        """Take `layout`'s bookkeeping, once its pages were put in their slots (`fill`): the next `plan` then
        gives what it gave the buffer `layout` came from."""
        if not self.fits(layout) or not np.array_equal(layout.ids, self.ids):
            raise ValueError("adopt: the buffer does not hold the layout's pages in its slots")
        if self.on_device:   # from pinned memory on CUDA: the step that follows need not wait for the host
            for dst, src in ((self.held, layout.ids), (self.ahead, layout.ahead)):
                t = torch.from_numpy(src)
                dst.copy_(t.pin_memory() if dst.is_cuda else t, non_blocking=True)
        if self.retain:
            self._last[...] = layout.last
            self._clock = layout.clock
            if layout.chosen is not None:
                self._mask_unchosen(layout.chosen.copy())

    def chosen(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages in `slots` ``[heads, w]``, in that order: keys and values ``[heads, w * page_size, dim]``."""
        H, w = slots.shape
        R, P, D = self.pages, self.page_size, self.k.shape[2]
        if self._row_base is None:   # the first row of each head's slots, kept: one op fewer a step
            self._row_base = torch.arange(H, device=slots.device)[:, None] * R
        rows = (slots + self._row_base).reshape(-1)
        return tuple(t.view(H * R, P, D).index_select(0, rows).view(H, w * P, D) for t in (self.k, self.v))

    def plan(self, want: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where the wanted pages ``[heads, pages]`` go: ``(heads, page ids, slots)`` of those to fetch.

        Pages already held keep their slots; the missing ones take the slots of pages no longer wanted.
        """
        H, r = want.shape
        n = int(max(want.max(initial=-1), self.ids.max(initial=-1))) + 1
        rows = np.arange(H)[:, None]
        wanted = np.zeros((H, n + 1), dtype=bool)       # column n stands for an empty slot (-1)
        wanted[rows, want] = True
        held = np.zeros((H, n + 1), dtype=bool)
        held[rows, self.ids] = True
        held[:, -1] = False
        missing = ~held[rows, want]                     # [H, r]: wanted pages not in the buffer
        free = ~wanted[rows, self.ids]                  # [H, slots]: slots whose page is no longer wanted
        heads, col = np.nonzero(missing)
        pids = want[heads, col]
        if self._last is None:
            # the k-th missing page of a head takes the k-th free slot of that head (as many of each)
            slot_cols = np.nonzero(free)[1]
        else:   # a head's missing pages take its free slots unchosen longest (empty ones first), in that order
            by_age = np.argsort(np.where(free, self._last, _TAKEN), axis=1, kind="stable")
            slot_cols = by_age[np.arange(self.pages) < np.count_nonzero(missing, axis=1)[:, None]]
            chosen = ~free
            chosen[heads, slot_cols] = True
            self._note_chosen(chosen)
        return heads.astype(np.int64), pids.astype(np.int64), slot_cols.astype(np.int64)

    def ages(self) -> tuple | None:
        """What `plan` changes of a retaining buffer (the slots' ages, the clock, the choice), for `restore_ages`
        where the step's pages then cannot be brought up (None: the buffer does not retain)."""
        return None if self._last is None else (self._last.copy(), self._clock, self._chosen)

    def restore_ages(self, saved: tuple | None) -> None:
        """Back to what `ages` saved: the step that failed leaves the next `plan` as if it had never been made."""
        if saved is None:
            return
        last, self._clock, chosen = saved
        self._last[...] = last
        if chosen is not None:
            self._mask_unchosen(chosen)
        else:
            self._chosen = None

    def _note_chosen(self, chosen: np.ndarray) -> None:
        """The slots ``[heads, slots]`` a retaining buffer's step reads: their pages' age, and the mask."""
        self._clock += 1
        self._last[chosen] = self._clock
        self._mask_unchosen(chosen)

    def _mask_unchosen(self, chosen: np.ndarray) -> None:
        """Note `chosen` ``[heads, slots]`` as what the step reads, and hide the other slots from attention."""
        H, W, P = chosen.shape[0], self.pages, self.page_size
        self._chosen = chosen
        if self.mask is None:
            self.mask = torch.zeros(1, H, 1, W * P, dtype=self.k.dtype, device=self.k.device)
        hidden = torch.from_numpy(np.where(chosen, 0.0, -np.inf).astype(np.float32))
        self.mask.view(H, W, P).copy_(hidden[..., None].expand(H, W, P))

    def chosen_pages(self) -> tuple[torch.Tensor, np.ndarray]:
        """Keys ``[heads, chosen * page_size, dim]`` and ids ``[heads, chosen]`` of the pages the last `plan` of a
        retaining buffer chose, in slot order (for attention weights by position, which read no mask)."""
        slots = np.nonzero(self._chosen)[1].reshape(self._chosen.shape[0], -1)
        return self.chosen(torch.from_numpy(slots).to(self.k.device))[0], np.take_along_axis(self.ids, slots, axis=1)

    def fill(self, heads: np.ndarray, pids: np.ndarray, slots: np.ndarray, k: torch.Tensor,
             v: torch.Tensor) -> None:
        """Put pages ``k, v`` ``[n, page_size, dim]`` (ids `pids` of `heads`) in buffer `slots`.

        The buffer is one slab of ``heads * pages`` page rows, row ``head * pages + slot``; `plan` never
        gives one slot twice, so the rows are distinct, as `kvtier.native.scatter_pages` requires.
        """
        H, D = self.k.shape[0], self.k.shape[2]
        rows = np.asarray(heads, dtype=np.int64) * self.pages + np.asarray(slots, dtype=np.int64)
        try:
            for buf, pages in ((self.k, k), (self.v, v)):
                native.scatter_pages([buf.view(H * self.pages, self.page_size, D)], H * self.pages, rows, pages)
        except BaseException:   # the slots may hold parts of the new pages: none may pass for its old page
            self.ids[heads, slots] = -1
            raise
        self.ids[heads, slots] = pids
