"""What the layers of one cache share: transfer managers, the private folder, the disk store, counters.

Kept apart from the cache object so that the layers never hold a reference to the cache: a cache that is
dropped without `close()` is collected, and its finalizer releases these.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import socket
import stat
import tempfile
import threading
import weakref
from typing import Callable

import torch

from ..errors import CapacityError, ClosedCacheError, ConfigError, UnsupportedError, call_each, os_reason
from ..switches import check_switches, env_switch
from ..tiers.disk import DiskStore
from ..transfer import TransferManager, make_transfer_manager
from .graphs import GraphSwitch
from .stats import MoveCounters

log = logging.getLogger(__name__)

PREFIX = "kvtier-"
OWNER_FILE = ".kvtier-owner"      # in every private folder: who made it (pid, start time, host, boot, PID namespace)
_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_CAPACITY = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG, errno.EMFILE, errno.ENFILE,
             errno.ENOMEM}
_START_SLACK = 1.0                # seconds: psutil's create_time moves with the boot time it derives from


class SharedResources:
    """Lazily made, released together by `close`."""

    def __init__(self, disk_dir: str | None, io_threads: int = 4,
                 transfer_factory: Callable[[torch.device], TransferManager] = make_transfer_manager) -> None:
        check_switches()   # a misspelt switch refused before anything is made (every cache, a bench's too)
        self.disk_dir, self.io_threads = disk_dir, io_threads
        self.counters = MoveCounters()
        self.graphs = GraphSwitch()   # whether the layers may still capture decode steps as CUDA graphs
        # graphs made outside the layers that replay their state (a `DecodeGraph`'s): let go with the layers' own
        self.step_graphs: weakref.WeakSet = weakref.WeakSet()
        self._transfer_factory = transfer_factory
        self.transfers: dict[torch.device, TransferManager] = {}
        self._private: str | None = None
        self._disk: DiskStore | None = None
        self._pid = os.getpid()     # a forked child never closes (deletes) its parent's files
        self._positions: tuple[int, int, torch.device, torch.Tensor] | None = None
        self._step_position: dict[torch.device, torch.Tensor] = {}   # a decode step's position, kept per device
        # (config, length, device budget in tokens): the last answer, which every layer of a step asks again
        self.budget_memo: tuple[object, int, int] = (None, -1, 0)
        self.closed = False

    def _check_open(self) -> None:
        if os.getpid() != self._pid:   # the files and threads are the parent's (`CacheState.check_process`)
            raise UnsupportedError(f"a cache made in process {self._pid} used in process {os.getpid()} (a fork of "
                                   "it); allowed: a new cache made in this process")
        if self.closed:
            raise ClosedCacheError("the cache is closed: it makes no files and takes no entries any more; "
                                   "make a new TieredCache")

    def spill_deferred(self, layer_idx: int, error: CapacityError) -> None:
        """Note host pages the disk refused (`LayerEngine._host_overflow`): counted, the reason kept for
        `stats()`, and said once per cache in the log, so that a host over its budget is never silent."""
        c = self.counters
        c.spills_deferred += 1
        c.spill_error = f"layer {layer_idx}: {error}"
        if c.spills_deferred == 1:
            log.warning("host pages could not go down to disk (%s); they stay in host memory, over host_budget "
                        "(up to twice it), and later demotions try again (stats()['spills_deferred'] counts these)",
                        c.spill_error)

    def transfer(self, device: torch.device) -> TransferManager:
        self._check_open()
        if device not in self.transfers:
            self.transfers[device] = self._transfer_factory(device)
        return self.transfers[device]

    def positions(self, start: int, n: int, device: torch.device) -> torch.Tensor:
        """``arange(start, start + n)`` on `device`, one tensor for every layer of a step: a scorer seeing the
        same tensor again, unwritten since (`Tensor._version`), may reuse what it computed from it (KVP's
        position features). A decode step's one position is written into a tensor kept for the purpose, so
        every decode step's launches read it at one address (a step's input, like its keys and values); read
        it within the step (a later step writes over it)."""
        last = self._positions
        if last is None or last[:3] != (start, n, device):
            if n == 1:
                kept = self._step_position.get(device)
                if kept is None:   # made outside inference mode: its version tells a scorer it was rewritten
                    with torch.inference_mode(False):
                        kept = self._step_position[device] = torch.empty(1, dtype=torch.int64, device=device)
                pos = kept.fill_(start)
            else:
                pos = torch.arange(start, start + n, device=device)
            last = self._positions = (start, n, device, pos)
        return last[3]

    def holds_positions(self, start: int, n: int, device: torch.device) -> bool:
        """Whether the tensor `positions` last gave holds ``arange(start, start + n)`` on `device` still (a decode
        step's is written over by the next step's)."""
        last = self._positions
        return last is not None and last[:3] == (start, n, device)

    def private_dir(self, *, validate: bool = False) -> str:
        """The cache's private folder (made on first use, removed on close).

        A folder that cannot be made is a `ConfigError` while the settings are checked (``validate``), and
        a `CapacityError` naming the cause (disk full, read-only folder, too many open files) later on.
        """
        self._check_open()
        if self._private is None:
            try:
                self._private = make_private_dir(self.disk_dir)
            except ConfigError as e:
                if validate or not isinstance(e.__cause__, OSError):
                    raise
                raise CapacityError(f"cannot make the cache's private folder in "
                                    f"{self.disk_dir or tempfile.gettempdir()!r}: {os_reason(e.__cause__)}"
                                    ) from e.__cause__
        return self._private

    @property
    def private_path(self) -> str | None:
        return self._private

    def disk(self, page_size: int, head_dim: int, dtype: torch.dtype) -> DiskStore:
        """The cache's one disk store (one file, one I/O pool for every layer)."""
        self._check_open()
        if self._disk is None:
            self._disk = DiskStore(self.private_dir(), page_size, head_dim, dtype, io_threads=self.io_threads)
        elif (self._disk.page_size, self._disk.head_dim, self._disk.dtype) != (page_size, head_dim, dtype):
            raise ConfigError(f"layers with pages of {page_size}x{head_dim} {dtype} and of {self._disk.page_size}x"
                              f"{self._disk.head_dim} {self._disk.dtype} cannot share a disk store; allowed: "
                              "one head size and dtype for every tiered layer")
        return self._disk

    def copy_wait_seconds(self) -> float:
        """Seconds the transfer managers held now kept their callers waiting on copies."""
        return sum(t.counters.wait_seconds for t in self.transfers.values())

    @property
    def disk_store(self) -> DiskStore | None:
        return self._disk

    def close(self) -> None:
        self.closed = True
        self._positions = None
        self._step_position.clear()
        if os.getpid() != self._pid:   # a forked child: the files are its parent's
            self._disk, self._private = None, None
            self.transfers.clear()
            return
        disk, self._disk = self._disk, None
        self.counters.copy_wait_seconds += self.copy_wait_seconds()   # their history stays in the stats
        parts = ([disk] if disk is not None else []) + list(self.transfers.values())
        self.transfers.clear()
        # every part goes even where one before it failed (a CUDA error left by an earlier failure, say), and the
        # folder after them
        call_each([*(part.close for part in parts), self._remove_private])

    def _remove_private(self) -> None:
        if self._private is not None:
            _LIVE.pop(self._private, None)
            shutil.rmtree(self._private, ignore_errors=True)
            self._private = None


