"""Kernel launches straight through the CUDA driver (``cuLaunchKernel`` by ctypes), arguments packed in one
buffer.

cupy's launch converts every argument on its own (a numpy scalar at a time) and enters the device and the
stream as context managers; on an H200 host a whole native call through it cost some 80 microseconds, eight
torch ops. Here the arguments, all fixed-size numpy scalars, are packed by one ``struct.pack`` in the layout
the kernel's parameters have (each at its natural alignment, as a C struct lays them out) and handed over as
one buffer (``CU_LAUNCH_PARAM_BUFFER_POINTER``); the driver copies it at the call. cupy still compiles and
loads the kernels: this takes their function handles. Nothing here is imported before a launch needs it.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from typing import Any

import numpy as np

_PARAM_BUFFER_POINTER, _PARAM_BUFFER_SIZE, _PARAM_END = 1, 2, 0   # cuda.h's CU_LAUNCH_PARAM_* markers

# numpy kind and size -> struct code at native size and alignment ("@"): what the kernels' parameters are
_CODES = {("i", 1): "b", ("i", 2): "h", ("i", 4): "i", ("i", 8): "q", ("u", 1): "B", ("u", 2): "H",
          ("u", 4): "I", ("u", 8): "Q", ("f", 4): "f", ("f", 8): "d"}

_lock = threading.Lock()
_lib: Any = None
_error: str | None = None
_formats: dict[tuple[type, ...], struct.Struct] = {}
_contexts: dict[int, int] = {}          # device ordinal -> its primary context


def _load() -> Any:
    global _lib, _error
    with _lock:
        if _lib is None and _error is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                _error = f"the CUDA driver library is not loadable ({e})"
                return None
            vp, ui = ctypes.c_void_p, ctypes.c_uint
            lib.cuLaunchKernel.argtypes = [vp, ui, ui, ui, ui, ui, ui, ui, vp, vp, vp]
            lib.cuLaunchKernel.restype = ctypes.c_int
            lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(vp)]
            lib.cuCtxPushCurrent_v2.argtypes = [vp]
            lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(vp)]
            lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
            lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), ctypes.c_int]
            lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            _lib = lib
        return _lib


def unavailable() -> str | None:
    """None when launches can go through the driver here, else why not."""
    _load()
    return _error


def _check(rc: int, what: str) -> None:
    if rc:
        name = ctypes.c_char_p()
        _lib.cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {(name.value or b'CUDA error').decode()} ({rc})")


def _primary_context(device: int) -> int:
    ctx = _contexts.get(device)
    if ctx is None:
        with _lock:
            ctx = _contexts.get(device)   # another thread may have retained it while this one waited
            if ctx is not None:
                return ctx
            dev, handle = ctypes.c_int(), ctypes.c_void_p()
            _check(_lib.cuDeviceGet(ctypes.byref(dev), device), f"cuDeviceGet({device})")
            # the context torch and cupy use; retained once for the process, as theirs is
            _check(_lib.cuDevicePrimaryCtxRetain(ctypes.byref(handle), dev), "cuDevicePrimaryCtxRetain")
            ctx = _contexts[device] = int(handle.value or 0)
    return ctx


def pack(args: tuple) -> bytes:
    """The kernel parameters `args` (numpy scalars) as one buffer in their C layout."""
    types = tuple(map(type, args))
    fmt = _formats.get(types)
    if fmt is None:
        fmt = _formats[types] = struct.Struct("@" + "".join(map(_code, types)))
    return fmt.pack(*args)


def _code(t: type) -> str:
    code = _CODES.get((np.dtype(t).kind, np.dtype(t).itemsize)) if issubclass(t, np.generic) else None
    if code is None:   # a Python int or float has no width the kernel could agree on
        raise TypeError(f"a kernel argument of type {t.__name__}; allowed: numpy scalars of a fixed width "
                        "(int8 to int64, uint8 to uint64, float32, float64)")
    return code


def launch(function: int, device: int, stream: int, grid: tuple[int, ...], block: tuple[int, ...],
           args: tuple, shared_mem: int = 0) -> None:
    """Queue kernel `function` (a loaded ``CUfunction`` of `device`'s primary context) on `stream` (a
    ``CUstream`` of that context; 0 is the legacy default stream)."""
    lib = _lib if _lib is not None else _load()
    if lib is None:
        raise RuntimeError(_error)
    params = pack(args)
    buf = ctypes.create_string_buffer(params, len(params))
    size = ctypes.c_size_t(len(params))
    extra = (ctypes.c_void_p * 5)(_PARAM_BUFFER_POINTER, ctypes.addressof(buf), _PARAM_BUFFER_SIZE,
                                  ctypes.addressof(size), _PARAM_END)
    g, b = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
    ctx = _primary_context(device)
    current = ctypes.c_void_p()
    lib.cuCtxGetCurrent(ctypes.byref(current))
    pushed = (current.value or 0) != ctx
    if pushed:   # another device's context is current on this thread: this one for the launch only
        _check(lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
    try:
        _check(lib.cuLaunchKernel(function, *g, *b, shared_mem, stream or None, None, extra), "cuLaunchKernel")
    finally:
        if pushed:
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
