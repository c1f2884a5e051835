"""Finding, compiling and launching the CUDA kernels, all lazily: importing this module imports no cupy.

Sources ship inside the package (``kvtier/native/cuda``, the repository's top-level ``native/`` folder). On
the first launch of a kernel on a device, its source is compiled with NVRTC through cupy, with exactly
`build.OPTIONS` (`build`: cupy's own build would flush subnormals), the binary kept on disk (keyed on the full
source text, the options, the device and the compiler, so a changed source never reuses a stale binary) and
loaded by cupy (``cupy.RawModule``); this module keeps the loaded kernel for the process. Kernels run on
torch's current stream of the tensors' device, so they are ordered with the torch work around them.

``KVTIER_NATIVE=0`` in the environment switches every kernel off (the torch twins run); without cupy, or
without CUDA, the twins run as well. `backend()` tells which path each operation took. Under `dry_run` the
operations take their kernel paths on any device but nothing is built or launched: what their own code costs
the host is then measurable anywhere (`kvtier bench wrappers`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..switches import is_on, launch_choice
from . import build

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "cuda"
OPTIONS = build.OPTIONS
_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_.]+)"\s*$', re.MULTILINE)

_lock = threading.Lock()
_cupy: Any = None
_cupy_error: str | None = None
_modules: dict[tuple[str, int], Any] = {}          # (source, device) -> cupy.RawModule built for it
_kernels: dict[tuple[str, str, int], Any] = {}     # (source, kernel name, device) -> loaded cupy.RawKernel
_ready: dict[tuple[str, int], str | None] = {}     # (source, device) -> None when it built, else why not
_streams: dict[tuple[int, int], Any] = {}          # (device, torch stream handle) -> cupy.cuda.ExternalStream
_mapped: dict[tuple[int, int], int] = {}           # (device, host allocation) -> its device address
_stats: dict[str, dict[str, Any]] = {}
_dry = False                                       # under `dry_run`
_status: dict[str, str | None] = {}                # KVTIER_NATIVE's value -> `status()`
_launchers: dict[str, str] = {}                    # KVTIER_LAUNCH's value -> `launcher()`
_functions: dict[int, int] = {}                    # id of a loaded kernel (kept in _kernels) -> its CUfunction
_device_of: dict[int, int] = {}                    # id of a loaded kernel -> the device it was loaded for
_failed: set[tuple[str, int]] = set()              # (source, device) that did not build


def sources() -> list[Path]:
    """Every kernel source (``*.cu``) shipped with the package."""
    return sorted(SOURCE_DIR.glob("*.cu"))


def source(name: str) -> str:
    """The text of ``<name>.cu`` with its local ``#include "..."`` headers inlined (NVRTC sees no files)."""
    path = SOURCE_DIR / f"{name}.cu"
    if not path.is_file():
        known = ", ".join(p.stem for p in sources()) or "none"
        raise FileNotFoundError(f"no kernel source {path.name!r} in {SOURCE_DIR}; shipped: {known}")

    def inline(match: re.Match) -> str:
        header = SOURCE_DIR / match.group(1)
        if not header.is_file():
            raise FileNotFoundError(f"{path.name} includes {match.group(1)!r}, which is not in {SOURCE_DIR}")
        return header.read_text()

    return _INCLUDE.sub(inline, path.read_text())


def cupy_module() -> Any:
    """cupy, imported on first use; None when it cannot be (the reason goes to `status`)."""
    global _cupy, _cupy_error
    with _lock:
        if _cupy is None and _cupy_error is None:
            try:
                import cupy
                _cupy = cupy
            except Exception as e:   # noqa: BLE001 - not installed, or a build that does not match this CUDA
                _cupy_error = f"cupy is not importable ({type(e).__name__}: {e})"   # (which may fail otherwise)
        return _cupy


@contextlib.contextmanager
def dry_run() -> Iterator[None]:
    """Within it, every operation takes its kernel path, on any device, and makes its launch's arguments, but
    no kernel is built or launched and the outputs are left unwritten: for timing what kvtier's own code costs
    the host per call (`kvtier bench wrappers`), never for results."""
    global _dry
    was, _dry = _dry, True
    try:
        yield
    finally:
        _dry = was


def in_dry_run() -> bool:
    return _dry


def status() -> str | None:
    """None when kernels may run, else why they do not (switched off, no CUDA, no cupy)."""
    if _dry:
        return None
    switch = os.environ.get("KVTIER_NATIVE", "1")
    if switch not in _status:   # asked before every launch: the answer is kept per setting of the switch
        if switched_off(switch):
            _status[switch] = "switched off by KVTIER_NATIVE"
        elif not torch.cuda.is_available():
            _status[switch] = "no CUDA device"
        else:
            _status[switch] = None if cupy_module() is not None else _cupy_error
    return _status[switch]


