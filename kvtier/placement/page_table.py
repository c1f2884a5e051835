"""Where each demoted page lives: which tier, which slot there, its rank and the positions it holds; for a host
page brought up from disk, the disk slot of its clean copy; and how often recall has brought each page up lately.

Pages are numbered per layer; every head gets the same number of pages at each demotion (budgets are
equal per head), so page ``p`` exists for all heads and the table is a ``[heads, pages]`` grid. In tier mode
pages are never destroyed; they only move between tiers. Changes go through `add`, `place`, `touch` and `cool`:
the engine never writes cells itself.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

EMPTY, HOST, DISK = 0, 1, 2
TIER_NAMES = {HOST: "host", DISK: "disk"}
LEVELS = (HOST, DISK)          # the hierarchy below the device, fastest first
_DTYPES = {"tier": np.int8, "slot": np.int64, "rank": np.float32, "pos": np.int64, "copy": np.int64, "uses": np.int32}


class PageTable:
    """Metadata of the demoted pages of one layer (numpy, no tensors).

    Columns are kept in chunks of `chunk_pages` page ids so the table never copies itself to grow.
    """

    def __init__(self, heads: int, page_size: int, chunk_pages: int = 1024) -> None:
        self.heads, self.page_size, self.chunk = heads, page_size, chunk_pages
        self.n = 0
        self._chunks: list[dict[str, np.ndarray]] = []
        self.version = 0    # changes whenever a page is added or moves: copies of the table know they are old
        # pages numbered by `add_later` whose ranks and positions are still on their way: (ids, fill)
        self._unsettled: list[tuple[np.ndarray, Callable[[], tuple[np.ndarray, np.ndarray]]]] = []

    def _new_chunk(self) -> dict[str, np.ndarray]:
        H, C = self.heads, self.chunk
        return {"tier": np.zeros((H, C), dtype=_DTYPES["tier"]), "slot": np.full((H, C), -1, dtype=_DTYPES["slot"]),
                "rank": np.full((H, C), -np.inf, dtype=_DTYPES["rank"]),
                "pos": np.full((H, C, self.page_size), -1, dtype=_DTYPES["pos"]),
                # a host page's clean copy on disk (its disk slot), kept so that moving it down again writes nothing
                "copy": np.full((H, C), -1, dtype=_DTYPES["copy"]),
                # how often recall brought the page up lately (halved by `cool`): what the host tier keeps first
                "uses": np.zeros((H, C), dtype=_DTYPES["uses"])}

    def _column(self, name: str) -> np.ndarray:
        """The first `n` page ids of a field as one array (a copy across chunks)."""
        n = self.n
        if not self._chunks:
            shape = (self.heads, 0, self.page_size) if name == "pos" else (self.heads, 0)
            return np.zeros(shape, dtype=_DTYPES[name])
        parts = [c[name] for c in self._chunks]
        whole = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
        return whole[:, :n]

    def add(self, rank: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Number `n` new pages (``rank`` ``[heads, n]``, ``positions`` ``[heads, n, page_size]``); returns ids."""
        ids = self._number(rank.shape[1])
        self._write(ids, rank, positions)
        return ids

    def add_later(self, pages: int, fill: Callable[[], tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """Number `pages` new pages now and learn their ranks and positions later: ``fill()`` returns them (as
        `add` takes them), called once, before anything reads ranks or positions (see `settle`). Tiers and
        slots are there at once. A demotion uses it so that its copies down need not be waited for."""
        ids = self._number(pages)
        self._unsettled.append((ids, fill))
        return ids

    def settle(self, ready_only: bool = False, pages: np.ndarray | None = None) -> None:
        """Fill in the ranks and positions of pages numbered by `add_later`, oldest first; with `ready_only`,
        only while ``fill.ready()`` says a fill would not wait; with `pages` (page ids), only as far as those
        pages need. A fill that raises stays, and raises again."""
        while self._unsettled:
            ids, fill = self._unsettled[0]
            if ready_only and not getattr(fill, "ready", lambda: True)():
                return
            if pages is not None and not np.isin(pages, self.landing()).any():
                return
            self._write(ids, *fill())
            self._unsettled.pop(0)

    @property
    def unsettled(self) -> int:
        """Pages whose ranks and positions are still to come."""
        return sum(len(ids) for ids, _ in self._unsettled)

    def landing(self) -> np.ndarray:
        """Ids of the pages whose ranks and positions are still to come (their fills not yet called)."""
        if not self._unsettled:
            return np.empty(0, dtype=np.int64)
        return np.concatenate([ids for ids, _ in self._unsettled])

    def landed_rank(self) -> tuple[np.ndarray, np.ndarray]:
        """The ranks known without waiting: ``[heads, n]``, after taking the fills that are ready, and ``[n]``
        bool, which pages they hold (the others' cells are meaningless until they land)."""
        self.settle(ready_only=True)
        known = np.ones(self.n, dtype=bool)
        known[self.landing()] = False
        return self._column("rank"), known

    def fills(self) -> list[Callable[[], tuple[np.ndarray, np.ndarray]]]:
        """The fills still to call, oldest first."""
        return [fill for _, fill in self._unsettled]

    def _number(self, pages: int) -> np.ndarray:
        ids = np.arange(self.n, self.n + pages)
        while len(self._chunks) * self.chunk < self.n + pages:
            self._chunks.append(self._new_chunk())
        self.n += pages
        self.version += 1
        return ids

    def _write(self, ids: np.ndarray, rank: np.ndarray, positions: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        chunk, at = ids // self.chunk, ids % self.chunk
        for ci in np.unique(chunk):   # a demotion's pages are numbered in a row: one chunk, or two
            sel = chunk == ci
            c = self._chunks[ci]
            c["rank"][:, at[sel]] = rank[:, sel]
            c["pos"][:, at[sel]] = positions[:, sel]

    def _cells(self, heads: np.ndarray, pids: np.ndarray):
        pids = np.asarray(pids, dtype=np.int64)
        return np.asarray(heads, dtype=np.int64), pids // self.chunk, pids % self.chunk

    def place(self, heads: np.ndarray, pids: np.ndarray, tier: int, slots: np.ndarray,
              copies: np.ndarray | None = None) -> None:
        """Record that pages ``(heads[i], pids[i])`` now live in `tier` at `slots`, with clean copies on disk at
        `copies` (host pages brought up from disk; -1 or None: no copy)."""
        h, c, o = self._cells(heads, pids)
        for ci in np.unique(c):
            sel = c == ci
            ch = self._chunks[ci]
            ch["tier"][h[sel], o[sel]] = tier
            ch["slot"][h[sel], o[sel]] = slots[sel]
            ch["copy"][h[sel], o[sel]] = -1 if copies is None else copies[sel]
        self.version += 1

    def reslot(self, heads: np.ndarray, pids: np.ndarray, slots: np.ndarray) -> None:
        """Record that pages ``(heads[i], pids[i])`` moved to `slots` within their tier (a host pool's compaction, a
        host park's copy and back): unlike `place`, their clean copies on disk stay theirs."""
        h, c, o = self._cells(heads, pids)
        for ci in np.unique(c):
            sel = c == ci
            self._chunks[ci]["slot"][h[sel], o[sel]] = slots[sel]
        self.version += 1

    def copies(self, heads: np.ndarray, pids: np.ndarray) -> np.ndarray:
        """The disk slot of each page's clean copy (-1: none)."""
        return self._gather(("copy",), heads, pids)[0]

    def touch(self, heads: np.ndarray, pids: np.ndarray) -> None:
        """Count one use of each page ``(heads[i], pids[i])`` (each pair at most once a call)."""
        h, c, o = self._cells(heads, pids)
        for ci in np.unique(c):
            sel = c == ci
            self._chunks[ci]["uses"][h[sel], o[sel]] += 1

    def cool(self) -> None:
        """Halve every page's use count (rounding down), so that what counts is recent use."""
        for ch in self._chunks:
            ch["uses"] >>= 1

    def _gather(self, names: tuple[str, ...], heads: np.ndarray, pids: np.ndarray) -> tuple[np.ndarray, ...]:
        """Fields `names` of each page ``(heads[i], pids[i])``, one array per field."""
        h, c, o = self._cells(heads, pids)
        if len(self._chunks) == 1:
            return tuple(self._chunks[0][name][h, o] for name in names)
        out = tuple(np.empty(len(h), dtype=_DTYPES[name]) for name in names)
        for ci in np.unique(c):
            sel = c == ci
            for name, got in zip(names, out):
                got[sel] = self._chunks[ci][name][h[sel], o[sel]]
        return out

    def lookup(self, heads: np.ndarray, pids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tier and slot of each page ``(heads[i], pids[i])``."""
        return self._gather(("tier", "slot"), heads, pids)

    def positions(self, head: int, pid: int) -> np.ndarray:
        """Positions held by one page."""
        self.settle(pages=np.array([pid]))
        return self._chunks[pid // self.chunk]["pos"][head, pid % self.chunk]

    @property
    def tier(self) -> np.ndarray:
        """``[heads, n]`` tier of every page (a read-only snapshot)."""
        return self._column("tier")

    @property
    def rank(self) -> np.ndarray:
        self.settle()
        return self._column("rank")

    @property
    def slot(self) -> np.ndarray:
        """``[heads, n]`` slot of every page in its tier (a read-only snapshot)."""
        return self._column("slot")

    @property
    def uses(self) -> np.ndarray:
        """``[heads, n]`` recent use count of every page (see `touch`, `cool`)."""
        return self._column("uses")

    @property
    def copy_slot(self) -> np.ndarray:
        """``[heads, n]`` disk slot of each host page's clean copy (-1: none)."""
        return self._column("copy")

    def pages_in(self, tier: int) -> tuple[np.ndarray, np.ndarray]:
        """``(heads, page ids)`` of the pages in `tier`."""
        return np.nonzero(self.tier == tier)

    def tokens(self, tier: int) -> np.ndarray:
        """Entries per head held in `tier` (every page is full)."""
        return (self.tier == tier).sum(axis=1) * self.page_size

    def pages(self, tier: int) -> int:
        return int((self.tier == tier).sum())

    def nbytes(self) -> int:
        return sum(a.nbytes for c in self._chunks for a in c.values())

    def clear(self) -> None:
        self.n = 0
        self._chunks = []
        self._unsettled = []
        self.version += 1

    def copy_from(self, other: PageTable) -> None:
        """Take `other`'s pages (ranks, positions, tiers, slots) as this table's own copy."""
        if (other.heads, other.page_size) != (self.heads, self.page_size):
            raise ValueError(f"a page table of {other.heads} heads x {other.page_size}-entry pages cannot be "
                             f"copied into one of {self.heads} x {self.page_size}")
        other.settle()
        self.chunk, self.n = other.chunk, other.n
        self._chunks = [{name: a.copy() for name, a in c.items()} for c in other._chunks]
        self.version += 1
