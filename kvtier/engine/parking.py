"""A layer parked between conversation turns: its device entries (and host pages) in host memory or on
disk, brought back before the layer's next write exactly as they were.

A layer parked on the host keeps its device entries, its recall index and its host pages in host memory, each
in a tensor of its own size: the host pool's slabs (fixed-size, a few MiB a layer, in part empty) are let go, so a
short conversation parked costs what it holds. A layer parked on disk writes the entries as pages to the cache's
disk store, its recall index (with the entries' positions and scores) to a checksummed file in the private
folder, and moves its host pages into the disk store, remembering which they were. Either way resuming puts the
host pages back in the host pool: the resumed layer is in the very state it was parked in, so decoding
continues bit-identically (a host page that had a clean copy on disk keeps it on the host; on disk it is parked
in that copy, and comes back without one).

Every change is all or nothing: what can fail (a write, a read) happens before anything is let go, and a
failure leaves the layer as it was (the written pages are freed again). A park to disk is made in two steps, so
that a cache parks all its layers or none: `ParkedLayer.to_disk` writes and changes nothing the layer holds, then
`ParkedLayer.settle` lets the host pages go (bookkeeping only), or `ParkedLayer.undo` frees what was written
without reading any of it back.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import zlib
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ..errors import CapacityError, ConfigError, CorruptPageError, os_reason
from ..placement.page_table import DISK, HOST, PageTable

PARK_TARGETS = ("host", "disk")
SPARE_SHARE = 0.2   # the empty share of a host pool's slabs past which a park to the host moves its pages out
_SHORT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR)
_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def parked_path(folder: str, kind: str, layer_idx: int) -> str:
    """The file in the private `folder` where layer `layer_idx`'s parked `kind` ("layer" meta, "window") goes."""
    return os.path.join(folder, f"{kind}{layer_idx:03d}.parked.safetensors")


def check_target(to: str) -> None:
    if to not in PARK_TARGETS:
        raise ConfigError(f"park to {to!r}; allowed: {', '.join(map(repr, PARK_TARGETS))}")