def switched_off(switch: str | None) -> bool:
    """Whether `switch`, a value of ``KVTIER_NATIVE``, switches every kernel off (0, off, false, no); a value that is
    neither on nor off is a `ConfigError` (`kvtier.switches`)."""
    return not is_on("KVTIER_NATIVE", switch)


class FirstUseInCapture(RuntimeError):
    """A kernel first asked for while its stream captures a CUDA graph: its module cannot be loaded there (the
    driver refuses a load during a capture, which would turn the source off for good). The capture fails instead,
    not the kernel; the step then runs eagerly, which loads it, and a later capture finds it loaded."""


def kernel(src: str, name: str, device: torch.device) -> Any:
    """The loaded kernel `name` of source `src` on `device`, or None when it cannot be built there.

    A source that fails to compile or load is reported once in the log and in `backend()`, and its
    operations fall back to the twins: a broken kernel never stops inference.
    """
    if _dry:
        return name
    loaded = _kernels.get((src, name, device.index))   # the common case, without the lock
    if loaded is not None:
        return loaded
    if _ready.get((src, device.index)):   # did not build here: the twin runs
        return None
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise FirstUseInCapture(f"{src}.cu's {name} was first asked for inside a CUDA graph capture on {device}")
    cp = cupy_module()
    with _lock:
        if _ready.get((src, device.index)):
            return None
        key = (src, name, device.index)
        if key not in _kernels:
            try:
                with cp.cuda.Device(device.index):
                    if (src, device.index) not in _modules:   # built for this device's architecture
                        _modules[(src, device.index)] = _load(cp, src, device)
                    _kernels[key] = _modules[(src, device.index)].get_function(name)
                    _device_of[id(_kernels[key])] = device.index
            except (cp.cuda.compiler.CompileException, cp.cuda.driver.CUDADriverError, RuntimeError, OSError) as e:
                # a compile error, a module the driver refuses, or no NVRTC library for cupy to load
                _ready[(src, device.index)] = f"{src}.cu did not build on {device}: {e}"
                _failed.add((src, device.index))
                for other in [k for k in _kernels if k[0] == src and k[2] == device.index]:
                    gone = id(_kernels.pop(other))   # the source is off on this device, kernels loaded before it too
                    _functions.pop(gone, None)       # and their handles: a later kernel may reuse the id
                    _device_of.pop(gone, None)
                log.warning("native kernels of %s.cu are off on %s, the torch twins run: %s", src, device, e)
                return None
            _ready[(src, device.index)] = None
        return _kernels[key]


def _load(cp: Any, src: str, device: torch.device) -> Any:
    """`src` built (or read from the disk cache) and loaded on `device` (cupy's current device). A cached
    binary the driver refuses is removed and built again, once."""
    text = source(src)
    major, minor = torch.cuda.get_device_capability(device)
    compiler = "nvrtc {}.{} cupy {}".format(*cp.cuda.nvrtc.getVersion(), cp.__version__)

    def built(shared: bool = True) -> tuple[Path, bool]:
        return build.cached_binary(src, text, f"sm_{major}{minor}", compiler, build.nvrtc_build(cp, src),
                                   shared=shared)

    def loaded(path: Path) -> Any:
        module = cp.RawModule(path=str(path))
        module.module   # loads it now, so that a damaged file shows here
        return module

    path, fresh = built()
    try:
        return loaded(path)
    except cp.cuda.driver.CUDADriverError:
        if fresh:
            raise
        log.warning("the cached binary %s did not load; building %s.cu again", path, src)
    # a binary another user's process left may not be ours to remove: this process then keeps its own
    return loaded(built(shared=build.forget(path))[0])


def build_error(src: str, device: torch.device) -> str | None:
    """Why `src` could not be built on `device` (None if it was, or was never tried)."""
    return _ready.get((src, device.index))


def build_failed(device: torch.device, *srcs: str) -> bool:
    """Whether any of `srcs` failed to build on `device`: a caller with a torch path of its own then takes it,
    rather than the twin (a long run of small ops on a GPU)."""
    if not _failed:   # asked a few times a layer and step: nothing failed is the usual answer
        return False
    return device.type == "cuda" and any((src, device.index) in _failed for src in srcs)


def launcher() -> str:
    """How kernels are launched: ``driver`` (`driver_launch`, the default where the driver library loads) or
    ``cupy`` (cupy's own launch), as ``KVTIER_LAUNCH`` asks. Both launch the same loaded kernel with the same
    arguments; they differ only in what the call costs the host."""
    asked = launch_choice()
    got = _launchers.get(asked)
    if got is None:
        from . import driver_launch

        why = driver_launch.unavailable() if asked == "driver" else None
        if why is not None:
            log.warning("kernels launch through cupy: %s", why)
        got = _launchers[asked] = "cupy" if why is not None else asked
    return got


