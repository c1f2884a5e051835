"""One context's rows: prefill once, then kvtier, DynamicCache and DynamicCache(offloading=True) decode on
the same K/V, with the share of the prefill that KVP scoring of every entry would take; and the memory-growth
run, set up from a context the same way.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from .growth import _growth
from .host_profile import kernel_profile, profile_demotion, profile_steps
from .settings import GpuBenchConfig
from .steps import _layer_kv, _step_row, _tier_summary, decode_steps, prefill, steps_in_turn, warm_until_replayed
from .timing import Clock, Progress, Skip, _attempt, _free, _median, _r

# "kvtier" is the cache as made by default (on CUDA its steps replay from CUDA graphs, each step's prefetch
# within its graph); "kvtier_eager" the same with its launches issued one by one (cuda_graphs=False);
# "kvtier_side_prefetch" the default with the prefetch on the side stream, replayed there from graphs of its own;
# "kvtier_no_prefetch" the default without prefetch; "kvtier_graph" the default cache stepped by `DecodeGraph`
# (the model's step and the cache's as one CUDA graph, where the step is steady); "kvtier_disk" the default with
# a host budget, so that every layer has pages on disk (recall planned on the device, a read back a step), and
# "kvtier_disk_host_plan" the same with recall planned on the host (`device_recall=False`)
ROW_NAMES = {"kvtier": "kvtier", "kvtier_graph": "kvtier, whole step as one CUDA graph (DecodeGraph)",
             "kvtier_eager": "kvtier, eager (no CUDA graphs)",
             "kvtier_side_prefetch": "kvtier, prefetch on the side stream", "kvtier_no_prefetch": "kvtier, no prefetch",
             "kvtier_disk": "kvtier, pages on disk", "kvtier_disk_host_plan": "kvtier, pages on disk, planned on host",
             "dynamic": "DynamicCache", "offloading": "DynamicCache(offloading=True)"}
OFFLOADING_WARMUP = 12   # untimed steps of DynamicCache(offloading=True) after its fill, at least


def _graph_counts_since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """The CUDA graph captures, replays and eager steps between two of `stats()["cuda_graphs"]` (a row's timed
    steps, apart from its warm-up), the prefetches' on the side stream beside them."""
    keys = ("captures", "replays", "eager_steps")
    out = {k: after[k] - before[k] for k in keys}
    out.update({f"prefetch_{k}": after["prefetch"][k] - before["prefetch"][k] for k in ("captures", "replays", "eager")})
    return out


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


def _prefilled(cfg: GpuBenchConfig, model: Any, context: int, clock: Clock,
               progress: Progress) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, float]:
    """The context's seeded tokens (the same wherever it is prefilled) through the model into a `DynamicCache`, in
    chunks: the cache, its layers' K/V, the last token (the first decode step's input) and the prefill's seconds."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(cfg.seed + context)
    ids = torch.randint(model.config.vocab_size, (1, context), generator=g).to(clock.device)
    progress.say(f"{context:,} tokens: prefill through the model (chunks of {cfg.prefill_chunk:,})")
    full = DynamicCache(config=model.config)
    seconds = prefill(model, ids, full, cfg.prefill_chunk, clock, progress)
    return full, [_layer_kv(full, i) for i in range(cfg.num_layers)], ids[:, -1:].clone(), seconds


def _default_tiered(cfg: GpuBenchConfig, model: Any, scorer: Any, host_budget: float | None = None,
                    graphs: bool = True, prefetch: int | None = None) -> Any:
    """A TieredCache with the run's budget and recall, otherwise as made by default."""
    from ...integrations.hf import TieredCache

    return TieredCache(model.config, device_budget=cfg.device_budget, host_budget=host_budget, scorer=scorer,
                       recall_pages=cfg.recall_pages, cuda_graphs=graphs, prefetch_pages=prefetch)


