"""What one launch costs the host: a tensor operation through torch, and a native kernel's whole call, by
each way kvtier can launch it (straight through the driver, or through cupy), side by side in one run.

A decode step issues some sixty launches a layer (`kvtier bench launches` counts them); times the cost of one,
that is how long the host takes to issue a step, whatever the device does. Both are timed on tiny tensors
(the device's work is negligible), issue only: the wait for the device comes after the clock stops.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ... import native
from .timing import _r

LAUNCHES = 2000


def measure_launch_cost(device: torch.device, n: int = LAUNCHES) -> dict[str, Any]:
    """Microseconds of host time per launch, median of three runs of `n` each: ``torch_op_us`` (an in-place
    add on one element) and ``native_op_us`` (`kvtier.native.merge_parts` of two one-element parts, one kernel
    where kernels run; where they do not, its torch twin, a few dozen ops, and ``native_path`` says so)."""
    x = torch.zeros(1, device=device)
    part = (torch.zeros(1, 1, 1, device=device), torch.zeros(1, 1, device=device))

    def issue(fn, count: int) -> float:
        runs = []
        for _ in range(3):
            fn()   # warm: a first call may compile or load
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(count):
                fn()
            runs.append((time.perf_counter() - t0) / count)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return sorted(runs)[1]

    before = native.backend()["ops"].get("merge_parts", {}).get("kernel", 0)
    native.merge_parts([part, part])
    kernel = native.backend()["ops"].get("merge_parts", {}).get("kernel", 0) > before
    native_n = n if kernel else max(1, n // 40)   # the twin is a few dozen ops: fewer runs say as much
    native_s = issue(lambda: native.merge_parts([part, part]), native_n)
    out = {"torch_op_us": _r(issue(lambda: x.add_(1.0), n) * 1e6, 2), "native_op_us": _r(native_s * 1e6, 2),
           "native_path": "kernel" if kernel else "twin", "launches_timed": n, "native_calls_timed": native_n,
           "method": "host time to issue n launches on tiny tensors, the device waited for before and after; "
                     "median of three runs. The native figure is the whole call of kvtier.native.merge_parts "
                     "(its checks, two allocations, the kernel's launch by the default launcher); "
                     "native_op_us_by_launcher times the same call by each launcher, one after the other"}
    if kernel:
        out["launcher"] = native.backend()["launcher"]
        out["native_op_us_by_launcher"] = {
            name: _r(_launching_by(name, lambda: issue(lambda: native.merge_parts([part, part]), n)) * 1e6, 2)
            for name in ("driver", "cupy")}
    return out


def _launching_by(name: str, fn: Any) -> Any:
    """`fn()` with kernels launched by `name` (``KVTIER_LAUNCH``), the setting restored after."""
    was = os.environ.get("KVTIER_LAUNCH")
    os.environ["KVTIER_LAUNCH"] = name
    try:
        return fn()
    finally:
        if was is None:
            del os.environ["KVTIER_LAUNCH"]
        else:
            os.environ["KVTIER_LAUNCH"] = was