def _function_of(k: Any, index: int) -> int | None:
    """The ``CUfunction`` handle of cupy's loaded kernel `k` (kept for the process, as `k` is), or None, with
    the launches left to cupy and the reason logged once, where this cupy does not show it."""
    with cupy_module().cuda.Device(_device_of.get(id(k), index)):   # a RawKernel loads for the current device
        fn = getattr(k, "kernel", k)   # a RawKernel holds its loaded Function
    ptr = getattr(fn, "ptr", None)
    if not ptr:
        _launchers.update({name: "cupy" for name in ("driver", "cupy")})
        log.warning("kernels launch through cupy: this cupy's %s shows no CUfunction handle", type(k).__name__)
        return None
    _functions[id(k)] = int(ptr)
    return int(ptr)


def launch(k: Any, device: torch.device, grid: tuple[int, ...], block: tuple[int, ...], args: tuple,
           shared_mem: int = 0) -> None:
    """Launch `k` on torch's current stream of `device`, so it runs after the torch work queued before it
    (`shared_mem`: bytes of dynamic shared memory per block)."""
    if _dry:
        return
    handle = torch.cuda.current_stream(device).cuda_stream
    function = _functions.get(id(k)) if launcher() == "driver" else None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if function is None and launcher() == "driver":
        function = _function_of(k, index)
    if function is not None:
        from .driver_launch import launch as driver

        driver(function, index, handle, grid, block, args, shared_mem)
        return
    cp = cupy_module()
    with cp.cuda.Device(device.index):
        stream = _streams.get((device.index, handle))
        if stream is None:   # torch's default stream is the legacy null stream, handle 0
            stream = cp.cuda.Stream.null if handle == 0 else _cupy_stream(cp, handle)
            _streams[(device.index, handle)] = stream
        with stream:
            k(grid, block, args, shared_mem=shared_mem)


class _StreamHandle:
    """A stream handle as the CUDA stream protocol hands it over (version 0)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.handle


def _cupy_stream(cp: Any, handle: int) -> Any:
    """cupy's view of torch's stream `handle`: through the stream protocol where cupy has it (its
    `ExternalStream` warns as deprecated from cupy 14 on), else `ExternalStream`."""
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(handle))
    return cp.cuda.ExternalStream(handle)


def indexed_device(device: torch.device | str) -> torch.device:
    """`device` with its index: ``cuda`` is the current CUDA device (``torch.device("cuda")`` compares unequal to
    the ``cuda:0`` of the tensors made on it)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_address(t: torch.Tensor, device: torch.device) -> int | None:
    """The address through which kernels on `device` read `t`, or None if they cannot.

    Device tensors on `device` are read where they are; pinned host tensors through their mapping into the
    device's address space (with unified addressing that is the host address itself, but the runtime is
    asked, not assumed). Pageable host memory has no such address.
    """
    device = indexed_device(device)
    if t.is_cuda:
        return t.data_ptr() if t.device == device else None
    if t.device.type != "cpu" or not t.is_pinned():
        return None
    base = t.untyped_storage().data_ptr()
    key = (device.index, base)
    if key not in _mapped:
        cp = cupy_module()
        try:
            with cp.cuda.Device(device.index):
                mapped = int(cp.cuda.runtime.pointerGetAttributes(base).devicePointer)
        except cp.cuda.runtime.CUDARuntimeError:
            mapped = 0
        if not mapped:
            return None
        _mapped[key] = mapped
    return _mapped[key] + (t.data_ptr() - base)


def record(op: str, path: str, why: str | None = None, launches: int = 1) -> None:
    """Count `launches` kernel launches of `op` on `path` ("kernel", or "twin" for what the twin stood in
    for), with the reason a twin ran."""
    s = _stats.setdefault(op, {"kernel": 0, "twin": 0, "last": None, "why": None})
    s[path] += launches
    s["last"] = path
    if path == "twin":
        s["why"] = why


def backend() -> dict[str, Any]:
    """What ran: ``{"kernels": None or why kernels cannot run, "ops": {op: {"kernel": n, "twin": n,
    "last": path, "why": why the last twin ran}}, "build_errors": {...}}``, n counting kernel launches (one
    per call, but two for an `attend_slabs` over several chunks)."""
    return {"kernels": status(), "launcher": launcher() if status() is None and torch.cuda.is_available() else None,
            "ops": {op: dict(s) for op, s in _stats.items()},
            "build_errors": {f"{src}@cuda:{dev}": why for (src, dev), why in _ready.items() if why}}


def reset_stats() -> None:
    """Forget the counts of `backend()` (e.g. between benchmark runs)."""
    _stats.clear()
