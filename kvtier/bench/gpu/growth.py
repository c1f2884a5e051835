"""Memory growth over many decode steps: device and host memory before and after, judged against what the
new tokens may legitimately add.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .model import SHAPES, kv_bytes_per_token
from .settings import GpuBenchConfig
from .steps import decode_steps
from .timing import Clock, Progress, _median, _r


def memory_snapshot(cache: Any, device: torch.device) -> dict[str, Any]:
    """Device and host memory now: the allocators' figures (CUDA) and the cache's own pools."""
    import psutil

    snap: dict[str, Any] = {"rss_bytes": psutil.Process().memory_info().rss}
    if device.type == "cuda":
        snap["gpu_allocated_bytes"] = torch.cuda.memory_allocated(device)
        try:
            host = torch.cuda.host_memory_stats()
            snap["pinned_allocator_bytes"] = host.get("allocated_bytes.current")
            snap["pinned_active_bytes"] = host.get("active_bytes.current")
        except (AttributeError, RuntimeError):
            pass
    if hasattr(cache, "stats"):
        st = cache.stats()
        snap["cache_device_reserved_bytes"] = st["device"]["reserved_bytes"]
        snap["cache_index_bytes"] = st["device"]["index_bytes"]
        snap["cache_recall_bytes"] = st["device"]["recall_bytes"]
        snap["cache_host_reserved_bytes"] = st["host"]["reserved_bytes"]
    return snap


def growth_allowance(cfg: GpuBenchConfig, layers: int, new_tokens: int) -> dict[str, int]:
    """What `new_tokens` more tokens may legitimately add: their K/V (all of it, on either side) plus one
    allocation unit per layer of each pool (a device slab, an index slab, a pair of host slabs)."""
    from ...engine.layer import SLAB_TOKENS
    from ...recall.index import PAGES_PER_SLAB
    from ...tiers.host import SLAB_BYTES

    s = SHAPES[cfg.shape]
    H, D = s["num_key_value_heads"], s["head_dim"]
    kv = new_tokens * kv_bytes_per_token(s, layers)
    entry = 2 * D * 2 + 12
    device_slab = SLAB_TOKENS * H * entry
    index_slab = PAGES_PER_SLAB * H * 2 * D * 2
    return {"device_bytes": kv + new_tokens * layers * H * 12 + layers * (device_slab + index_slab),
            "host_bytes": kv + layers * (2 * SLAB_BYTES + index_slab)}


def _growth(cfg: GpuBenchConfig, model: Any, cache: Any, token: torch.Tensor, layers: int, clock: Clock,
            progress: Progress, steps: int | None = None, stepper: Any = None,
            deadline: float | None = None) -> dict[str, Any]:
    """`steps` decode steps (`cfg.growth_steps` by default) through `stepper` (the cache, or a `DecodeGraph` over
    it), stopped at `cfg.growth_seconds` or at `deadline` (a `time.perf_counter()`), whichever comes first: memory
    before and after, and what the steps took, those that demote and those that capture included (their mean is
    what a long decode sees)."""
    steps = cfg.growth_steps if steps is None else steps
    before = memory_snapshot(cache, clock.device)
    seen0 = cache.get_seq_length()
    own = time.perf_counter() + cfg.growth_seconds
    stop_by = "growth_seconds" if deadline is None or own <= deadline else "time_limit"
    deadline = own if deadline is None else min(own, deadline)
    demoted: list[bool] = []
    times, _ = decode_steps(model, cache if stepper is None else stepper, token, steps, clock, progress, "growth",
                            deadline, demoted)
    split = {name: [t for t, d in zip(times, demoted) if d == flag] for name, flag in (("demoting", True),
                                                                                     ("other", False))}
    after = memory_snapshot(cache, clock.device)
    new = cache.get_seq_length() - seen0
    allow = growth_allowance(cfg, layers, new)
    delta = {k: after[k] - before[k] for k in before
             if isinstance(before.get(k), int) and isinstance(after.get(k), int)}
    pools = sum(delta.get(k, 0) for k in ("cache_device_reserved_bytes", "cache_index_bytes", "cache_recall_bytes"))
    gpu = delta.get("gpu_allocated_bytes", pools)
    host = max(delta.get("pinned_allocator_bytes", 0), delta.get("pinned_active_bytes", 0),
               delta.get("cache_host_reserved_bytes", 0))
    return {"steps": len(times), "steps_asked": steps, "stopped_early": len(times) < steps,
            "stopped_by": stop_by if len(times) < steps else None,
            "new_tokens": new, "before": before, "after": after, "growth": delta,
            "device_growth_bytes": gpu, "host_growth_bytes": host, "allowance": allow,
            "device_ok": gpu <= allow["device_bytes"], "host_ok": host <= allow["host_bytes"],
            "step_ms_median": _r(_median(times) * 1e3), "step_ms_mean": _r(sum(times) / len(times) * 1e3),
            # a step that demotes queues its copies to the host and more bookkeeping: its cost, next to the others
            "demoting_steps": len(split["demoting"]),
            "demoting_step_ms_median": _r(_median(split["demoting"]) * 1e3) if split["demoting"] else None,
            "other_step_ms_median": _r(_median(split["other"]) * 1e3) if split["other"] else None,
            "rule": ("growth over the steps must stay within the K/V of the tokens they added plus one allocation "
                     "unit per layer of each pool (device slab, index slab, host slabs); device: "
                     "torch.cuda.memory_allocated on CUDA, else the cache's device pools; host: the largest of the "
                     "pinned allocator's bytes (cached blocks included), its bytes in use and the cache's host pools")}
