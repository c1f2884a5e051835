"""Building a kernel source into a binary the driver loads, with NVRTC's options exactly as given, kept on disk.

cupy's own build (``RawModule(code=...)``) appends ``-ftz=true``: every float operation of a kernel would then
flush subnormal inputs and results to zero, which the torch twins (torch's own kernels, and any CPU) never do,
so kernel and twin would part on subnormal values. cupy 13 also compiles with C++11 unless told a standard,
and the sources' hexadecimal float literals need C++17. So NVRTC is run here through cupy's
`compile_using_nvrtc` (which adds only the target architecture and its execution-space default) and cupy
loads the binary from the file (``RawModule(path=...)``).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..switches import kernel_cache_asked
from ..user_cache import user_cache_base

# no fused multiply-adds and no flushing of subnormals anywhere: the twins round every product and every sum
# on its own, and keep subnormals
OPTIONS = ("--fmad=false", "--ftz=false", "-std=c++17")

_fallback: _OwnFolder | None = None   # where binaries go when the cache folder is not writable


def cache_dir() -> Path | None:
    """Where built binaries are kept: ``KVTIER_KERNEL_CACHE`` (absolute, ``~`` expanded), else
    ``$XDG_CACHE_HOME/kvtier/kernels`` where that is absolute (by default ``~/.cache/kvtier/kernels``); None where
    the user has no home folder (binaries then go to a folder of this process's own)."""
    asked = kernel_cache_asked()
    if asked is not None:
        return asked
    base = user_cache_base()
    return None if base is None else base / "kvtier" / "kernels"


def binary_name(name: str, text: str, target: str, compiler: str) -> str:
    """The file name of `text` built for `target` (e.g. ``sm_90``) by `compiler` (NVRTC's and cupy's versions)
    with `OPTIONS`: a changed source, option, device or compiler never reuses a stale binary."""
    key = hashlib.sha256("\0".join((text, *OPTIONS, target, compiler)).encode()).hexdigest()[:32]
    return f"{name}-{target}-{key}.bin"


def cached_binary(name: str, text: str, target: str, compiler: str, build: Any,
                  shared: bool = True) -> tuple[Path, bool]:
    """The path of `text`'s binary and whether it was built now: read from the cache folder when there (and
    intact: its SHA-256 is the one written beside it), else
    ``build(text)`` (bytes, or PTX text) written there whole or not at all (a temporary file renamed into
    place, readable by every user), so another process never loads half a file. Where the folder
    cannot be written, or with `shared` False, the binary goes to a folder of this process's own, removed at
    exit."""
    file = binary_name(name, text, target, compiler)
    shared_dir = cache_dir() if shared else None
    folders = ([shared_dir] if shared_dir else []) + ([Path(_fallback.name)] if _fallback is not None else [])
    for folder in folders:
        if _intact(folder / file):
            return folder / file, False
    data = build(text)
    data = data.encode() if isinstance(data, str) else bytes(data)
    if shared_dir is not None:
        try:
            shared_dir.mkdir(parents=True, exist_ok=True)
            return _write(shared_dir / file, data), True
        except OSError:
            pass
    return _write(_own_folder() / file, data), True


def forget(path: Path) -> bool:
    """Remove a cached binary the driver refused (a damaged file) and its digest, so that the next build writes it
    anew; False where it cannot be removed (another user's, in a folder this process may not change)."""
    for file in (path, _digest_path(path)):
        try:
            file.unlink()
        except FileNotFoundError:
            pass
        except OSError:
            return False
    return True


def nvrtc_build(cp: Any, name: str) -> Any:
    """A build function for `cached_binary`: NVRTC through cupy, for cupy's current device, with `OPTIONS`."""
    compile_ = getattr(getattr(cp.cuda, "compiler", None), "compile_using_nvrtc", None)
    if compile_ is None:
        raise RuntimeError(f"cupy {cp.__version__} has no cupy.cuda.compiler.compile_using_nvrtc to build with")

    def build(text: str) -> Any:
        compiled, _ = compile_(text, OPTIONS, filename=f"{name}.cu")
        return compiled
    return build


class _OwnFolder:
    """A folder of this process's own, removed at its exit: never by a forked child's (whose exit runs the same
    handlers), and made again if something removed it meanwhile."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.name = tempfile.mkdtemp(prefix="kvtier-kernels-")
        atexit.register(self.cleanup)

    def path(self) -> Path:
        if os.getpid() != self.pid:   # a forked child builds into a folder of its own
            return _new_own_folder()
        os.makedirs(self.name, mode=0o700, exist_ok=True)
        return Path(self.name)

    def cleanup(self) -> None:
        if os.getpid() == self.pid:
            shutil.rmtree(self.name, ignore_errors=True)


def _new_own_folder() -> Path:
    global _fallback
    _fallback = _OwnFolder()
    return Path(_fallback.name)


def _own_folder() -> Path:
    return _new_own_folder() if _fallback is None else _fallback.path()


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _intact(path: Path) -> bool:
    """Whether `path` is a regular file (not a link) whose SHA-256 is the one written beside it when it was built:
    a binary changed since, or left without its digest, is built again, never handed to the driver."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        with open(_digest_path(path), encoding="ascii") as f:
            want = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return False
    return hashlib.sha256(data).hexdigest() == want


def _write(path: Path, data: bytes) -> Path:
    """`data` to `path`, its digest first (`_intact`): each file whole or not at all."""
    _write_whole(_digest_path(path), hashlib.sha256(data).hexdigest().encode())
    return _write_whole(path, data)


def _write_whole(path: Path, data: bytes) -> Path:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o644)   # mkstemp's file is its owner's only: other users of the folder read it too
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path
