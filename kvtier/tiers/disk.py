"""The disk tier of one layer: checksummed page records in one file, read back in parallel.

Each record holds one page of one KV head at a fixed offset, ``(page_id * heads + head) * record_size``:
a header (magic, version, layer, head, page, count, page size, head size, dtype, CRC-32 of the payload)
then keys, values, positions and scores. A read checks the header and the CRC against the value kept
in memory when the page was written: a corrupt, stale or missing page raises `CorruptPageError`.
"""

from __future__ import annotations

import errno
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..errors import CapacityError, CorruptPageError

MAGIC = b"KVTP"
VERSION = 1
_HEADER = struct.Struct("<4sHHIIIIIII")
_HEADER_DTYPE = np.dtype([("magic", "S4"), ("version", "<u2"), ("dtype", "<u2"), ("layer", "<u4"), ("head", "<u4"),
                          ("page", "<u4"), ("count", "<u4"), ("page_size", "<u4"), ("head_dim", "<u4"),
                          ("crc", "<u4")])
HEADER_SIZE = 64
_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}


def _rows(t: torch.Tensor, n: int) -> np.ndarray:
    """``t`` ``[n, ...]`` as ``[n, bytes]`` uint8."""
    return t.detach().cpu().contiguous().reshape(n, -1).view(torch.uint8).numpy()


