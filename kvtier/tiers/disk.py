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
HEADER_SIZE = 64
_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


class DiskStore:
    """Page records of one layer in the file ``layer_NNN.kvtp`` under `directory`."""

    def __init__(self, directory: str, layer_idx: int, heads: int, page_size: int, head_dim: int,
                 dtype: torch.dtype, io_threads: int = 4) -> None:
        if dtype not in _DTYPES:
            raise CapacityError(f"dtype {dtype} cannot be stored on disk; allowed: {list(_DTYPES)}")
        self.layer_idx, self.heads, self.page_size, self.head_dim, self.dtype = (
            layer_idx, heads, page_size, head_dim, dtype)
        self.path = os.path.join(directory, f"layer_{layer_idx:03d}.kvtp")
        self._esize = torch.empty((), dtype=dtype).element_size()
        self._kv_bytes = page_size * head_dim * self._esize
        self.payload_size = 2 * self._kv_bytes + page_size * (8 + 4)
        self.record_size = HEADER_SIZE + self.payload_size
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix=f"kvtier-disk-{layer_idx}")
        self.records = 0

    def _offset(self, head: int, page: int) -> int:
        return (page * self.heads + head) * self.record_size

    def _fd_or_raise(self) -> int:
        if self._fd is None:
            raise CorruptPageError(f"disk store {self.path} is closed")
        return self._fd

    def write(self, head: int, page: int, count: int, k: torch.Tensor, v: torch.Tensor,
              pos: torch.Tensor, score: torch.Tensor) -> int:
        """Write one page (``k, v`` ``[page_size, dim]``); returns its CRC-32."""
        payload = b"".join((_as_bytes(k), _as_bytes(v), _as_bytes(pos.to(torch.int64)),
                            _as_bytes(score.to(torch.float32))))
        crc = zlib.crc32(payload)
        header = _HEADER.pack(MAGIC, VERSION, _DTYPES[self.dtype], self.layer_idx, head, page, count,
                              self.page_size, self.head_dim, crc).ljust(HEADER_SIZE, b"\0")
        record = header + payload
        try:
            written = os.pwrite(self._fd_or_raise(), record, self._offset(head, page))
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CapacityError(f"disk full writing a page to {self.path}: {e}") from e
            raise CapacityError(f"could not write a page to {self.path}: {e}") from e
        if written != len(record):
            raise CapacityError(f"short write to {self.path}: {written} of {len(record)} bytes (disk full?)")
        self.records += 1
        return crc

    def write_many(self, items: list[tuple]) -> list[int]:
        """Write pages in parallel; each item is the argument tuple of `write`."""
        return list(self._pool.map(lambda a: self.write(*a), items))

    def read(self, head: int, page: int, expected_crc: int) -> tuple[torch.Tensor, ...]:
        """Read one page back as ``(k, v, pos, score, count)``, verified."""
        where = f"{self.path} (layer {self.layer_idx}, head {head}, page {page})"
        try:
            raw = os.pread(self._fd_or_raise(), self.record_size, self._offset(head, page))
        except OSError as e:
            raise CorruptPageError(f"could not read {where}: {e}") from e
        if len(raw) != self.record_size:
            raise CorruptPageError(f"page missing or truncated in {where}: {len(raw)} of "
                                   f"{self.record_size} bytes")
        magic, version, dtype_code, layer, h, p, count, psize, hdim, crc = _HEADER.unpack_from(raw)
        if (magic, version, dtype_code, layer, h, p, psize, hdim) != (
                MAGIC, VERSION, _DTYPES[self.dtype], self.layer_idx, head, page, self.page_size, self.head_dim):
            raise CorruptPageError(f"bad page header in {where}")
        payload = raw[HEADER_SIZE:]
        actual = zlib.crc32(payload)
        if actual != crc or crc != expected_crc:
            raise CorruptPageError(f"checksum mismatch in {where}: stored {crc:#010x}, computed "
                                   f"{actual:#010x}, expected {expected_crc:#010x}")
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        kb, P, D = self._kv_bytes, self.page_size, self.head_dim
        k = buf[:kb].view(self.dtype).reshape(P, D)
        v = buf[kb:2 * kb].view(self.dtype).reshape(P, D)
        pos = buf[2 * kb:2 * kb + 8 * P].view(torch.int64)
        score = buf[2 * kb + 8 * P:].view(torch.float32)
        return k, v, pos, score, count

    def read_many(self, heads: np.ndarray, pages: np.ndarray, crcs: np.ndarray) -> list[tuple]:
        """Read pages in parallel (the reads release the GIL)."""
        return list(self._pool.map(lambda a: self.read(*a),
                                   zip(heads.tolist(), pages.tolist(), crcs.tolist())))

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
