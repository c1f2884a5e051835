"""Where the host time of a decode step goes: a few more steps under cProfile, the functions that took most.

A step whose issue time is about its whole time is bound by the host (see `decode_steps`); this says which
Python functions that time is spent in, per step, so the next change is aimed rather than guessed. cProfile
slows Python down (every call is counted), so the shares matter, not the absolute times.
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