# ---------------------------------------------------------------------------------------------------- folders
def make_private_dir(disk_dir: str | None) -> str:
    """A new private folder (mode 0700) inside `disk_dir` (or the temporary folder), checked writable.

    The folder holds an owner file (this process's pid and start time, the host name, the boot id and the PID
    namespace), written with ``O_EXCL | O_NOFOLLOW``, mode 0600; it doubles as the check that files can be
    written there. Folders
    of processes that are gone (killed before they could clean up) are then removed from the same parent
    (`remove_stale_dirs`). Raises `CapacityError` when the disk is full or a limit is hit (open files,
    file size), `ConfigError` when the folder cannot be written (not a folder, read-only, no permission).
    """
    sigterm = env_switch("KVTIER_SIGTERM")   # read first: a misspelt value is refused before a folder is made
    try:
        if disk_dir is not None:
            os.makedirs(disk_dir, exist_ok=True)
        path = tempfile.mkdtemp(prefix=PREFIX, dir=disk_dir)
    except OSError as e:
        raise _folder_error(disk_dir, e) from e
    try:
        _write_owner(path)
    except BaseException as e:   # a failed write, or an interruption: no folder is left without its owner file
        shutil.rmtree(path, ignore_errors=True)
        if isinstance(e, OSError):
            raise _folder_error(disk_dir, e) from e
        raise
    _LIVE[path] = os.getpid()
    _install_sigterm_cleanup(sigterm)
    try:
        remove_stale_dirs(os.path.dirname(path), keep=path)
    except Exception:   # cleaning up after others never fails this cache
        pass
    return path


def _folder_error(disk_dir: str | None, e: OSError) -> Exception:
    if e.errno in _CAPACITY:
        return CapacityError(f"cannot write the cache's files in disk_dir={disk_dir!r}: {os_reason(e)}")
    return ConfigError(f"disk_dir={disk_dir!r} is not a writable folder ({os_reason(e)}); allowed: a folder "
                       "this process can create files in, or None for a temporary folder")


