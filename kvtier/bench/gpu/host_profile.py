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


def _tops(prof: cProfile.Profile, steps: int) -> dict[str, list[dict[str, Any]]]:
    """The `TOP` functions of `prof` by their own time and by their cumulative time, per step."""
    stats = pstats.Stats(prof).stats   # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)

    def top(column: int) -> list[dict[str, Any]]:
        rows = sorted(stats.items(), key=lambda kv: kv[1][column], reverse=True)[:TOP]
        return [{"function": _where(key), "calls_per_step": _r(v[1] / steps, 1),
                 "own_ms_per_step": _r(v[2] * 1e3 / steps, 3), "cumulative_ms_per_step": _r(v[3] * 1e3 / steps, 3)}
                for key, v in rows]

    return {"by_own_time": top(2), "by_cumulative_time": top(3)}


def profile_steps(model: Any, cache: Any, token: torch.Tensor, steps: int, clock: Clock) -> dict[str, Any]:
    """`steps` decode steps under cProfile: the `TOP` functions by their own time and by their cumulative
    time, in milliseconds per step, and the whole profiled step's median."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        times, _ = decode_steps(model, cache, token, steps, clock)
    finally:
        prof.disable()
    return {"steps": steps, "step_ms_profiled": [_r(t * 1e3) for t in times], **_tops(prof, steps),
            "method": "cProfile over whole decode steps after the timed ones (it slows Python: read the shares)"}


def profile_demotion(model: Any, cache: Any, token: torch.Tensor, clock: Clock,
                     max_steps: int = 160) -> tuple[dict[str, Any], torch.Tensor]:
    """Decode steps of a `TieredCache`, each under a cProfile of its own, until one demotes (at most
    `max_steps`): that step's profile, beside the step times of the others. Where a step's extra time
    goes when every layer demotes at once."""
    others: list[float] = []
    for _ in range(max_steps):
        before = cache.counters.bytes_moved["device_to_host"]
        prof = cProfile.Profile()
        prof.enable()
        try:
            times, token = decode_steps(model, cache, token, 1, clock)
        finally:
            prof.disable()
        if cache.counters.bytes_moved["device_to_host"] > before:
            return {"steps_until_one_demoted": len(others) + 1, "step_ms": _r(times[0] * 1e3),
                    "other_steps_ms_median": _r(sorted(others)[len(others) // 2] * 1e3) if others else None,
                    **_tops(prof, 1),
                    "method": "cProfile over the first decode step that demoted (it slows Python: read the "
                              "shares), the steps before it profiled alike for its comparison"}, token
        others.append(times[0])
    return {"skipped": f"no step demoted in {max_steps}"}, token


def kernel_profile(model: Any, cache: Any, token: torch.Tensor, steps: int, clock: Clock) -> dict[str, Any]:
    """`steps` decode steps under torch's profiler (CUDA activity): the device time of every kernel and copy
    per step, the `TOP` that took most, and the step's wall time beside it (the device's busy share)."""
    from torch.profiler import ProfilerActivity, profile

    if clock.device.type != "cuda":
        return {"skipped": f"no device kernels on {clock.device.type}"}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        times, _ = decode_steps(model, cache, token, steps, clock)
    return kernel_summary(prof.key_averages(), times, steps)


def kernel_summary(events: Any, times: list[float], steps: int) -> dict[str, Any]:
    """What `kernel_profile` reports from the profiler's averaged events and the profiled steps' times. A
    profile in which no kernel or copy took device time says so instead of a busy share of 0: a model's step on
    the GPU is never idle, so the profiler's collection (CUPTI) did not work, which can happen for the rest of
    a process after an earlier session."""
    rows = []
    for e in events:
        us = getattr(e, "self_device_time_total", None)
        if us is None:   # torch before the device-neutral names
            us = getattr(e, "self_cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": e.key[:160], "calls_per_step": _r(e.count / steps, 1),
                         "device_ms_per_step": _r(us / 1e3 / steps, 4)})
    out: dict[str, Any] = {"steps": steps, "step_ms_profiled": [_r(t * 1e3) for t in times]}
    if not rows:
        out["no_device_activity"] = (f"torch's profiler recorded no kernel or copy in {steps} decode steps, which "
                                     "ran on the device: its collection (CUPTI) was not working in this process")
        return out
    rows.sort(key=lambda r: r["device_ms_per_step"], reverse=True)
    busy = sum(r["device_ms_per_step"] for r in rows)
    step = sorted(times)[len(times) // 2] * 1e3
    out.update({"device_busy_ms_per_step": _r(busy, 3), "device_busy_share": _r(busy / step if step else 0.0, 3),
                "top": rows[:TOP],
                "method": "torch.profiler, CUDA activity, over whole decode steps after the timed ones: each "
                          "kernel's and copy's own device time; busy = their sum (kernels on two streams at once "
                          "count twice)"})
    return out