def run_context(cfg: GpuBenchConfig, model: Any, context: int, scorer: Any, clock: Clock, progress: Progress,
                first: bool, checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """One context: prefill once (DynamicCache, chunked), then each cache's decode step on the same K/V.
    `first`: the smallest context, where the kvtier row also profiles a demoting step. `checkpoint` gets the
    context's row so far after each cache's row."""
    from transformers import DynamicCache

    from ...integrations.model_graph import DecodeGraph

    device, layers = clock.device, cfg.num_layers
    row: dict[str, Any] = {"context": context, "rows": {}}
    full, kv, token, seconds = _prefilled(cfg, model, context, clock, progress)
    row["prefill_seconds"] = _r(seconds, 3)
    row["kvp_scoring"] = _attempt("KVP scoring", lambda: kvp_scoring(scorer, full, layers, cfg.prefill_chunk, clock,
                                                                      row["prefill_seconds"]), device, progress)

    # DynamicCache's timed steps, taken in turn with the kvtier row's (`steps_in_turn`): the ratio of the two
    # then does not depend on how the machine's speed drifted between one row and the other
    paired: dict[str, Any] = {}

    def tiered(graphs: bool = True, prefetch: int | None = None, profile: bool = True, demoting: bool = False,
               in_step: bool | None = None, in_turn: bool = False, whole: bool = False,
               disk: str | None = None) -> dict[str, Any]:
        if device.type != "cuda" and not (graphs and prefetch is None and in_step is None):
            raise Skip("not run on cpu: without CUDA graphs or prefetch there it is the kvtier row again")
        # `disk`: a host budget sends pages to disk; recall planned on the "device" (on CUDA, the default) or "host"
        cache = _default_tiered(cfg, model, scorer, None if disk is None else cfg.disk_host_budget, graphs, prefetch)
        for engine in cache._engines:   # where a step's prefetch runs (None: in its graph, where it has one)
            engine.prefetch_in_step = in_step
            if disk is not None:
                engine.device_recall = disk == "device"
        try:
            fill = clock.time(lambda: _fill_from(cache, kv, cfg.prefill_chunk, progress, "kvtier fill"))
            stepper = DecodeGraph(model, cache) if whole else cache   # what `decode_steps` steps through
            _, t = decode_steps(model, stepper, token, cfg.warmup, clock)
            capture_steps, t = warm_until_replayed(model, stepper, t, clock)
            issued: list[float] = []
            graphs_before = cache.stats()["cuda_graphs"]
            whole_before = stepper.stats() if whole else None
            in_turn_with = None
            if in_turn:   # DynamicCache warmed, then a step of each in turn (its steps grow the shared K/V)
                _, dt = decode_steps(model, full, token, cfg.warmup, clock)
                (times, issued, t), (d_times, d_issued, dt) = steps_in_turn(
                    model, [(cache, t), (full, dt)], cfg.steps, clock, progress, "kvtier and DynamicCache in turn")
                in_turn_with = {"times": d_times, "issued": d_issued, "token": dt, "kvtier": times}
            else:
                times, t = decode_steps(model, stepper, t, cfg.steps, clock, progress, "kvtier decode", issued=issued)
            stats = cache.stats()
            out = _step_row(times, issued, fill_seconds=_r(fill, 3), tiers=_tier_summary(stats),
                            cuda_graphs=stats["cuda_graphs"], demotions=stats["demotions"],
                            cuda_graphs_timed=_graph_counts_since(graphs_before, stats["cuda_graphs"]))
            if whole:   # how its steps ran: replayed whole, captured, planned and launched eagerly, ordinary
                after = stepper.stats()
                out["decode_graph"] = after
                out["decode_graph_timed"] = {k: after[k] - whole_before[k] for k in
                                             ("replays", "captures", "eager", "ordinary")}
            if device.type == "cuda" and graphs:
                out["capturing_warmup_ms"] = capture_steps   # after the --warmup steps, before the timed ones
            if in_turn_with is not None:   # the timed steps are done: DynamicCache's row has them whatever follows
                paired.update(in_turn_with)

            # what follows the timed steps stands alone: a failure in a profile or a long run is recorded under its
            # own name and keeps the row's timed steps (those the targets judge)
            def extra(what: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
                return _attempt(f"{context:,} tokens: {what}", fn, device, progress)

            def demotion() -> dict[str, Any]:
                nonlocal t
                prof, t = profile_demotion(model, cache, t, clock)
                return prof

            def sustained() -> dict[str, Any]:
                before = stepper.stats()
                run = _growth(cfg, model, cache, t, layers, clock, progress, cfg.sustained_steps, stepper)
                after = stepper.stats()
                run["decode_graph"] = {k: after[k] - before[k] for k in ("replays", "captures", "eager", "ordinary")}
                return run

            if cfg.profile_steps and profile:
                progress.say(f"{context:,} tokens: {cfg.profile_steps} kvtier steps under cProfile")
                out["host_profile"] = extra("host profile", lambda: profile_steps(model, stepper, t,
                                                                                  cfg.profile_steps, clock))
                out["device_profile"] = extra("device profile", lambda: kernel_profile(
                    model, stepper, t, cfg.profile_steps, clock))
                if demoting:   # one context is enough: where a demoting step's extra time goes
                    progress.say(f"{context:,} tokens: kvtier steps under cProfile until one demotes")
                    out["demotion_profile"] = extra("demotion profile", demotion)
            if whole and cfg.sustained_steps:   # what a long decode sees: demotions and the captures after them
                progress.say(f"{context:,} tokens: {cfg.sustained_steps} steps through DecodeGraph, demotions "
                             "included")
                out["sustained"] = extra("sustained run", sustained)
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
        # its first steps after the fill are slower for a dozen steps (on an H200 at 128K: 926 ms falling to a
        # steady ~450, the pinned allocator growing blocks for layers a token longer than filled): warmed longer
        warm, t = decode_steps(model, cache, token, max(cfg.warmup, OFFLOADING_WARMUP), clock)
        issued: list[float] = []
        times, _ = decode_steps(model, cache, t, cfg.steps, clock, progress, "offloading decode", issued=issued)
        del cache
        return _step_row(times, issued, fill_seconds=_r(fill, 3), warmup_ms=[_r(w * 1e3) for w in warm])

    def dynamic() -> dict[str, Any]:
        if paired:   # timed in turn with the kvtier row's steps
            times, issued, t = paired["times"], paired["issued"], paired["token"]
        else:
            _, t = decode_steps(model, full, token, cfg.warmup, clock)
            issued = []
            times, t = decode_steps(model, full, t, cfg.steps, clock, progress, "DynamicCache decode", issued=issued)
        out = _step_row(times, issued, where=device.type, timed_in_turn_with_kvtier=bool(paired))
        if cfg.profile_steps:   # the same profiles as kvtier's rows: the model's own share of the host's time
            out["host_profile"] = profile_steps(model, full, t, cfg.profile_steps, clock)
            out["device_profile"] = _attempt("device profile", lambda: kernel_profile(
                model, full, t, cfg.profile_steps, clock), device, progress)
        return out

    runs = (("kvtier_eager", lambda: tiered(graphs=False)),
            ("kvtier_side_prefetch", lambda: tiered(in_step=False, profile=False)),
            ("kvtier_no_prefetch", lambda: tiered(prefetch=0, profile=False)), ("offloading", offloaded),
            ("kvtier_graph", lambda: tiered(whole=True)),
            ("kvtier", lambda: tiered(demoting=first, in_turn=True)), ("dynamic", dynamic),
            ("kvtier_disk", lambda: tiered(disk="device", profile=False)),
            ("kvtier_disk_host_plan", lambda: tiered(disk="host", profile=False)))
    # the kvtier row (DynamicCache's steps in turn with it) and DynamicCache's own after the others: DynamicCache's
    # steps grow the shared K/V by a copy (`torch.cat`) while `kv` keeps the prefill's, so the rows before fill from
    # it alone; the disk rows (their fill writes to disk) come last, so that a run cut short by its time keeps
    # the rows the targets judge
    for name, fn in runs:
        if (name == "kvtier_eager" and not cfg.eager) or (name == "kvtier_graph" and not cfg.decode_graph):
            continue
        if name in ("kvtier_side_prefetch", "kvtier_no_prefetch") and not (cfg.no_prefetch and
                                                                          context == max(cfg.contexts)):
            continue   # at the largest context only: the run stays within its time
        if name.startswith("kvtier_disk") and (cfg.disk_host_budget is None or context != min(cfg.contexts)):
            continue   # at the smallest context only
        progress.say(f"{context:,} tokens: {ROW_NAMES[name]}")
        row["rows"][name] = _attempt(f"{context:,} {ROW_NAMES[name]}", fn, device, progress)
        # offloading's copies leave pinned blocks in torch's host cache (tens of GiB at 128K): given back at once
        stuck = _free(device, host=name == "offloading")
        if stuck is not None:   # an error the row's own work left on the device, seen only now
            row["rows"][name]["device_error_after"] = stuck
        if checkpoint is not None:
            checkpoint(row)
    del kv, full
    _free(device, host=True)
    rows = row["rows"]
    k_ms = rows["kvtier"].get("step_ms_median")
    row["ratios"] = {f"{name}_over_kvtier": (_r(rows[name]["step_ms_median"] / k_ms)
                                             if k_ms and rows[name].get("step_ms_median") else None)
                     for name in ("dynamic", "offloading")}
    if paired:   # the median of each turn's own ratio: DynamicCache's step over the kvtier step just before it
        row["ratios"]["dynamic_over_kvtier_by_turn"] = _r(_median([d / k for d, k in zip(paired["times"],
                                                                                         paired["kvtier"])]))
    graph_ms = rows.get("kvtier_graph", {}).get("step_ms_median")
    if "kvtier_graph" in rows:   # the whole step replayed: against each cache, and what it saves the kvtier row
        for name in ("dynamic", "offloading", "kvtier"):
            other = rows[name].get("step_ms_median")
            row["ratios"][f"{name}_over_kvtier_graph"] = _r(other / graph_ms) if other and graph_ms else None
        # over a long decode: DynamicCache's step against the mean of the sustained run's (demotions, captures)
        mean = rows["kvtier_graph"].get("sustained", {}).get("step_ms_mean")
        other = rows["dynamic"].get("step_ms_median")
        row["ratios"]["dynamic_over_kvtier_graph_sustained"] = _r(other / mean) if other and mean else None
    if "kvtier_disk" in rows:   # the disk rows: each plan against the other, the device plan against the others
        d = rows["kvtier_disk"].get("step_ms_median")
        h = rows.get("kvtier_disk_host_plan", {}).get("step_ms_median")
        row["ratios"]["kvtier_disk_host_plan_over_kvtier_disk"] = _r(h / d) if d and h else None
        row["ratios"]["kvtier_disk_over_kvtier"] = _r(d / k_ms) if d and k_ms else None
        other = rows["dynamic"].get("step_ms_median")
        row["ratios"]["dynamic_over_kvtier_disk"] = _r(other / d) if d and other else None
    for name, key in (("kvtier_eager", "kvtier_eager_over_kvtier"),
                      ("kvtier_side_prefetch", "kvtier_side_prefetch_over_kvtier"),
                      ("kvtier_no_prefetch", "kvtier_over_no_prefetch")):
        other = rows.get(name, {}).get("step_ms_median")
        if name in rows:   # what the CUDA graphs save, what the prefetch within them saves, what prefetch costs
            row["ratios"][key] = (_r(k_ms / other) if name == "kvtier_no_prefetch" else _r(other / k_ms)) \
                if other and k_ms else None
    return row


def run_growth(cfg: GpuBenchConfig, model: Any, context: int, scorer: Any, clock: Clock, progress: Progress,
               deadline: float | None) -> dict[str, Any]:
    """The memory-growth run, the command's last: the kvtier cache as made by default, filled with a prefill of
    `context`'s tokens, warmed until its steps replay, then `cfg.growth_steps` steps (those that demote, and those
    that capture after, included), stopped at `cfg.growth_seconds` or at `deadline` (a `time.perf_counter()`).
    Last, so that it takes what the time limit leaves and never the time of the rows the other targets judge."""
    full, kv, token, _ = _prefilled(cfg, model, context, clock, progress)
    del full   # `kv` holds its tensors
    cache = _default_tiered(cfg, model, scorer)
    try:
        _fill_from(cache, kv, cfg.prefill_chunk, progress, "kvtier fill")
        del kv
        # as the rows' timed steps begin (warmed, replaying), then as many steps as a row times: the state the
        # growth run started from when it followed the kvtier row's timed steps
        _, t = decode_steps(model, cache, token, cfg.warmup, clock)
        _, t = warm_until_replayed(model, cache, t, clock)
        _, t = decode_steps(model, cache, t, cfg.steps, clock)
        if deadline is not None and time.perf_counter() > deadline:
            raise Skip("the time limit was reached during its set-up (--time-limit)")
        progress.say(f"memory growth: up to {cfg.growth_steps} kvtier decode steps at {context:,}")
        return {"context": context, **_growth(cfg, model, cache, t, cfg.num_layers, clock, progress,
                                              deadline=deadline)}
    finally:
        cache.close()
        cache.detach_attention()
