"""Where the time of a decode step goes: a few more steps under cProfile (the Python functions that took most
of the host's time), and on CUDA a few under torch's profiler (the kernels that took most of the device's).

A step whose issue time is about its whole time is bound by the host (see `decode_steps`); these say which
functions that time is spent in, and how busy the device was meanwhile, so the next change is aimed rather
than guessed. cProfile slows Python down (every call is counted): its shares matter, not its times.
"""

from __future__ import annotations

import cProfile
import os
import pstats
from typing import Any

import torch

from .steps import decode_steps
from .timing import Clock, _r

TOP = 30


def _where(key: tuple[str, int, str]) -> str:
    path, line, name = key
    if path == "~":   # a builtin
        return name
    parts = path.replace(os.sep, "/").split("/")
    for root in ("kvtier", "transformers", "torch"):
        if root in parts:   # from the package root: no machine's paths in the report
            path = "/".join(parts[len(parts) - 1 - parts[::-1].index(root):])
            break
    else:
        path = parts[-1]
    return f"{path}:{line}({name})"


def profile_steps(model: Any, cache: Any, token: torch.Tensor, steps: int, clock: Clock) -> dict[str, Any]:
    """`steps` decode steps under cProfile: the `TOP` functions by their own time and by their cumulative
    time, in milliseconds per step, and the whole profiled step's median."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        times, _ = decode_steps(model, cache, token, steps, clock)
    finally:
        prof.disable()
    stats = pstats.Stats(prof).stats   # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)

    def top(column: int) -> list[dict[str, Any]]:
        rows = sorted(stats.items(), key=lambda kv: kv[1][column], reverse=True)[:TOP]
        return [{"function": _where(key), "calls_per_step": _r(v[1] / steps, 1),
                 "own_ms_per_step": _r(v[2] * 1e3 / steps, 3), "cumulative_ms_per_step": _r(v[3] * 1e3 / steps, 3)}
                for key, v in rows]

    return {"steps": steps, "step_ms_profiled": [_r(t * 1e3) for t in times], "by_own_time": top(2),
            "by_cumulative_time": top(3),
            "method": "cProfile over whole decode steps after the timed ones (it slows Python: read the shares)"}


def kernel_profile(model: Any, cache: Any, token: torch.Tensor, steps: int, clock: Clock) -> dict[str, Any]:
    """`steps` decode steps under torch's profiler (CUDA activity): the device time of every kernel and copy
    per step, the `TOP` that took most, and the step's wall time beside it (the device's busy share)."""
    from torch.profiler import ProfilerActivity, profile

    if clock.device.type != "cuda":
        return {"skipped": f"no device kernels on {clock.device.type}"}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        times, _ = decode_steps(model, cache, token, steps, clock)
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:   # torch before the device-neutral names
            us = getattr(e, "self_cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": e.key[:160], "calls_per_step": _r(e.count / steps, 1),
                         "device_ms_per_step": _r(us / 1e3 / steps, 4)})
    rows.sort(key=lambda r: r["device_ms_per_step"], reverse=True)
    busy = sum(r["device_ms_per_step"] for r in rows)
    step = sorted(times)[len(times) // 2] * 1e3
    return {"steps": steps, "step_ms_profiled": [_r(t * 1e3) for t in times],
            "device_busy_ms_per_step": _r(busy, 3), "device_busy_share": _r(busy / step if step else 0.0, 3),
            "top": rows[:TOP],
            "method": "torch.profiler, CUDA activity, over whole decode steps after the timed ones: each kernel's "
                      "and copy's own device time; busy = their sum (kernels on two streams at once count twice)"}