def _chunks(n: int, parts: int) -> list[range]:
    step = max(1, -(-n // parts))
    return [range(i, min(i + step, n)) for i in range(0, n, step)]


class DiskStore:
    """Page records of one layer in the file ``<name>_NNN.kvtp`` under `directory`."""

    def __init__(self, directory: str, layer_idx: int, heads: int, page_size: int, head_dim: int,
                 dtype: torch.dtype, io_threads: int = 4, name: str = "layer") -> None:
        if dtype not in _DTYPES:
            raise CapacityError(f"dtype {dtype} cannot be stored on disk; allowed: {list(_DTYPES)}")
        self.layer_idx, self.heads, self.page_size, self.head_dim, self.dtype = (
            layer_idx, heads, page_size, head_dim, dtype)
        self.path = os.path.join(directory, f"{name}_{layer_idx:03d}.kvtp")
        self._esize = torch.empty((), dtype=dtype).element_size()
        self._kv_bytes = page_size * head_dim * self._esize
        self.payload_size = 2 * self._kv_bytes + page_size * (8 + 4)
        self.record_size = HEADER_SIZE + self.payload_size
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        self.io_threads = io_threads
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix=f"kvtier-disk-{layer_idx}")
        self.records = 0

    def _offset(self, head: int, page: int) -> int:
        return (page * self.heads + head) * self.record_size

    def _fd_or_raise(self) -> int:
        if self._fd is None:
            raise CorruptPageError(f"disk store {self.path} is closed")
        return self._fd

    def _records(self, heads: np.ndarray, pages: np.ndarray, counts: np.ndarray, k: torch.Tensor,
                 v: torch.Tensor, pos: torch.Tensor, score: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Serialise pages ``[n, page_size, ...]`` into ``[n, record_size]`` bytes; returns them and their CRCs."""
        n = len(heads)
        rec = np.zeros((n, self.record_size), dtype=np.uint8)
        kb, P = self._kv_bytes, self.page_size
        payload = rec[:, HEADER_SIZE:]
        payload[:, :kb] = _rows(k, n)
        payload[:, kb:2 * kb] = _rows(v, n)
        payload[:, 2 * kb:2 * kb + 8 * P] = _rows(pos.to(torch.int64), n)
        payload[:, 2 * kb + 8 * P:] = _rows(score.to(torch.float32), n)
        crcs = np.array([zlib.crc32(row) for row in payload], dtype=np.uint32)
        for i in range(n):
            rec[i, :_HEADER.size] = np.frombuffer(_HEADER.pack(
                MAGIC, VERSION, _DTYPES[self.dtype], self.layer_idx, int(heads[i]), int(pages[i]), int(counts[i]),
                self.page_size, self.head_dim, int(crcs[i])), dtype=np.uint8)
        return rec, crcs

    def write_many(self, heads: np.ndarray, pages: np.ndarray, counts: np.ndarray, k: torch.Tensor,
                   v: torch.Tensor, pos: torch.Tensor, score: torch.Tensor) -> np.ndarray:
        """Write pages (``k, v`` ``[n, page_size, dim]``, ``pos, score`` ``[n, page_size]``); returns CRC-32s."""
        rec, crcs = self._records(heads, pages, counts, k, v, pos, score)
        fd = self._fd_or_raise()
        offsets = [self._offset(int(h), int(p)) for h, p in zip(heads, pages)]

        def write_rows(rows: range) -> None:
            for i in rows:
                try:
                    written = os.pwrite(fd, rec[i], offsets[i])
                except OSError as e:
                    kind = "disk full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "could not write"
                    raise CapacityError(f"{kind} writing a page to {self.path}: {e}") from e
                if written != self.record_size:
                    raise CapacityError(f"short write to {self.path}: {written} of {self.record_size} bytes "
                                        "(disk full?)")

        list(self._pool.map(write_rows, _chunks(len(heads), self.io_threads)))
        self.records += len(heads)
        return crcs

    def read_many(self, heads: np.ndarray, pages: np.ndarray, crcs: np.ndarray) -> tuple[torch.Tensor, ...]:
        """Read pages back, verified: ``(k, v)`` ``[n, page_size, dim]``, ``(pos, score)`` ``[n, page_size]``,
        ``counts`` ``[n]``. Reads run on the I/O threads (they release the GIL)."""
        n = len(heads)
        rec = np.empty((n, self.record_size), dtype=np.uint8)
        fd = self._fd_or_raise()
        offsets = [self._offset(int(h), int(p)) for h, p in zip(heads, pages)]

        def read_rows(rows: range) -> list[int]:
            short = []
            for i in rows:
                try:
                    got = os.preadv(fd, [rec[i]], offsets[i])
                except OSError as e:
                    raise CorruptPageError(f"could not read {self._where(heads[i], pages[i])}: {e}") from e
                if got != self.record_size:
                    short.append(i)
            return short

        for short in self._pool.map(read_rows, _chunks(n, self.io_threads)):
            if short:
                i = short[0]
                raise CorruptPageError(f"page missing or truncated in {self._where(heads[i], pages[i])}")
        header = rec[:, :_HEADER.size].copy().view(_HEADER_DTYPE)[:, 0]
        expect = (header["magic"] == np.frombuffer(MAGIC, dtype="S4")[0]) & (header["version"] == VERSION) & (
            header["dtype"] == _DTYPES[self.dtype]) & (header["layer"] == self.layer_idx) & (
            header["head"] == heads) & (header["page"] == pages) & (header["page_size"] == self.page_size) & (
            header["head_dim"] == self.head_dim)
        if not expect.all():
            i = int(np.flatnonzero(~expect)[0])
            raise CorruptPageError(f"bad page header in {self._where(heads[i], pages[i])}")
        payload = rec[:, HEADER_SIZE:]
        actual = np.array([zlib.crc32(row) for row in payload], dtype=np.uint32)
        bad = (actual != header["crc"]) | (header["crc"] != crcs.astype(np.uint32))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise CorruptPageError(f"checksum mismatch in {self._where(heads[i], pages[i])}: stored "
                                   f"{int(header['crc'][i]):#010x}, computed {int(actual[i]):#010x}, expected "
                                   f"{int(crcs[i]):#010x}")
        data = torch.from_numpy(payload)
        kb, P, D = self._kv_bytes, self.page_size, self.head_dim
        def column(a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
            return data[:, a:b].reshape(-1).clone().view(dtype).reshape(n, -1)

        k = column(0, kb, self.dtype).reshape(n, P, D)
        v = column(kb, 2 * kb, self.dtype).reshape(n, P, D)
        pos = column(2 * kb, 2 * kb + 8 * P, torch.int64)
        score = column(2 * kb + 8 * P, self.payload_size, torch.float32)
        return k, v, pos, score, torch.from_numpy(header["count"].astype(np.int64))

    def read(self, head: int, page: int, expected_crc: int) -> tuple[torch.Tensor, ...]:
        """Read one page back as ``(k, v, pos, score, count)``, verified."""
        k, v, pos, score, count = self.read_many(np.array([head]), np.array([page]), np.array([expected_crc]))
        return k[0], v[0], pos[0], score[0], int(count[0])

    def _where(self, head: int, page: int) -> str:
        return f"{self.path} (layer {self.layer_idx}, head {int(head)}, page {int(page)})"

    def discard(self) -> None:
        """Drop every record (the file is emptied; its pages must not be read again)."""
        os.ftruncate(self._fd_or_raise(), 0)
        self.records = 0

    def file_bytes(self) -> int:
        return os.fstat(self._fd).st_size if self._fd is not None else 0

    def close(self, remove: bool = True) -> None:
        """Close the file (and delete it unless told not to)."""
        self._pool.shutdown(wait=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if remove and os.path.exists(self.path):
                os.remove(self.path)
