"""`kvtier bench gpu`: the GPU data path and decode speed of kvtier next to its baselines, in one run.

Four measurements, each next to what it is judged against:

- bandwidth: a raw pinned copy (1 GiB by default, each direction) against kvtier's demotion and recall
  batches, timed directly through the layer engine (``LayerEngine._to_host`` and ``_bring_up``, the
  batch moves of the product, synchronised) on one layer of the model's shape filled with random K/V;
- decode step of a Llama model with random weights (bf16, batch 1) at each context: kvtier with a device
  budget, ``DynamicCache`` all on the device and ``DynamicCache(offloading=True)``, all holding the same K/V
  (one chunked prefill through the model, then the same K/V written into the other caches through their
  public ``update``);
- 1M tokens filled synthetically (random K/V written layer by layer through the cache's ``update``), then
  decode steps through the model: GPU bytes of the device tier and the recall index, bytes per tier;
- KVP scoring of every prefill entry, as a fraction of the prefill's time.

Memory growth of the device and pinned host memory over many decode steps is measured on the smallest
context. Each target of the issue is recorded with its measured value and pass/fail; a row that cannot
run (no CUDA for offloading, out of memory) is recorded as skipped with its reason. On ``cpu`` the same
code runs with plain host memory (nothing is pinned) and wall-clock timing, at the sizes asked for.
"""

from __future__ import annotations

import gc
import inspect
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

GiB, MiB = 2**30, 2**20
DTYPE = torch.bfloat16

# The 8B shape of the issue (Llama-3.1-8B) and a tiny one for tests; weights are random.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                     "intermediate_size": 14336, "vocab_size": 128256, "num_hidden_layers": 32},
    "tiny": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
             "intermediate_size": 512, "vocab_size": 1024, "num_hidden_layers": 4},
}
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
TARGET_CONTEXT = 131072            # the issue's decode targets are at 128K
MILLION_HOST_SHARE = 0.35          # of the available host memory the 1M row may pin (the rest stays free)
MILLION_DEFAULT_LAYERS = 8         # layers filled at 1M by default (time: pinning ~1-2 GB/s)
ROW_NAMES = {"kvtier": "kvtier", "dynamic": "DynamicCache", "offloading": "DynamicCache(offloading=True)"}


@dataclass(frozen=True)
class GpuBenchConfig:
    """Settings of one `run_gpu_bench` run (sizes in tokens unless named otherwise)."""

    device: str = "cuda"
    shape: str = "llama-3.1-8b"
    layers: int | None = None             # None: the shape's own; fewer = a truncated shape (reported)
    contexts: tuple[int, ...] = (32768, 131072)
    million: bool = True
    million_context: int = 2**20
    million_layers: int | None = None     # None: auto (at most MILLION_DEFAULT_LAYERS, as host memory allows)
    device_budget: float | int = 0.1
    recall_pages: int = 64
    steps: int = 10                       # timed decode steps per row (median reported)
    warmup: int = 3
    growth_steps: int = 1000
    growth_seconds: float = 120.0         # stop the growth run early past this (recorded)
    prefill_chunk: int = 8192
    fill_chunk: int = 65536               # synthetic 1M fill: tokens per update
    copy_mib: int = 1024                  # the raw pinned copy
    batch_mib: int = 64                   # demotion and recall batches
    repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        from ..errors import ConfigError

        if self.shape not in SHAPES:
            raise ConfigError(f"shape={self.shape!r}; allowed: {', '.join(SHAPES)}")
        if self.layers is not None and not 1 <= self.layers <= SHAPES[self.shape]["num_hidden_layers"]:
            raise ConfigError(f"layers={self.layers}; allowed: 1 to {SHAPES[self.shape]['num_hidden_layers']}")
        for name in ("steps", "warmup", "prefill_chunk", "fill_chunk", "copy_mib", "batch_mib", "repeats"):
            if getattr(self, name) < (0 if name == "warmup" else 1):
                raise ConfigError(f"{name}={getattr(self, name)} is out of range")

    @property
    def num_layers(self) -> int:
        return self.layers or SHAPES[self.shape]["num_hidden_layers"]


# ------------------------------------------------------------------------------------------------ helpers
class Clock:
    """Wall-clock timing that waits for the device first and last (CUDA), or plain (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], Any]) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0


class Progress:
    """Progress lines and bars on stderr (tqdm); silent when disabled."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled, self.start = enabled, time.perf_counter()

    def say(self, message: str) -> None:
        if self.enabled:
            from tqdm import tqdm

            tqdm.write(f"[{time.perf_counter() - self.start:7.1f} s] {message}", file=sys.stderr)

    def bar(self, items: Iterable, desc: str, total: int | None = None) -> Iterable:
        from tqdm import tqdm

        return tqdm(items, desc=desc, total=total, file=sys.stderr, disable=not self.enabled, leave=False)


class Skip(Exception):
    """A row that does not apply here (e.g. offloading on cpu): recorded as skipped with this reason."""