@dataclass
class ParkedLayer:
    """Where a parked layer's entries are, and how to bring them back."""

    where: str
    count: int                                    # device entries per head when parked
    meta: dict[str, torch.Tensor] = field(default_factory=dict)   # pos, score [heads, n]; lo, hi, codes
    entries: tuple[torch.Tensor, torch.Tensor] | None = None      # k, v [heads, n, dim] in host memory
    slots: np.ndarray | None = None               # [heads, pages] disk slots of the entries
    was_on_host: tuple[np.ndarray, np.ndarray] | None = None      # (heads, page ids) to put back on the host
    # parked on the host: the pages of `was_on_host`, in that order (k, v [pages, page_size, dim]); the page
    # table's host slots of them name these rows until the restore stores them in the host pool again
    host_pages: tuple[torch.Tensor, torch.Tensor] | None = None
    meta_file: ParkedFile | None = None           # the meta, in a checksummed file, when parked on disk
    # written by `to_disk`, not yet settled: (the host slots of `was_on_host`, their disk slots, those written)
    unsettled: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @classmethod
    def take(cls, k: torch.Tensor, v: torch.Tensor, meta: dict[str, torch.Tensor], transfer,
             pin: bool) -> ParkedLayer:
        """Copy device entries ``k, v`` ``[heads, n, dim]`` and their metadata to host memory."""
        staged = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in (k, v)]
        transfer.wait([transfer.submit(d, s) for d, s in zip(staged, (k, v))])
        return cls("host", k.shape[1], {name: t.cpu() for name, t in meta.items()}, (staged[0], staged[1]))

    def with_host_pages(self, host, table: PageTable) -> ParkedLayer:
        """The same layer parked on the host with its host pages too, gathered from the pool `host` into tensors
        of their own size (a copy: nothing the layer holds changes until `settle_host_pages`), where more than
        `SPARE_SHARE` of the pool's slabs is empty. A fuller pool keeps them: the copy out, and the copy back at
        the restore, would cost time on the conversation's return to save little memory."""
        if host is None or host.reserved_bytes() - host.nbytes() <= SPARE_SHARE * host.reserved_bytes():
            return self
        heads, pids = table.pages_in(HOST)
        if not len(heads):
            return self
        return replace(self, was_on_host=(heads, pids), host_pages=host.load(table.lookup(heads, pids)[1]))

    def settle_host_pages(self, table: PageTable, host) -> None:
        """The host park made final: the pool's slots of the pages `with_host_pages` copied are given back and the
        page table names the copy's rows (bookkeeping only)."""
        if self.host_pages is None:
            return
        heads, pids = self.was_on_host
        table.reslot(heads, pids, np.arange(len(heads), dtype=np.int64))
        host.clear()

    def host_bytes(self) -> int:
        held = [*self.entries, *self.meta.values(), *(self.host_pages or ())] if self.where == "host" else []
        return sum(t.numel() * t.element_size() for t in held)

    def disk_bytes(self, page_bytes: int) -> int:
        return 0 if self.slots is None else self.slots.size * page_bytes + self.file_bytes()

    def file_bytes(self) -> int:
        """Bytes of its own file (the meta and index; its pages lie in the disk store's file)."""
        return 0 if self.meta_file is None else self.meta_file.nbytes

    def to_disk(self, disk, host, table: PageTable, path: str, page_size: int) -> ParkedLayer:
        """The same layer parked on disk: entries and host pages written to `disk`, meta to `path`. Nothing the
        layer holds changes until `settle`; `undo` drops the copy instead."""
        k, v = self.entries
        H, n, D = k.shape
        pages = max(1, -(-n // page_size))
        pad = pages * page_size - n

        def paged(t: torch.Tensor) -> torch.Tensor:
            if pad:
                t = torch.cat([t, t.new_zeros(H, pad, D)], dim=1)
            return t.reshape(H * pages, page_size, D)

        written: list[np.ndarray] = []
        meta_file: ParkedFile | None = None
        try:
            slots = disk.store(paged(k), paged(v))
            written.append(slots)
            host_slots = None   # parked on the host, the pages are the rows of `host_pages`, and no slot is freed
            if self.host_pages is not None:
                heads, pids = self.was_on_host
            elif host is not None:
                heads, pids = table.pages_in(HOST)
                host_slots = table.lookup(heads, pids)[1]
            else:
                heads, pids = np.empty(0, np.int64), np.empty(0, np.int64)
            disk_slots = table.copies(heads, pids)   # a page with a clean copy on disk goes back to it unwritten
            dirty = np.flatnonzero(disk_slots < 0)
            if len(dirty):
                if self.host_pages is not None:
                    rows = torch.from_numpy(dirty)
                    dirty_pages = (self.host_pages[0][rows], self.host_pages[1][rows])
                else:
                    dirty_pages = host.load(host_slots[dirty])
                written.append(disk.store(*dirty_pages))
                disk_slots[dirty] = written[-1]
            meta_file = ParkedFile.write(path, self.meta, "the parked layer file")
            return replace(self, where="disk", entries=None, meta={}, slots=slots.reshape(H, pages),
                           was_on_host=(heads, pids), host_pages=None, meta_file=meta_file,
                           unsettled=(host_slots, disk_slots, disk_slots[dirty]))
        except BaseException:   # an interruption too: what was written goes, the file with it
            for s in written:
                disk.free(s)
            if meta_file is not None:
                meta_file.discard()
            raise

    def settle(self, table: PageTable, host) -> None:
        """The park to disk made final: the host pages `to_disk` wrote are on disk now (bookkeeping only)."""
        if self.unsettled is None:
            return
        (heads, pids), (host_slots, disk_slots, _) = self.was_on_host, self.unsettled
        self.unsettled = None
        if len(heads):
            table.place(heads, pids, DISK, disk_slots)
            if host_slots is not None:
                host.free(host_slots)

    def undo(self, disk) -> None:
        """Drop a park to disk `to_disk` made and `settle` did not: what it wrote is freed, none of it read."""
        if self.unsettled is not None:
            written, self.unsettled = self.unsettled[2], None
            if len(written):
                disk.free(written)
        self.discard(disk)

    def read(self, disk, table: PageTable, page_size: int, pin: bool = False, host=None) -> dict:
        """Everything a restore needs, read and verified first (nothing is changed): the entries ``k, v``
        ``[heads, n, dim]``, the meta, and the pages to put back on the host. With `pin`, the entries are read
        into pinned memory, whose copy to a GPU runs at the link's speed (pinning costs time of its own: for
        reads made ahead of the restore, `kvtier.engine.unpark`). With the layer's host pool `host` (reads made
        ahead), the host pages go straight into slabs made for it (``"slabs"``, `HostPool.new_slabs`), which the
        restore's pool takes whole: filling them, and on a GPU pinning them, is then off the step's path too."""
        if self.where == "host":
            k, v = self.entries
            got = {"k": k, "v": v, "meta": self.meta, "host_pages": None}
            if self.host_pages is not None:
                got["host_pages"] = (None, *self.host_pages)
                if host is not None:
                    got["slabs"] = slabs = host.new_slabs(len(self.host_pages[0]))
                    slabs.k.write_range(0, self.host_pages[0])
                    slabs.v.write_range(0, self.host_pages[1])
            return got
        H, pages = self.slots.shape
        out = None
        if pin:
            out = tuple(torch.empty(H * pages, page_size, disk.head_dim, dtype=disk.dtype, pin_memory=True)
                        for _ in range(2))
        k, v = disk.load(self.slots.reshape(-1), out=out)
        n = self.count
        k, v = k.reshape(H, pages * page_size, -1), v.reshape(H, pages * page_size, -1)
        got = {"k": k[:, :n], "v": v[:, :n], "meta": self.meta_file.read(), "host_pages": None}
        heads, pids = self.was_on_host
        if len(heads):
            disk_slots = table.lookup(heads, pids)[1]
            if host is None:
                got["host_pages"] = (disk_slots, *disk.load(disk_slots))
            else:   # into the slabs' rows, a slab at a time
                got["host_pages"] = (disk_slots, None, None)
                got["slabs"] = slabs = host.new_slabs(len(disk_slots))
                for (start, k_rows), (_, v_rows) in zip(slabs.k.spans(len(disk_slots)),
                                                        slabs.v.spans(len(disk_slots))):
                    disk.load(disk_slots[start:start + len(k_rows)], out=(k_rows, v_rows))
        if pin:   # whole: a cut of pinned memory would go to the device through a pageable copy of itself
            got["pinned"] = (k, v)
        return got

    def store_host_pages(self, restored: dict, host) -> np.ndarray | None:
        """Put the pages that were on the host before the park back into `host`; returns their slots (None: no
        such page). Where it fails (no host memory), nothing the layer holds has changed."""
        if restored["host_pages"] is None:
            return None
        if "slabs" in restored:   # read ahead into slabs of their own: the pool takes them
            return host.adopt(restored["slabs"])
        _, hk, hv = restored["host_pages"]
        return host.store(hk, hv)

    def release(self, restored: dict, host_slots: np.ndarray | None, disk, table: PageTable,
                readahead=None) -> None:
        """After the layer took its entries back and its host pages are stored (`store_host_pages`): the page
        table learns where those are, and the parking slots and file go. Bookkeeping only: nothing here fails."""
        if host_slots is not None:
            heads, pids = self.was_on_host
            disk_slots = restored["host_pages"][0]   # None: parked on the host, from the copy's rows
            if disk_slots is None:
                table.reslot(heads, pids, host_slots)
            else:
                table.place(heads, pids, HOST, host_slots)
                if readahead is not None:
                    readahead.forget(disk_slots)
                disk.free(disk_slots)
        if self.where == "disk":
            self.discard(disk)

    def discard(self, disk) -> None:
        """Drop what the parked layer keeps on disk (the layer is being reset or closed)."""
        if self.slots is not None and disk is not None:
            slots, self.slots = self.slots, None   # forgotten first: a discard cut short leaks slots, never frees twice
            disk.free(slots.reshape(-1))
        if self.meta_file is not None:
            meta_file, self.meta_file = self.meta_file, None
            meta_file.discard()


@dataclass
class ParkedFile:
    """Tensors parked in a checksummed file of the cache's private folder: a parked layer's meta, or a
    sliding-window layer's window (a few thousand entries a layer, read back whole, so it needs no pages)."""

    path: str
    crc: int
    nbytes: int
    what: str   # the file in words, for errors

    @classmethod
    def write(cls, path: str, tensors: dict[str, torch.Tensor], what: str) -> ParkedFile:
        """Write `tensors` to a new file at `path`; a failure leaves no file (`write_checked`)."""
        crc, size = write_checked(path, {name: t.cpu() for name, t in tensors.items()})
        return cls(path, crc, size, what)

    def read(self) -> dict[str, torch.Tensor]:
        """The tensors, checked against the CRC-32 taken when they were written (changes nothing)."""
        return read_checked(self.path, self.crc, self.what)

    def discard(self) -> None:
        with contextlib.suppress(OSError):   # gone already, or cannot go: the folder goes on close
            os.remove(self.path)


def write_checked(path: str, tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Write `tensors` to a new file at `path` (never through a symlink; mode 0600); returns the file's CRC-32 and
    size. A regular file already there is one of the cache's own, left by an interrupted park or restore (the
    private folder is the owner's only): it goes first, where it would refuse every later park of the layer."""
    data = save_tensors({name: t.contiguous() for name, t in tensors.items()})
    with contextlib.suppress(OSError):
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.remove(path)
    try:
        fd = os.open(path, _OPEN_NEW, 0o600)
    except OSError as e:
        raise CapacityError(f"could not create {path}: {os_reason(e)}") from e
    try:
        try:
            view, done = memoryview(data), 0
            while done < len(data):
                done += os.write(fd, view[done:])
        finally:
            os.close(fd)   # a network file system or a quota may report the failed write only here
    except BaseException as e:   # a failed write, or an interruption (Ctrl-C) midway
        with contextlib.suppress(OSError):
            os.remove(path)   # a file left in the way would refuse every later park of the layer
        if isinstance(e, OSError):
            raise CapacityError(f"could not write {path}: {os_reason(e)}") from e
        raise
    return zlib.crc32(data), len(data)


def read_checked(path: str, crc: int, what: str) -> dict[str, torch.Tensor]:
    """The tensors `write_checked` wrote to `path`; a missing, unreadable or changed file is a `CorruptPageError`
    (`what` names the file in it)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            data = f.read()
    except OSError as e:
        if e.errno in _SHORT_OF:   # the file is fine: the process is short of something, which a later try may have
            raise CapacityError(f"could not read {what} {path}: {os_reason(e)}") from e
        raise CorruptPageError(f"{what} {path} is missing or unreadable ({e.strerror or e})") from e
    if zlib.crc32(data) != crc:
        raise CorruptPageError(f"{what} {path} fails its CRC-32 check")
    return dict(load_tensors(data))