def _linux_stat(pid: int) -> tuple[str, int] | None:
    """``(state, start time in clock ticks since boot)`` from ``/proc/<pid>/stat``, or None (not Linux, gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _namespace() -> dict:
    """What tells this machine's boot and this PID namespace apart (Linux; empty elsewhere)."""
    out = {}
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            out["boot_id"] = f.read().strip()
    except OSError:
        pass
    try:
        out["pidns"] = os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    return out


def _owner_record() -> dict:
    import psutil

    pid = os.getpid()
    linux = _linux_stat(pid)
    try:
        start = psutil.Process(pid).create_time()
    except Exception:
        start = None
    return {"pid": pid, "start_ticks": None if linux is None else linux[1], "start": start,
            "host": socket.gethostname(), "uid": os.getuid() if hasattr(os, "getuid") else None, **_namespace()}


def _write_owner(path: str) -> None:
    data = json.dumps(_owner_record()).encode()
    fd = os.open(os.path.join(path, OWNER_FILE), _OPEN_NEW, 0o600)
    try:
        view, done = memoryview(data), 0
        while done < len(data):
            done += os.write(fd, view[done:])
    finally:
        os.close(fd)


def owner_is_gone(path: str) -> bool:
    """True only when the process that made the private folder `path` is known to be gone.

    Unknown is never "gone": no owner file (a folder being made right now, or one made before owner files),
    an unreadable or damaged one, another host, another user, another PID namespace (a container sharing
    the folder), another boot (a reboot cannot be told from another machine of the same name; such folders
    are left for a person to remove). Gone: no process has that pid, the pid now
    belongs to a process started at another time (reused), or the process is a zombie (killed, not reaped).
    The start time is compared in clock ticks from ``/proc`` on Linux (exact), else as psutil's
    ``create_time`` to within a second.
    """
    import psutil

    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            return False
        fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            owner = json.loads(f.read(4096))
        pid = int(owner["pid"])
        if owner.get("host") != socket.gethostname() or pid <= 0:
            return False
        here = _namespace()
        if any(owner.get(key) != here.get(key) for key in ("boot_id", "pidns")):
            # another boot (or machine of the same name), another PID namespace: pids mean nothing; and where one
            # side could not read it, which it is cannot be told
            return False
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    ticks = owner.get("start_ticks")
    if isinstance(ticks, int):
        linux = _linux_stat(pid)
        if linux is not None:
            state, now_ticks = linux
            return state in ("Z", "X", "x") or now_ticks != ticks
        if os.path.isdir("/proc/self"):   # Linux, and /proc has no such pid
            return not psutil.pid_exists(pid)
    start = owner.get("start")
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return True
        created = proc.create_time()
    except psutil.NoSuchProcess:
        return True
    except Exception:   # access denied, or anything else: not known to be gone
        return False
    return isinstance(start, (int, float)) and abs(created - start) > _START_SLACK


def remove_stale_dirs(parent: str, keep: str | None = None) -> list[str]:
    """Remove the ``kvtier-*`` private folders in `parent` whose owner process is gone (see `owner_is_gone`);
    returns the folders removed. Live folders, and folders whose owner cannot be told gone, are left alone."""
    removed = []
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if not name.startswith(PREFIX) or path == keep or not owner_is_gone(path):
            continue
        shutil.rmtree(path, ignore_errors=True)   # fd-based on Linux: never follows a symlink out of the folder
        if not os.path.lexists(path):
            removed.append(path)
    return removed


# ---------------------------------------------------------------------------------------------------- SIGTERM
_LIVE: dict[str, int] = {}      # private folders of live caches -> pid of the process that made them
_SIGTERM = {"decided": False}


def _remove_live_dirs() -> None:
    me = os.getpid()
    for path, pid in list(_LIVE.items()):
        if pid == me:
            shutil.rmtree(path, ignore_errors=True)
            _LIVE.pop(path, None)


def _on_sigterm(signum, frame) -> None:
    """Remove this process's private folders, then die of SIGTERM exactly as without kvtier."""
    try:
        _remove_live_dirs()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm_cleanup(wanted: bool = True) -> None:
    """Remove the private folders on SIGTERM too, where that is safe: only from the main thread, only when
    the process has no SIGTERM handler of its own (the default action), once. Off with ``KVTIER_SIGTERM=0``."""
    if _SIGTERM["decided"] or threading.current_thread() is not threading.main_thread():
        return
    _SIGTERM["decided"] = True
    if not wanted:   # KVTIER_SIGTERM off
        return
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):   # not the main interpreter, or no signals here
        pass