def _free(device: torch.device, host: bool = False) -> None:
    """Give cached device memory back (and, with `host`, the pinned blocks torch's host allocator caches)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if host and empty_host is not None:
            empty_host()


def _attempt(what: str, fn: Callable[[], dict[str, Any]], device: torch.device,
             progress: Progress) -> dict[str, Any]:
    """Run one row; a failure (out of memory, a missing feature, a bug in one row) becomes a skipped row with
    its reason, so the other rows still run and the JSON is still written."""
    try:
        return fn()
    except Exception as e:   # recorded in the output, never swallowed silently
        text = " ".join(str(e).split())[:400]
        reason = text if isinstance(e, Skip) else f"{type(e).__name__}: {text}"
        progress.say(f"{what}: skipped ({reason})")
        _free(device)
        return {"skipped": reason}


def _gbps(nbytes: float, seconds: float) -> float | None:
    return None if seconds <= 0 else nbytes / seconds / 1e9


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(float(x), digits)


def kv_bytes_per_token(shape: dict[str, Any], layers: int) -> int:
    """K+V bytes of one token over `layers` layers in bf16."""
    return layers * shape["num_key_value_heads"] * shape["head_dim"] * 2 * 2


# ------------------------------------------------------------------------------------------------ the model
def llama_config(shape: str, layers: int) -> Any:
    """A `LlamaConfig` of the preset's shape with `layers` layers (llama3 RoPE, theta 500000)."""
    from transformers import LlamaConfig

    s = dict(SHAPES[shape], num_hidden_layers=layers, max_position_embeddings=131072, rms_norm_eps=1e-5,
             tie_word_embeddings=False)
    params = inspect.signature(LlamaConfig.__init__).parameters
    if "rope_parameters" in params:          # transformers 5.x
        return LlamaConfig(**s, rope_parameters=dict(ROPE))
    rope = {k: v for k, v in ROPE.items() if k != "rope_theta"}
    return LlamaConfig(**s, rope_theta=ROPE["rope_theta"], rope_scaling=rope)


def build_model(shape: str, layers: int, device: torch.device, seed: int) -> tuple[Any, float]:
    """A `LlamaForCausalLM` with random bf16 weights made directly on `device` (no fp32 copy, no host
    round trip: the parameters are created on the device and initialised there); returns it and the seconds."""
    from transformers import AutoModelForCausalLM

    config = llama_config(shape, layers)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPE, attn_implementation="sdpa")
    model.eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return model, time.perf_counter() - t0


def kvp_for(config: Any, num_layers: int, kv_heads: int, head_dim: int, seed: int) -> tuple[Any, str]:
    """The KVP scorer for this shape: the shipped weights when they fit it, else an untrained KVP of the same
    architecture (random weights: the same work per entry, so the same time)."""
    from ..scoring.kvp import KVPAgents, KVPScorer, save_agents, shipped_for

    model = shipped_for(config)
    if model:
        return KVPScorer(model=model), f"kvp (shipped weights for {model})"
    torch.manual_seed(seed)
    agents = KVPAgents(num_layers * kv_heads, head_dim)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as folder:
        path = Path(folder) / "untrained.safetensors"
        save_agents(agents, path, {"model": "untrained (kvtier bench gpu)", "num_layers": num_layers,
                                   "num_kv_heads": kv_heads})
        scorer = KVPScorer(path=str(path))
    return scorer, "kvp (untrained, same architecture: no weights ship for this shape)"


