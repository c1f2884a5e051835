"""The whole run: the machine, then bandwidth, each context, the 1M row and the targets, into one
JSON-ready result.
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict
from typing import Any, Callable

import torch

from ...native import indexed_device
from .bandwidth import measure_bandwidth
from .context import run_context, run_growth
from .launch_cost import measure_launch_cost
from .million import run_million
from .model import ROPE, SHAPES, build_model, kv_bytes_per_token, kvp_for
from .pool_attention import measure_pool_attention
from .settings import GpuBenchConfig
from .targets import evaluate_targets
from .timing import Clock, Progress, Skip, _attempt, _free, _r


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


def run_gpu_bench(cfg: GpuBenchConfig, progress: Progress | None = None,
                  checkpoint: Callable[[dict[str, Any]], None] | None = None,
                  started: float | None = None) -> dict[str, Any]:
    """Every section of the benchmark; returns the JSON-ready result (targets included).

    `checkpoint` gets the result so far after each section (marked ``"partial": True``), so a run cut short by
    a lease or a timeout still leaves what it measured. `started` (a `time.time()`): when the command began, its
    start-up included, where the run is a command of its own (then "under 5 minutes" judges that wall clock)."""
    progress = progress or Progress(False)

    def done(section: str, context_so_far: dict[str, Any] | None = None) -> None:
        if checkpoint is not None:   # with the targets judged so far: a run cut short still says where it stands
            snapshot = {**result, "partial": True, "last_section": section, "targets": evaluate_targets(result)}
            if context_so_far is not None:   # a context's rows so far (its targets are judged once it is done)
                snapshot["decode"] = [*result["decode"], {**context_so_far, "partial": True}]
            checkpoint(snapshot)

    t_start = time.perf_counter()
    # where the time limit ends, on the perf_counter clock (the command's start-up counts where it is known)
    limit_at = None if cfg.time_limit is None else \
        t_start + cfg.time_limit - (0.0 if started is None else max(0.0, time.time() - started))
    device = torch.device(cfg.device)
    if device.type == "cuda":
        # indexed ("cuda" is the current device): what the run makes is compared with the tensors' "cuda:N"
        device = indexed_device(device)
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
    done("bandwidth")

    t = time.perf_counter()
    result["launch_cost"] = _attempt("launch cost", lambda: measure_launch_cost(device), device, progress)
    seconds["launch_cost"] = _r(time.perf_counter() - t, 2)
    done("launch_cost")

    t = time.perf_counter()
    pool_contexts = sorted(cfg.contexts) + ([cfg.million_context] if cfg.million else [])
    progress.say(f"device pool attention, one pass against per slab, at {len(pool_contexts)} context(s)")
    result["pool_attention"] = _attempt("pool attention", lambda: measure_pool_attention(
        cfg, device, clock, pool_contexts), device, progress)
    seconds["pool_attention"] = _r(time.perf_counter() - t, 2)
    done("pool_attention")

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
                    cfg, model, context, scorer, clock, progress, first=i == 0,
                    checkpoint=lambda so_far: done(f"context_{context}", so_far)), device, progress)
                row.setdefault("context", context)
                result["decode"].append(row)
                seconds[f"context_{context}"] = _r(time.perf_counter() - t, 2)
                done(f"context_{context}")
            del model
            _free(device, host=True)
    if cfg.million:
        t = time.perf_counter()
        result["million"] = _attempt("1M", lambda: run_million(cfg, scorer_for, clock, progress), device, progress)
        seconds["million"] = _r(time.perf_counter() - t, 2)
        done("million")
    if cfg.contexts and cfg.growth_steps:
        t = time.perf_counter()
        result["growth"] = _attempt("memory growth", lambda: _growth_last(cfg, result, scorer_for, clock, progress,
                                                                          limit_at), device, progress)
        seconds["growth"] = _r(time.perf_counter() - t, 2)
    seconds["total"] = _r(time.perf_counter() - t_start, 2)
    if started is not None:   # the command's own wall clock, start-up and imports included
        seconds["process"] = _r(time.time() - started, 2)
    result["targets"] = evaluate_targets(result)
    result["targets_note"] = ("the issue's targets, set for an H200" + ("" if device.type == "cuda" else
                              f"; on {device.type} the verdicts only exercise the code, they judge nothing"))
    return result


GROWTH_MARGIN = 5.0   # seconds kept back from the time limit for what follows the growth run (targets, JSON, table)


def _growth_last(cfg: GpuBenchConfig, result: dict[str, Any], scorer_for: Callable[[Any], tuple[Any, str]],
                 clock: Clock, progress: Progress, limit_at: float | None) -> dict[str, Any]:
    """The memory-growth run at the smallest context, after everything else, stopped where the time limit says.
    Skipped where what is left would not cover twice its set-up (the model's build, and that context's prefill
    and kvtier fill, as this run measured them before)."""
    # the pinned blocks torch's host allocator keeps from the rows before (the 1M row's, tens of GiB) go back
    # first: cached, they could serve the run's new pinned memory unseen, and freeing them takes time
    _free(clock.device, host=True)
    context = min(cfg.contexts)
    deadline = None if limit_at is None else limit_at - GROWTH_MARGIN
    if deadline is not None:
        row = next((r for r in result["decode"] if r.get("context") == context), {})
        setup = sum(x or 0.0 for x in (row.get("prefill_seconds"), row.get("rows", {}).get("kvtier", {}).get(
            "fill_seconds"), result["seconds"].get("model_init")))
        left = deadline - time.perf_counter()
        if left < 2 * setup:
            raise Skip(f"{max(0.0, left):.0f} s left under the time limit of {cfg.time_limit:g} s, where its set-up "
                       f"(model, prefill and fill at {context:,}) took {setup:.0f} s (--time-limit)")
    model, _ = build_model(cfg.shape, cfg.num_layers, clock.device, cfg.seed)   # the contexts' model, seeded
    try:
        return run_growth(cfg, model, context, scorer_for(model.config)[0], clock, progress, deadline)
    finally:
        del model
        _free(clock.device, host=True)
