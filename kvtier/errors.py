"""The exception hierarchy: every error kvtier raises on purpose derives from `KVTierError`."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Iterator
from typing import Any


class KVTierError(Exception):
    """Base class of kvtier's errors."""


class ConfigError(KVTierError, ValueError):
    """A setting is out of range or of the wrong type; the message names the value and what is allowed."""


class ScorerError(KVTierError, ValueError):
    """A scorer returned something the placement cannot rank (wrong shape, dtype or NaN)."""


class CapacityError(KVTierError):
    """A tier could not take what it was asked to hold (disk full, pinning refused, ...)."""


class CorruptPageError(KVTierError):
    """A page read back from disk does not match its checksum, or is missing."""


class TransferError(KVTierError):
    """A copy between tiers failed."""


class NativeUnavailableError(KVTierError):
    """A CUDA-only path was asked for on a machine without CUDA or cupy."""


class UnsupportedError(KVTierError, NotImplementedError):
    """The caller asked for something kvtier does not support yet (batch > 1, cropping, ...)."""


class ModelNotInstalledError(KVTierError, FileNotFoundError):
    """The default model's package is not installed; the message says how to install it."""


class ClosedCacheError(KVTierError):
    """The cache was closed (`close()`, or collected): it holds nothing and takes nothing any more."""


class BrokenCacheError(KVTierError):
    """A step failed after some layers had taken it, so the layers may disagree on their length.

    Every later use raises this error, naming the original one (also its ``__cause__``); ``reset()`` empties
    the cache and makes it usable again.
    """


_OS_REASONS = {
    "ENOSPC": "disk full",
    "EDQUOT": "disk quota exceeded",
    "EFBIG": "file-size limit reached (RLIMIT_FSIZE or the file system's largest file)",
    "EMFILE": "too many open files (RLIMIT_NOFILE)",
    "ENFILE": "too many open files in the system",
    "EROFS": "read-only folder (read-only file system)",
    "EACCES": "permission denied",
    "EPERM": "operation not permitted",
    "ENOMEM": "out of memory",
    "EAGAIN": "resource temporarily unavailable (a process or thread limit?)",
    "EEXIST": "a file is already in the way (never reused or followed)",
    "ELOOP": "a symlink is in the way (never followed)",
    "EIO": "I/O error",
}


def os_reason(e: BaseException) -> str:
    """What an OS-level failure means, in words: ``"disk full (ENOSPC: No space left on device)"``.

    Looks through ``e`` and its causes for the first `OSError` (or `MemoryError`); falls back to ``str(e)``.
    """
    import errno
    import os

    for cur in causes(e):
        if isinstance(cur, MemoryError):
            return "out of memory"
        if is_out_of_device_memory(cur):
            text = " ".join(str(cur).split())
            if "DefaultCPUAllocator" in text:   # "... can't allocate memory: you tried to allocate N bytes."
                return f"out of memory ({text[text.index('DefaultCPUAllocator'):]})"
            # torch's message: "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ..." and advice
            said = ". ".join(text.split(". ")[:2])
            return f"out of device memory ({said})"
        if isinstance(cur, OSError) and cur.errno is not None:
            name = errno.errorcode.get(cur.errno, str(cur.errno))
            what = _OS_REASONS.get(name)
            detail = f"{name}: {cur.strerror or os.strerror(cur.errno)}"
            return f"{what} ({detail})" if what else detail
        if isinstance(cur, RuntimeError) and "can't start new thread" in str(cur):
            return "too many threads (cannot start an I/O thread; RLIMIT_NPROC?)"
    return str(e)


def causes(e: BaseException) -> Iterator[BaseException]:
    """`e`, then each error it was raised from (``__cause__``, else ``__context__``), each once."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


_SHORT = ("ENOMEM", "EMFILE", "ENFILE", "ENOSPC", "EDQUOT")


def short_of_resources(e: BaseException) -> bool:
    """Whether `e`, or an error it was raised from, says the machine ran short of memory, open files or disk space:
    a `MemoryError`, an `OSError` with such an errno, torch's out-of-memory errors, or an error that only words
    it, as torch's mmap does ("unable to mmap ... : Cannot allocate memory (12)") and safetensors' too."""
    import errno
    import os

    codes = {getattr(errno, name) for name in _SHORT}
    words = tuple(os.strerror(n) for n in codes)
    for cur in causes(e):
        if isinstance(cur, MemoryError) or is_out_of_device_memory(cur):
            return True
        if isinstance(cur, OSError) and cur.errno is not None:
            if cur.errno in codes:
                return True
        elif any(w in str(cur) for w in words):
            return True
    return False


def is_out_of_device_memory(e: BaseException) -> bool:
    """torch's own out-of-memory errors, `RuntimeError`s rather than `MemoryError`s: a GPU's, and the CPU
    allocator's where the CPU is the device ("DefaultCPUAllocator: can't allocate memory")."""
    import torch

    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(e))


def is_resource_error(e: BaseException) -> bool:
    """Whether ``e`` is a raw resource failure (an OSError, MemoryError, a GPU out of memory, or a thread that
    could not start) that kvtier reports as `CapacityError`."""
    if isinstance(e, KVTierError):
        return False
    return isinstance(e, (OSError, MemoryError)) or is_out_of_device_memory(e) or (
        isinstance(e, RuntimeError) and "can't start new thread" in str(e))


def check_whole(name: str, value: Any, low: int) -> int:
    """`value` as an int where it is a whole number >= `low` (a bool is not), else a `ConfigError` naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ConfigError(f"{name}={value!r} is not allowed; allowed: a whole number >= {low}")
    return int(value)


def call_each(calls: Iterable[Callable[[], Any]]) -> None:
    """Make every call, even where one before it failed (what is being let go must all go: files, folders, memory);
    then raise the first failure."""
    failure: BaseException | None = None
    for call in calls:
        try:
            call()
        except BaseException as e:
            failure = failure or e
    if failure is not None:
        raise failure