# ------------------------------------------------------------------------------------------------ bandwidth
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

    - ``demotion``: ``LayerEngine._to_host`` on ``batch_mib`` of K/V: the device->pinned staging copies on
      the transfer stream, the host pool's store and the recall index update (bounds, codes);
    - ``demotion_commit``: ``LayerEngine.commit`` of a step holding that much, end to end (choosing the
      entries, gathering them on the device, then the above);
    - ``recall``: ``LayerEngine._bring_up`` of ``batch_mib`` of random host pages (gather into pinned
      staging, host->device copies), and ``recall_step`` the same for one step's worth
      (``recall_pages`` pages per KV head).
    """
    from ..config import ModelShape, TieredCacheConfig
    from ..engine.layer import LayerEngine
    from ..engine.resources import SharedResources
    from ..placement import Budget
    from ..placement.page_table import HOST
    from ..scoring import make_scorer

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
        for r in range(cfg.repeats + 1):   # emptied each time: the host slabs are reused, never pinned anew
            engine.reset()
            t = clock.time(demote_batch)
            if r:
                times.append(t)
        nbytes = tokens * per_token
        out["demotion"] = {"bytes": nbytes, "seconds": _r(_median(times), 6),
                           "gbps": _r(_gbps(nbytes, _median(times)))}
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
                t = clock.time(lambda: engine._bring_up(hs, ps))
                if r:
                    times.append(t)
            nbytes = pages * page_bytes
            out[name] = {"bytes": nbytes, "pages": pages, "seconds": _r(_median(times), 6),
                         "gbps": _r(_gbps(nbytes, _median(times)))}
            progress.say(f"{name} (_bring_up, {pages} pages): {out[name]['gbps']} GB/s")
        out["pinned"] = engine.pin
        return out
    finally:
        engine.close()
        shared.close()


def measure_bandwidth(cfg: GpuBenchConfig, device: torch.device, progress: Progress) -> dict[str, Any]:
    progress.say(f"raw copy of {cfg.copy_mib} MiB each way")
    out: dict[str, Any] = {
        "method": ("raw: one copy_ of one buffer (pinned on CUDA), CUDA events, median of the repeats; kvtier: "
                   "the engine's own batch moves timed directly (LayerEngine._to_host for demotion, "
                   "LayerEngine._bring_up for recall, LayerEngine.commit end to end), synchronised before and "
                   "after, on one layer of the model's shape filled with random K/V; not derived from "
                   "stats() counters, which have no per-direction time"),
        "raw_copy": _attempt("raw copy", lambda: raw_copy(cfg.copy_mib * MiB, device, cfg.repeats), device, progress),
        "raw_copy_batch": _attempt("raw copy (batch size)",
                                   lambda: raw_copy(cfg.batch_mib * MiB, device, cfg.repeats), device, progress),
    }
    out["tiers"] = _attempt("tier bandwidth", lambda: tier_bandwidth(cfg, device, progress), device, progress)
    return out


# ------------------------------------------------------------------------------------------------ decode
def _layer_kv(cache: Any, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    layer = cache.layers[i]
    return layer.keys, layer.values


@torch.no_grad()
def prefill(model: Any, ids: torch.Tensor, cache: Any, chunk: int, clock: Clock, progress: Progress) -> float:
    """Chunked prefill (activations stay small); returns the seconds."""
    from ..integrations.hf import cache_kwargs

    T = ids.shape[1]
    clock.sync()
    t0 = time.perf_counter()
    for s in progress.bar(range(0, T, chunk), "prefill", total=-(-T // chunk)):
        model(ids[:, s:s + chunk], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    clock.sync()
    return time.perf_counter() - t0


@torch.no_grad()
def decode_steps(model: Any, cache: Any, token: torch.Tensor, n: int, clock: Clock,
                 progress: Progress | None = None, desc: str = "decode",
                 deadline: float | None = None) -> tuple[list[float], torch.Tensor]:
    """`n` greedy decode steps, each timed alone (synchronised); stops early past `deadline` (perf_counter)."""
    from ..integrations.hf import cache_kwargs

    times = []
    steps = range(n) if progress is None else progress.bar(range(n), desc, total=n)
    for _ in steps:
        clock.sync()
        t0 = time.perf_counter()
        out = model(token, **cache_kwargs(cache), use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        clock.sync()
        times.append(time.perf_counter() - t0)
        if deadline is not None and time.perf_counter() > deadline:
            break
    return times, token


def _step_row(times: list[float], **extra: Any) -> dict[str, Any]:
    return {"step_ms_median": _r(_median(times) * 1e3), "step_ms_min": _r(min(times) * 1e3),
            "step_ms_max": _r(max(times) * 1e3), "steps": len(times),
            "step_ms": [_r(t * 1e3) for t in times], **extra}


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
        snap["cache_host_reserved_bytes"] = st["host"]["reserved_bytes"]
    return snap


def growth_allowance(cfg: GpuBenchConfig, layers: int, new_tokens: int) -> dict[str, int]:
    """What `new_tokens` more tokens may legitimately add: their K/V (all of it, on either side) plus one
    allocation unit per layer of each pool (a device slab, an index slab, a pair of host slabs)."""
    from ..engine.layer import SLAB_TOKENS
    from ..recall.index import PAGES_PER_SLAB
    from ..tiers.host import SLAB_BYTES

    s = SHAPES[cfg.shape]
    H, D = s["num_key_value_heads"], s["head_dim"]
    kv = new_tokens * kv_bytes_per_token(s, layers)
    entry = 2 * D * 2 + 12
    device_slab = SLAB_TOKENS * H * entry
    index_slab = PAGES_PER_SLAB * H * 2 * D * 2
    return {"device_bytes": kv + new_tokens * layers * H * 12 + layers * (device_slab + index_slab),
            "host_bytes": kv + layers * (2 * SLAB_BYTES + index_slab)}


def _growth(cfg: GpuBenchConfig, model: Any, cache: Any, token: torch.Tensor, layers: int, clock: Clock,
            progress: Progress) -> dict[str, Any]:
    before = memory_snapshot(cache, clock.device)
    seen0 = cache.get_seq_length()
    deadline = time.perf_counter() + cfg.growth_seconds
    times, _ = decode_steps(model, cache, token, cfg.growth_steps, clock, progress, "growth", deadline)
    after = memory_snapshot(cache, clock.device)
    new = cache.get_seq_length() - seen0
    allow = growth_allowance(cfg, layers, new)
    delta = {k: after[k] - before[k] for k in before
             if isinstance(before.get(k), int) and isinstance(after.get(k), int)}
    pools = delta.get("cache_device_reserved_bytes", 0) + delta.get("cache_index_bytes", 0)
    gpu = delta.get("gpu_allocated_bytes", pools)
    host = max(delta.get("pinned_allocator_bytes", 0), delta.get("cache_host_reserved_bytes", 0))
    return {"steps": len(times), "steps_asked": cfg.growth_steps, "stopped_early": len(times) < cfg.growth_steps,
            "new_tokens": new, "before": before, "after": after, "growth": delta,
            "device_growth_bytes": gpu, "host_growth_bytes": host, "allowance": allow,
            "device_ok": gpu <= allow["device_bytes"], "host_ok": host <= allow["host_bytes"],
            "step_ms_median": _r(_median(times) * 1e3),
            "rule": ("growth over the steps must stay within the K/V of the tokens they added plus one allocation "
                     "unit per layer of each pool (device slab, index slab, host slabs); device: "
                     "torch.cuda.memory_allocated on CUDA, else the cache's device pools; host: the larger of the "
                     "pinned allocator's bytes and the cache's host pools")}


def kvp_scoring(scorer: Any, cache: Any, layers: int, chunk: int, clock: Clock, prefill_seconds: float) -> dict:
    """`scorer.score` over every prefill entry of every layer, in the prefill's chunks."""
    T = _layer_kv(cache, 0)[0].shape[2]

    def run() -> None:
        with torch.no_grad():
            for i in range(layers):
                k, v = _layer_kv(cache, i)
                for s in range(0, T, chunk):
                    pos = torch.arange(s, min(T, s + chunk), device=k.device)
                    scorer.score(k[:, :, s:s + chunk], v[:, :, s:s + chunk], pos, i)

    run_time = clock.time(run)   # the first run also copies the agents to the device: time a second one
    seconds = clock.time(run)
    return {"seconds": _r(seconds, 4), "first_run_seconds": _r(run_time, 4),
            "prefill_seconds": _r(prefill_seconds, 3), "fraction_of_prefill": _r(seconds / prefill_seconds, 5),
            "tokens": T, "layers": layers}


