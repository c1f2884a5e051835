"""The synthetic 1M row: random K/V written into a TieredCache layer by layer, then decode steps through a
model of as many layers, for the GPU bytes of the device tier and the recall index.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .host_profile import kernel_profile, profile_steps
from .model import DTYPE, SHAPES, build_model, kv_bytes_per_token
from .settings import GpuBenchConfig
from .steps import _step_row, _tier_summary, decode_steps, warm_until_replayed
from .timing import GiB, Clock, Progress, _attempt, _free, _median, _r

MILLION_HOST_SHARE = 0.35          # of the available host memory the 1M row may pin (the rest stays free)
MILLION_DEFAULT_LAYERS = 8         # layers filled at 1M by default (time: pinning ~1-2 GB/s)


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
    from ...integrations.hf import TieredCache
    from ...integrations.model_graph import DecodeGraph

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
        capture_steps, token = warm_until_replayed(model, cache, token, clock)
        times, token = decode_steps(model, cache, token, cfg.steps, clock, progress, "1M decode")
        # what the cache holds on the device (its pools, recall buffers and layer graphs), taken before the
        # DecodeGraph row adds a graph of the whole model's step: a per-process cost the projection to the
        # shape's layers would otherwise multiply
        measured = None if base is None else torch.cuda.memory_allocated(device) - base
        whole = None
        if cfg.decode_graph:   # the same cache stepped by DecodeGraph: the model's step and the cache's, one graph
            def stepped_whole() -> dict:
                nonlocal token
                graph = DecodeGraph(model, cache)
                _, token = decode_steps(model, graph, token, 1, clock)   # the first steady step runs eagerly
                graph_capture, token = warm_until_replayed(model, graph, token, clock)
                before = graph.stats()
                graph_times, token = decode_steps(model, graph, token, cfg.steps, clock, progress,
                                                  "1M decode, one graph")
                after = graph.stats()
                return {"step_ms_median": _r(_median(graph_times) * 1e3),
                        "step_ms": [_r(t * 1e3) for t in graph_times],
                        "step_ms_per_layer": _r(_median(graph_times) * 1e3 / layers, 4),
                        "capturing_warmup_ms": graph_capture, "decode_graph": after,
                        "decode_graph_timed": {k: after[k] - before[k] for k in ("replays", "captures", "eager",
                                                                                  "ordinary")},
                        "graph_gpu_bytes": (None if base is None else
                                            torch.cuda.memory_allocated(device) - base - measured)}

            # a failure here keeps the row's own steps and bytes (the 1M targets' figures)
            whole = _attempt("1M decode through DecodeGraph", stepped_whole, device, progress)
        st = cache.stats()
        dev_stats = st["device"]["reserved_bytes"] + st["device"]["index_bytes"]
        scale = cfg.num_layers / layers
        full_layers = SHAPES[cfg.shape]["num_hidden_layers"]
        out = _step_row(times, context=ctx, layers=layers, layers_in_run=cfg.num_layers, layers_in_shape=full_layers,
                        layers_why=why, synthetic=True, scorer=scorer_name, model_init_seconds=_r(init_s, 2),
                        fill_seconds=_r(fill_s, 2), tiers=_tier_summary(st),
                        device_tier_plus_index_bytes=dev_stats, recall_buffer_bytes=st["device"]["recall_bytes"],
                        gpu_allocated_bytes=measured,
                        per_layer_gpu_bytes=int((measured if measured is not None else dev_stats) / layers),
                        step_ms_per_layer=_r(_median(times) * 1e3 / layers, 4), cuda_graphs=st["cuda_graphs"],
                        capturing_warmup_ms=capture_steps, decode_graph=whole)
        if cfg.profile_steps:   # where the step's time goes at 1M: the device's kernels above all
            out["host_profile"] = _attempt("1M host profile", lambda: profile_steps(
                model, cache, token, cfg.profile_steps, clock), device, progress)
            out["device_profile"] = _attempt("1M device profile", lambda: kernel_profile(
                model, cache, token, cfg.profile_steps, clock), device, progress)
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
