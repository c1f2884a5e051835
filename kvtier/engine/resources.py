"""What the layers of one cache share: transfer managers, the private folder, the disk store, counters.

Kept apart from the cache object so that the layers never hold a reference to the cache: a cache that is
dropped without `close()` is collected, and its finalizer releases these.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from typing import Callable

import torch

from ..errors import CapacityError, ConfigError
from ..tiers.disk import DiskStore
from ..transfer import TransferManager, make_transfer_manager
from .stats import MoveCounters


class SharedResources:
    """Lazily made, released together by `close`."""

    def __init__(self, disk_dir: str | None, io_threads: int = 4,
                 transfer_factory: Callable[[torch.device], TransferManager] = make_transfer_manager) -> None:
        self.disk_dir, self.io_threads = disk_dir, io_threads
        self.counters = MoveCounters()
        self._transfer_factory = transfer_factory
        self.transfers: dict[torch.device, TransferManager] = {}
        self._private: str | None = None
        self._disk: DiskStore | None = None

    def transfer(self, device: torch.device) -> TransferManager:
        if device not in self.transfers:
            self.transfers[device] = self._transfer_factory(device)
        return self.transfers[device]

    def private_dir(self) -> str:
        """The cache's private folder (made on first use, removed on close)."""
        if self._private is None:
            self._private = make_private_dir(self.disk_dir)
        return self._private

    @property
    def private_path(self) -> str | None:
        return self._private

    def disk(self, page_size: int, head_dim: int, dtype: torch.dtype) -> DiskStore:
        """The cache's one disk store (one file, one I/O pool for every layer)."""
        if self._disk is None:
            self._disk = DiskStore(self.private_dir(), page_size, head_dim, dtype, io_threads=self.io_threads)
        elif (self._disk.page_size, self._disk.head_dim, self._disk.dtype) != (page_size, head_dim, dtype):
            raise ConfigError(f"layers with pages of {page_size}x{head_dim} {dtype} and of {self._disk.page_size}x"
                              f"{self._disk.head_dim} {self._disk.dtype} cannot share a disk store; allowed: "
                              "one head size and dtype for every tiered layer")
        return self._disk

    @property
    def disk_store(self) -> DiskStore | None:
        return self._disk

    def close(self) -> None:
        if self._disk is not None:
            self._disk.close()
            self._disk = None
        for t in self.transfers.values():
            t.close()
        self.transfers.clear()
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)
            self._private = None


def make_private_dir(disk_dir: str | None) -> str:
    """A new private folder inside `disk_dir` (or the temporary folder), checked writable."""
    try:
        if disk_dir is not None:
            os.makedirs(disk_dir, exist_ok=True)
        path = tempfile.mkdtemp(prefix="kvtier-", dir=disk_dir)
    except OSError as e:
        raise ConfigError(f"disk_dir={disk_dir!r} is not a writable folder ({e.strerror or e}); allowed: a "
                          "folder this process can create files in, or None for a temporary folder") from e
    try:
        probe = os.path.join(path, ".probe")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)
        os.remove(probe)
    except OSError as e:
        shutil.rmtree(path, ignore_errors=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CapacityError(f"disk full in disk_dir={disk_dir!r}: cannot write the cache's files") from e
        raise ConfigError(f"disk_dir={disk_dir!r} is not a writable folder ({e.strerror or e}); allowed: a "
                          "folder this process can create files in, or None for a temporary folder") from e
    return path