def _fill_from(cache: Any, kv: list[tuple[torch.Tensor, torch.Tensor]], chunk: int, progress: Progress,
               desc: str) -> None:
    """Write the same K/V into a TieredCache chunk by chunk, every layer per chunk (as a chunked prefill
    would), through each layer's public ``update`` then ``commit`` (placement)."""
    T = kv[0][0].shape[2]
    with torch.no_grad():
        for s in progress.bar(range(0, T, chunk), desc, total=-(-T // chunk)):
            for layer, (k, v) in zip(cache.layers, kv):
                layer.update(k[:, :, s:s + chunk], v[:, :, s:s + chunk])
                layer.commit()


def _tier_summary(stats: dict[str, Any]) -> dict[str, Any]:
    return {"device": stats["device"], "host": stats["host"], "disk": stats["disk"],
            "bytes_moved": stats["bytes_moved"], "pages_recalled": stats["pages_recalled"],
            "pages_reused": stats["pages_reused"], "transfer_wait_seconds": _r(stats["transfer_wait_seconds"], 4),
            "scorer": stats["scorer"]}


def run_context(cfg: GpuBenchConfig, model: Any, context: int, scorer: Any, clock: Clock, progress: Progress,
                growth: bool) -> dict[str, Any]:
    """One context: prefill once (DynamicCache, chunked), then each cache's decode step on the same K/V."""
    from transformers import DynamicCache

    from ..integrations.hf import TieredCache

    device, layers = clock.device, cfg.num_layers
    g = torch.Generator().manual_seed(cfg.seed + context)
    ids = torch.randint(model.config.vocab_size, (1, context), generator=g).to(device)
    token = ids[:, -1:]
    row: dict[str, Any] = {"context": context, "rows": {}}
    progress.say(f"{context:,} tokens: prefill through the model (chunks of {cfg.prefill_chunk:,})")
    full = DynamicCache(config=model.config)
    row["prefill_seconds"] = _r(prefill(model, ids, full, cfg.prefill_chunk, clock, progress), 3)
    del ids
    kv = [_layer_kv(full, i) for i in range(layers)]
    row["kvp_scoring"] = _attempt("KVP scoring", lambda: kvp_scoring(scorer, full, layers, cfg.prefill_chunk, clock,
                                                                      row["prefill_seconds"]), device, progress)

    def tiered() -> dict[str, Any]:
        cache = TieredCache(model.config, device_budget=cfg.device_budget, host_budget=None, scorer=scorer,
                            recall_pages=cfg.recall_pages)
        try:
            fill = clock.time(lambda: _fill_from(cache, kv, cfg.prefill_chunk, progress, "kvtier fill"))
            _, t = decode_steps(model, cache, token, cfg.warmup, clock)
            times, t = decode_steps(model, cache, t, cfg.steps, clock, progress, "kvtier decode")
            out = _step_row(times, fill_seconds=_r(fill, 3), tiers=_tier_summary(cache.stats()))
            if growth and cfg.growth_steps:
                progress.say(f"memory growth: up to {cfg.growth_steps} kvtier decode steps at {context:,}")
                out["growth"] = _growth(cfg, model, cache, t, layers, clock, progress)
            return out
        finally:
            cache.close()
            cache.detach_attention()

    def offloaded() -> dict[str, Any]:
        if device.type != "cuda":
            raise Skip("not run on cpu: DynamicCache(offloading=True) moves KV between a CUDA device and host "
                       "memory")
        cache = DynamicCache(config=model.config, offloading=True)
        def fill_layers() -> None:
            with torch.no_grad():
                for i, (k, v) in enumerate(kv):   # as a prefill's update calls: offloaded layer by layer
                    cache.update(k, v, i)

        fill = clock.time(fill_layers)
        _, t = decode_steps(model, cache, token, cfg.warmup, clock)
        times, _ = decode_steps(model, cache, t, cfg.steps, clock, progress, "offloading decode")
        del cache
        return _step_row(times, fill_seconds=_r(fill, 3))

    def dynamic() -> dict[str, Any]:
        _, t = decode_steps(model, full, token, cfg.warmup, clock)
        times, _ = decode_steps(model, full, t, cfg.steps, clock, progress, "DynamicCache decode")
        return _step_row(times, where=device.type)

    for name, fn in (("kvtier", tiered), ("offloading", offloaded), ("dynamic", dynamic)):  # dynamic last: it
        progress.say(f"{context:,} tokens: {ROW_NAMES[name]}")                           # grows the shared K/V
        row["rows"][name] = _attempt(f"{context:,} {ROW_NAMES[name]}", fn, device, progress)
        _free(device)
    del kv, full
    _free(device, host=True)
    rows = row["rows"]
    k_ms = rows["kvtier"].get("step_ms_median")
    row["ratios"] = {f"{name}_over_kvtier": (_r(rows[name]["step_ms_median"] / k_ms)
                                             if k_ms and rows[name].get("step_ms_median") else None)
                     for name in ("dynamic", "offloading")}
    return row


# ------------------------------------------------------------------------------------------------ 1M
def million_layers(cfg: GpuBenchConfig) -> tuple[int, str]:
    """Layers filled at the 1M context: asked, or as many as host memory allows (at most a default)."""
    import psutil

    s = SHAPES[cfg.shape]
    total = cfg.num_layers
    if cfg.million_layers is not None:
        return min(cfg.million_layers, total), "asked"
    per_layer = kv_bytes_per_token(s, 1) * cfg.million_context
    room = int(MILLION_HOST_SHARE * psutil.virtual_memory().available // max(1, per_layer))
    n = max(1, min(total, MILLION_DEFAULT_LAYERS, room))
    return n, (f"auto: at most {MILLION_DEFAULT_LAYERS}, and what {MILLION_HOST_SHARE:.0%} of the available host "
               f"memory holds at {per_layer / GiB:.2f} GiB of K/V per layer")


def run_million(cfg: GpuBenchConfig, scorer_for: Callable[[Any], tuple[Any, str]], clock: Clock,
                progress: Progress) -> dict[str, Any]:
    """Fill a TieredCache with `million_context` synthetic tokens (random K/V through each layer's update),
    then time decode steps through a model of as many layers."""
    from ..integrations.hf import TieredCache

    device = clock.device
    layers, why = million_layers(cfg)
    ctx = cfg.million_context
    progress.say(f"{ctx:,} synthetic tokens in {layers} layer(s) ({why})")
    model, init_s = build_model(cfg.shape, layers, device, cfg.seed + 1)
    scorer, scorer_name = scorer_for(model.config)
    _free(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    s = SHAPES[cfg.shape]
    H, D = s["num_key_value_heads"], s["head_dim"]
    g = torch.Generator(device=device).manual_seed(cfg.seed + 2)
    cache = TieredCache(model.config, device_budget=cfg.device_budget, host_budget=None, scorer=scorer,
                        recall_pages=cfg.recall_pages)
    try:
        def fill() -> None:
            with torch.no_grad():
                for start in progress.bar(range(0, ctx, cfg.fill_chunk), "1M fill", total=-(-ctx // cfg.fill_chunk)):
                    n = min(cfg.fill_chunk, ctx - start)
                    for layer in cache.layers:
                        k = torch.randn(1, H, n, D, generator=g, device=device, dtype=DTYPE)
                        v = torch.randn(1, H, n, D, generator=g, device=device, dtype=DTYPE)
                        layer.update(k, v)
                        layer.commit()

        fill_s = clock.time(fill)
        token = torch.zeros(1, 1, dtype=torch.long, device=device)
        _, token = decode_steps(model, cache, token, cfg.warmup, clock)
        times, _ = decode_steps(model, cache, token, cfg.steps, clock, progress, "1M decode")
        st = cache.stats()
        dev_stats = st["device"]["reserved_bytes"] + st["device"]["index_bytes"]
        measured = None if base is None else torch.cuda.memory_allocated(device) - base
        scale = cfg.num_layers / layers
        full_layers = SHAPES[cfg.shape]["num_hidden_layers"]
        out = _step_row(times, context=ctx, layers=layers, layers_in_run=cfg.num_layers, layers_in_shape=full_layers,
                        layers_why=why, synthetic=True, scorer=scorer_name, model_init_seconds=_r(init_s, 2),
                        fill_seconds=_r(fill_s, 2), tiers=_tier_summary(st),
                        device_tier_plus_index_bytes=dev_stats,
                        gpu_allocated_bytes=measured,
                        per_layer_gpu_bytes=int((measured if measured is not None else dev_stats) / layers),
                        step_ms_per_layer=_r(_median(times) * 1e3 / layers, 4))
        out["projected_gpu_bytes_all_layers"] = out["per_layer_gpu_bytes"] * cfg.num_layers
        out["projected_gpu_bytes_full_shape"] = out["per_layer_gpu_bytes"] * full_layers
        out["projection"] = (f"measured on {layers} layer(s), x{scale:g} for the run's {cfg.num_layers} layers and "
                             f"x{full_layers / layers:g} for the shape's {full_layers}: every layer holds the "
                             "same budget, so its bytes are the same (exact up to slab rounding)"
                             if layers < full_layers else "all layers measured")
        return out
    finally:
        cache.close()
        cache.detach_attention()
        del model
        _free(device)


# ------------------------------------------------------------------------------------------------ targets
def _target(name: str, description: str, measured: float | None, unit: str, threshold: float, better: str,
            note: str = "", **extra: Any) -> dict[str, Any]:
    ok = None if measured is None else (measured >= threshold if better == "higher" else measured <= threshold)
    return {"name": name, "target": description, "measured": _r(measured, 4), "unit": unit,
            "threshold": threshold, "pass": ok, "note": note or ("not measured" if measured is None else ""), **extra}


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the issue with its measured value and pass/fail (None: not measured, with why)."""
    out = []
    bw = result.get("bandwidth", {})
    raw, tiers = bw.get("raw_copy", {}), bw.get("tiers", {})
    for name, move, direction in (("demotion_vs_raw_copy", "demotion", "device_to_host_gbps"),
                                  ("recall_vs_raw_copy", "recall", "host_to_device_gbps")):
        got, base = (tiers.get(move) or {}).get("gbps"), raw.get(direction)
        out.append(_target(name, f"{move} batch >= 90% of the raw pinned copy ({direction[:-5].replace('_', ' ')})",
                           got / base if got and base else None, "fraction", 0.9, "higher",
                           "" if got and base else f"not measured ({tiers.get('skipped') or raw.get('skipped')})"))
    rows = [r for r in result.get("decode", []) if "rows" in r]
    ref = next((r for r in rows if r["context"] == TARGET_CONTEXT), rows[-1] if rows else None)
    note = "" if ref is None or ref["context"] == TARGET_CONTEXT else \
        f"measured at {ref['context']:,} tokens, the largest context of this run (the target is at 128K)"
    ctx = None if ref is None else ref["context"]
    ratios = {} if ref is None else ref["ratios"]
    out.append(_target("decode_vs_dynamic_gpu", "decode step no slower than DynamicCache all on the GPU "
                       "(DynamicCache step / kvtier step >= 1)", ratios.get("dynamic_over_kvtier"), "x", 1.0,
                       "higher", note if ratios.get("dynamic_over_kvtier") else _why(ref, "dynamic"), context=ctx))
    out.append(_target("decode_vs_offloading", ">= 15x faster than DynamicCache(offloading=True)",
                       ratios.get("offloading_over_kvtier"), "x", 15.0, "higher",
                       note if ratios.get("offloading_over_kvtier") else _why(ref, "offloading"), context=ctx))
    mil = result.get("million") or {}
    if mil.get("skipped") or not mil:
        why = mil.get("skipped", "the 1M row was not run (--no-million)")
        out.append(_target("million_gpu_bytes", "1M: device tier + index <= 24 GiB", None, "GiB", 24.0, "lower", why))
        out.append(_target("million_decode_vs_dynamic", "1M: decode step <= 2x the 128K all-on-GPU step", None, "x",
                           2.0, "lower", why))
    else:
        at = "" if mil["context"] == 2**20 else f"measured at {mil['context']:,} tokens (the target is at 1M); "
        out.append(_target("million_gpu_bytes", "1M: device tier + index <= 24 GiB (all layers of the shape)",
                           mil["projected_gpu_bytes_full_shape"] / GiB, "GiB", 24.0, "lower",
                           at + mil["projection"], context=mil["context"]))
        base = None if ref is None else ref["rows"].get("dynamic", {}).get("step_ms_median")
        ratio = None if not base else mil["step_ms_per_layer"] / (base / result["shape"]["layers"])
        why = _why(ref, "dynamic")
        out.append(_target("million_decode_vs_dynamic", "1M: decode step <= 2x the 128K all-on-GPU step", ratio, "x",
                           2.0, "lower", (at + "per layer: the 1M step over its layers vs the DynamicCache step "
                                          "over the run's layers (conservative: fixed per-step costs weigh more on "
                                          "fewer layers)" + (f"; {note}" if note else "")) if ratio else why,
                           context=mil["context"]))
    growth = next((r["rows"]["kvtier"]["growth"] for r in rows if "growth" in r["rows"].get("kvtier", {})), None)
    for side in ("device", "host"):
        g = growth or {}
        measured = g.get(f"{side}_growth_bytes")
        limit = g.get("allowance", {}).get(f"{side}_bytes", 0)
        note = ("growth run did not happen" if growth is None else
                f"{g['steps']} of {g['steps_asked']} steps (stopped at --growth-seconds)" if g["stopped_early"] else
                f"{g['steps']} steps, {g['new_tokens']} new tokens")
        t = _target(f"no_{side}_memory_growth",
                    f"no growth of {'GPU' if side == 'device' else 'pinned host'} memory over 1,000 decode steps "
                    "(beyond the new tokens' K/V and one allocation unit per pool)",
                    None if measured is None else measured / MiB, "MiB", limit / MiB, "lower", note)
        if growth is not None and growth["stopped_early"] and t["pass"]:
            t["pass"] = None   # fewer steps than the target asks: no verdict
        out.append(t)
    total = result.get("seconds", {}).get("total")
    out.append(_target("under_5_minutes", "the whole command under 5 minutes (on an H200)", total, "s", 300.0,
                       "lower", "" if result.get("device", "").startswith("cuda") else "timed on cpu"))
    return out


def _why(ref: dict[str, Any] | None, row: str) -> str:
    if ref is None:
        return "no context was run"
    for name in ("kvtier", row):
        if ref["rows"].get(name, {}).get("skipped"):
            return f"{ROW_NAMES[name]}: {ref['rows'][name]['skipped']}"
    return "not measured"


# ------------------------------------------------------------------------------------------------ the run
def machine(device: torch.device) -> dict[str, Any]:
    import transformers

    out = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
           "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "torch_threads": torch.get_num_threads(), "device": str(device)}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["cuda"] = torch.version.cuda
        out["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return out


def run_gpu_bench(cfg: GpuBenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Every section of the benchmark; returns the JSON-ready result (targets included)."""
    progress = progress or Progress(False)
    t_start = time.perf_counter()
    device = torch.device(cfg.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)   # events, streams and the allocators' figures follow the current device
    clock = Clock(device)
    shape = SHAPES[cfg.shape]
    full_layers = shape["num_hidden_layers"]
    result: dict[str, Any] = {
        "benchmark": "kvtier bench gpu", "device": str(device), "machine": machine(device),
        "shape": {"preset": cfg.shape, **{k: v for k, v in shape.items() if k != "num_hidden_layers"},
                  "layers": cfg.num_layers, "layers_in_shape": full_layers,
                  "truncated": cfg.num_layers < full_layers, "dtype": "bfloat16", "batch": 1, "weights": "random",
                  "rope": ROPE, "kv_bytes_per_token": kv_bytes_per_token(shape, cfg.num_layers)},
        "settings": asdict(cfg), "seconds": {}, "decode": []}
    seconds = result["seconds"]

    t = time.perf_counter()
    result["bandwidth"] = measure_bandwidth(cfg, device, progress)
    seconds["bandwidth"] = _r(time.perf_counter() - t, 2)

    scorers: dict[int, tuple[Any, str]] = {}

    def scorer_for(config: Any) -> tuple[Any, str]:
        n = config.num_hidden_layers
        if n not in scorers:
            scorers[n] = kvp_for(config, n, shape["num_key_value_heads"], shape["head_dim"], cfg.seed)
        return scorers[n]

    if cfg.contexts:
        progress.say(f"building the model: {cfg.shape}, {cfg.num_layers} layers, bf16, random weights on {device}")
        built = _attempt("model", lambda: dict(zip(("model", "seconds"),
                                                   build_model(cfg.shape, cfg.num_layers, device, cfg.seed))),
                         device, progress)
        if "skipped" in built:
            result["decode"] = [{"context": c, "skipped": f"the model could not be built ({built['skipped']})"}
                                for c in cfg.contexts]
        else:
            model = built.pop("model")
            seconds["model_init"] = _r(built["seconds"], 2)
            scorer, result["scorer"] = scorer_for(model.config)
            for i, context in enumerate(sorted(cfg.contexts)):
                t = time.perf_counter()
                row = _attempt(f"{context:,} tokens", lambda: run_context(
                    cfg, model, context, scorer, clock, progress, growth=i == 0), device, progress)
                row.setdefault("context", context)
                result["decode"].append(row)
                seconds[f"context_{context}"] = _r(time.perf_counter() - t, 2)
            del model
            _free(device, host=True)
    if cfg.million:
        t = time.perf_counter()
        result["million"] = _attempt("1M", lambda: run_million(cfg, scorer_for, clock, progress), device, progress)
        seconds["million"] = _r(time.perf_counter() - t, 2)
    seconds["total"] = _r(time.perf_counter() - t_start, 2)
    result["targets"] = evaluate_targets(result)
    result["targets_note"] = ("the issue's targets, set for an H200" + ("" if device.type == "cuda" else
                              f"; on {device.type} the verdicts only exercise the code, they judge nothing"))
    return result


# ------------------------------------------------------------------------------------------------ the table
def _fmt(x: float | None, spec: str, unit: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def _tokens(n: int) -> str:
    return f"{n // 2**20}M" if n % 2**20 == 0 else f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def format_report(result: dict[str, Any]) -> str:
    """The result as a plain-text table."""
    sh, m = result["shape"], result["machine"]
    lines = [f"kvtier bench gpu on {m.get('gpu', m['device'])} ({m['device']}), torch {m['torch']}, transformers "
             f"{m['transformers']}, {m['torch_threads']} CPU thread(s)",
             f"shape {sh['preset']}: {sh['layers']} of {sh['layers_in_shape']} layers"
             f"{' (TRUNCATED)' if sh['truncated'] else ''}, hidden {sh['hidden_size']}, {sh['num_attention_heads']} "
             f"heads, {sh['num_key_value_heads']} KV heads x {sh['head_dim']}, bf16, batch 1, random weights; "
             f"scorer {result.get('scorer', '-')}", ""]
    bw = result["bandwidth"]
    lines.append("bandwidth (GB/s = 1e9 bytes/s)")
    for key in ("raw_copy", "raw_copy_batch"):
        r = bw.get(key, {})
        if r.get("skipped"):
            lines.append(f"  raw copy: skipped ({r['skipped']})")
            continue
        lines.append(f"  raw {'pinned ' if r['pinned'] else ''}copy {r['bytes'] / MiB:,.0f} MiB: host->device "
                     f"{_fmt(r['host_to_device_gbps'], '.1f')}, device->host {_fmt(r['device_to_host_gbps'], '.1f')}")
    tiers, raw = bw.get("tiers", {}), bw.get("raw_copy", {})
    if tiers.get("skipped"):
        lines.append(f"  kvtier batches: skipped ({tiers['skipped']})")
    else:
        for key, label, ref in (("demotion", "demotion (_to_host)", "device_to_host_gbps"),
                                ("demotion_commit", "demotion (commit, end to end)", "device_to_host_gbps"),
                                ("recall", "recall (_bring_up)", "host_to_device_gbps"),
                                ("recall_step", "recall, one step's pages", "host_to_device_gbps")):
            r = tiers[key]
            share = r["gbps"] / raw[ref] if r.get("gbps") and raw.get(ref) else None
            lines.append(f"  {label:<32}{r['bytes'] / MiB:>9.2f} MiB {_fmt(r['gbps'], '8.2f')}  "
                         f"{_fmt(None if share is None else share * 100, '.0f', '% of raw')}")
    lines += ["  (kvtier batches timed directly through LayerEngine, synchronised; see JSON 'method')", "",
              "decode step, ms (median)"]
    head = f"  {'context':>8}  {'prefill s':>9}  {'kvtier':>9}  {'Dynamic':>9}  {'offload':>9}  " \
           f"{'Dyn/kvtier':>10}  {'off/kvtier':>10}  {'KVP % prefill':>13}"
    lines.append(head)
    skipped = []
    for row in result["decode"]:
        if row.get("skipped"):
            lines.append(f"  {_tokens(row['context']):>8}  skipped: {row['skipped']}")
            continue
        cells = []
        for name in ("kvtier", "dynamic", "offloading"):
            r = row["rows"][name]
            cells.append(_fmt(r.get("step_ms_median"), "9.2f") if not r.get("skipped") else f"{'skipped':>9}")
            if r.get("skipped"):
                skipped.append(f"  {_tokens(row['context'])} {ROW_NAMES[name]}: {r['skipped']}")
        kvp = row.get("kvp_scoring", {})
        frac = None if kvp.get("skipped") else kvp.get("fraction_of_prefill")
        ra = row["ratios"]
        lines.append(f"  {_tokens(row['context']):>8}  {_fmt(row['prefill_seconds'], '9.2f')}  {cells[0]:>9}  "
                     f"{cells[1]:>9}  {cells[2]:>9}  {_fmt(ra['dynamic_over_kvtier'], '9.2f', 'x'):>10}  "
                     f"{_fmt(ra['offloading_over_kvtier'], '9.1f', 'x'):>10}  "
                     f"{_fmt(None if frac is None else frac * 100, '12.2f', '%'):>13}")
    lines += skipped
    growth = next((r["rows"]["kvtier"]["growth"] for r in result["decode"]
                   if "growth" in r.get("rows", {}).get("kvtier", {})), None)
    if growth:
        lines.append(f"  memory over {growth['steps']} kvtier steps at {_tokens(result['decode'][0]['context'])}: "
                     f"device {growth['device_growth_bytes'] / MiB:+.1f} MiB, "
                     f"host {growth['host_growth_bytes'] / MiB:+.1f} MiB "
                     f"(allowed {growth['allowance']['device_bytes'] / MiB:.1f} / "
                     f"{growth['allowance']['host_bytes'] / MiB:.1f} MiB for {growth['new_tokens']} new tokens)")
    mil = result.get("million")
    if mil is not None:
        lines += ["", f"synthetic {_tokens(mil.get('context', result['settings']['million_context']))}"]
        if mil.get("skipped"):
            lines.append(f"  skipped: {mil['skipped']}")
        else:
            t = mil["tiers"]
            allocated = None if mil["gpu_allocated_bytes"] is None else mil["gpu_allocated_bytes"] / GiB
            lines += [f"  {mil['context']:,} tokens in {mil['layers']} layer(s) ({mil['layers_why']}); fill "
                      f"{mil['fill_seconds']} s; decode step {mil['step_ms_median']:.2f} ms "
                      f"({mil['step_ms_per_layer']:.3f} ms per layer)",
                      f"  GPU: device tier + index {mil['device_tier_plus_index_bytes'] / GiB:.2f} GiB "
                      "(cache pools), "
                      f"allocated {_fmt(allocated, '.2f', ' GiB')}; projected to {sh['layers_in_shape']} layers: "
                      f"{mil['projected_gpu_bytes_full_shape'] / GiB:.2f} GiB",
                      f"  tiers: device {t['device']['bytes'] / GiB:.2f} GiB ({t['device']['tokens']:,} entries), "
                      f"host {t['host']['bytes'] / GiB:.2f} GiB, disk {t['disk']['bytes'] / GiB:.2f} GiB"]
    lines += ["", f"targets ({result.get('targets_note', '')})"]
    for t in result["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[t["pass"]]
        lines.append(f"  {verdict:<5}{t['name']:<28}{_fmt(t['measured'], '.3g'):>8} {t['unit']:<9}"
                     f"(limit {t['threshold']:.3g})  {t['note']}")
    lines.append(f"\ntotal {result['seconds']['total']:.1f} s")
    return "\n".join(lines)
