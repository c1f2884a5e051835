"""Bandwidth: a raw copy of one (pinned) buffer each way, next to kvtier's own demotion and recall batches
timed directly through the layer engine on one layer of the model's shape.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .model import DTYPE, SHAPES
from .settings import GpuBenchConfig
from .timing import MiB, Clock, Progress, _attempt, _gbps, _median, _r


def raw_copy(nbytes: int, device: torch.device, repeats: int) -> dict[str, Any]:
    """Host->device and device->host copies of `nbytes` (pinned host memory, CUDA events), median of repeats."""
    if device.type != "cuda":
        a = torch.ones(nbytes, dtype=torch.uint8)
        b = torch.empty_like(a)
        clock = Clock(device)
        times = [clock.time(lambda: b.copy_(a)) for _ in range(repeats + 1)][1:]
        gbps = _gbps(nbytes, _median(times))
        return {"bytes": nbytes, "pinned": False, "timing": "perf_counter",
                "what": "host memory copy (no GPU, no DMA)",
                "host_to_device_gbps": _r(gbps), "device_to_host_gbps": _r(gbps)}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.fill_(2)

    def once(dst: torch.Tensor, src: torch.Tensor) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    h2d = [once(dev, host) for _ in range(repeats + 1)][1:]
    d2h = [once(host, dev) for _ in range(repeats + 1)][1:]
    del host, dev
    return {"bytes": nbytes, "pinned": True, "timing": "cuda events", "what": "one copy_ of one pinned buffer",
            "host_to_device_gbps": _r(_gbps(nbytes, _median(h2d))),
            "device_to_host_gbps": _r(_gbps(nbytes, _median(d2h)))}


def tier_bandwidth(cfg: GpuBenchConfig, device: torch.device, progress: Progress) -> dict[str, Any]:
    """Demotion and recall batches of one layer of the model's shape, timed through the engine.

    - ``demotion``: ``LayerEngine._to_host`` on ``batch_mib`` of K/V: the copies straight into the pinned
      host slabs on the transfer stream (one per run of consecutive slots) and the recall index update
      (bounds on the device, codes copied down beside the pages), timed until they have landed;
    - ``demotion_commit``: ``LayerEngine.commit`` of a step holding that much, end to end (choosing the
      entries, gathering them on the device, then the above);
    - ``recall``: ``LayerEngine._bring_up`` of ``batch_mib`` of random host pages (gather into pinned
      staging, host->device copies), and ``recall_step`` the same for one step's worth
      (``recall_pages`` pages per KV head); ``recall_device`` a decode step's own recall at the batch size
      (planned on the device, keys and values in one launch).
    """
    from ...config import ModelShape, TieredCacheConfig
    from ...engine.layer import LayerEngine
    from ...engine.resources import SharedResources
    from ...placement import Budget
    from ...placement.page_table import HOST
    from ...scoring import make_scorer

    s = SHAPES[cfg.shape]
    H, D = s["num_key_value_heads"], s["head_dim"]
    clock = Clock(device)
    tcfg = TieredCacheConfig(shape=ModelShape(1, H, D), device_budget=Budget(cfg.device_budget, "device_budget"),
                             recall_pages=cfg.recall_pages)
    P = tcfg.page_size
    per_token = H * 2 * D * 2
    tokens = max(P, cfg.batch_mib * MiB // per_token // P * P)
    shared = SharedResources(None)
    engine = LayerEngine(0, tcfg, make_scorer("keynorm"), shared)
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    out: dict[str, Any] = {}
    try:
        k = torch.randn(1, H, tokens, D, generator=g, device=device, dtype=DTYPE)
        v = torch.randn(1, H, tokens, D, generator=g, device=device, dtype=DTYPE)
        moved = shared.counters.bytes_moved
        runs = []
        for r in range(cfg.repeats + 1):       # the first run pins the host slabs: a warm-up
            engine.reset()
            engine.write(k, v)
            before = moved["device_to_host"]
            t = clock.time(engine.commit)
            if r:
                runs.append((moved["device_to_host"] - before, t))
        nbytes = _median([b for b, _ in runs])
        out["demotion_commit"] = {"bytes": int(nbytes), "seconds": _r(_median([t for _, t in runs]), 6),
                                  "gbps": _r(_median([_gbps(b, t) for b, t in runs]))}
        progress.say(f"demotion (commit, end to end): {out['demotion_commit']['gbps']} GB/s")
        kp, vp = k[0].contiguous(), v[0].contiguous()
        score = torch.zeros(H, tokens, device=device)

        def demote_batch() -> None:
            pos = torch.arange(engine.seen, engine.seen + tokens, device=device).expand(H, tokens)
            engine.seen += tokens
            engine._to_host(kp, vp, pos, score)

        times = []
        streams = list(getattr(engine.transfer, "_streams", {}).values())   # the copies down run there
        for r in range(cfg.repeats + 1):   # emptied each time: the host slabs are reused, never pinned anew
            engine.reset()
            t = clock.time_parts(demote_batch, streams)
            if r:
                times.append(t)
        nbytes = tokens * per_token
        out["demotion"] = {"bytes": nbytes, **_parts(nbytes, times)}
        progress.say(f"demotion (_to_host): {out['demotion']['gbps']} GB/s")
        for _ in range(3):                 # recall picks a quarter of four batches' pages at random
            demote_batch()
        heads, pids = engine.table.pages_in(HOST)
        rng = np.random.default_rng(cfg.seed)
        page_bytes = engine.host.page_bytes()
        for name, pages in (("recall", cfg.batch_mib * MiB // page_bytes), ("recall_step", cfg.recall_pages * H)):
            pages = int(min(max(1, pages), len(heads)))
            times = []
            for r in range(cfg.repeats + 1):
                pick = np.sort(rng.choice(len(heads), pages, replace=False))
                hs, ps = heads[pick].astype(np.int64), pids[pick].astype(np.int64)
                t = clock.time_parts(lambda: engine._bring_up(hs, ps), streams)
                if r:
                    times.append(t)
            nbytes = pages * page_bytes
            out[name] = {"bytes": nbytes, "pages": pages, **_parts(nbytes, times)}
            progress.say(f"{name} (_bring_up, {pages} pages): {out[name]['gbps']} GB/s")
        out["recall_device"] = _attempt("recall (planned on the device)",
                                        lambda: _device_planned_recall(engine, cfg, clock, streams, rng),
                                        device, progress)
        progress.say(f"recall (planned on the device): {out['recall_device'].get('gbps')} GB/s")
        out["pinned"] = engine.pin
        return out
    finally:
        engine.close()
        shared.close()


def _device_planned_recall(engine: Any, cfg: GpuBenchConfig, clock: Clock, streams: list,
                           rng: np.random.Generator) -> dict[str, Any]:
    """A decode step's own recall, where every demoted page is in host memory, at the batch size: random
    distinct pages of each head planned on the device into an empty recall buffer of as many slots, then keys
    and values copied by one kernel from the pinned slabs (`LayerEngine._plan_and_copy`)."""
    from ...recall.buffer import RecallBuffer

    H, P, D = engine.heads, engine.cfg.page_size, engine.head_dim
    n = engine.table.n
    w = int(min(n, max(1, cfg.batch_mib * MiB // engine.host.page_bytes() // H)))
    sources = engine._sources()   # the host slots' mirror, made once the table changes (not per step)
    times = []
    for r in range(cfg.repeats + 1):
        want = torch.from_numpy(np.stack([np.sort(rng.choice(n, w, replace=False)) for _ in range(H)]))
        want = want.to(engine.device)
        buf = RecallBuffer(H, w, P, D, engine.dtype, engine.device, on_device=True)
        t = clock.time_parts(lambda: engine._plan_and_copy(buf, want, sources, spare=False), streams)
        if r:
            times.append(t)
    nbytes = w * H * engine.host.page_bytes()
    return {"bytes": nbytes, "pages": w * H, **_parts(nbytes, times)}


def _parts(nbytes: int, runs: list[dict[str, float | None]]) -> dict[str, Any]:
    """A batch's figures, median of the runs: on the wall clock (what the targets judge), the host's time to
    issue it, and the device's between events (see `Clock.time_parts`), each with its GB/s."""
    out: dict[str, Any] = {}
    for key, gbps in (("seconds", "gbps"), ("issue_seconds", None), ("device_seconds", "device_gbps")):
        got = [r[key] for r in runs if r[key] is not None]
        out[key] = _r(_median(got), 6) if got else None
        if gbps is not None:
            out[gbps] = _r(_gbps(nbytes, _median(got))) if got else None
    return out


def measure_bandwidth(cfg: GpuBenchConfig, device: torch.device, progress: Progress) -> dict[str, Any]:
    progress.say(f"raw copy of {cfg.copy_mib} MiB each way")
    out: dict[str, Any] = {
        "method": ("raw: one copy_ of one buffer (pinned on CUDA), CUDA events, median of the repeats; kvtier: "
                   "the engine's own batch moves timed directly (LayerEngine._to_host for demotion, "
                   "LayerEngine._bring_up for recall planned on the host, LayerEngine._plan_and_copy for a "
                   "decode step's recall planned on the device, LayerEngine.commit end to end), synchronised "
                   "before and after, on one layer of the model's shape filled with random K/V; not derived from "
                   "stats() counters, which have no per-direction time"),
        "raw_copy": _attempt("raw copy", lambda: raw_copy(cfg.copy_mib * MiB, device, cfg.repeats), device, progress),
        "raw_copy_batch": _attempt("raw copy (batch size)",
                                   lambda: raw_copy(cfg.batch_mib * MiB, device, cfg.repeats), device, progress),
    }
    out["tiers"] = _attempt("tier bandwidth", lambda: tier_bandwidth(cfg, device, progress), device, progress)
    return out
