"""Driving the model through a cache: chunked prefill and decode steps, each timed alone, and the parts of
a row every decode measurement reports (step times, tier figures).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .timing import Clock, Progress, _median, _r


def _layer_kv(cache: Any, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    layer = cache.layers[i]
    return layer.keys, layer.values


@torch.no_grad()
def prefill(model: Any, ids: torch.Tensor, cache: Any, chunk: int, clock: Clock, progress: Progress) -> float:
    """Chunked prefill (activations stay small); returns the seconds."""
    from ...integrations.hf import cache_kwargs

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
                 deadline: float | None = None, demoted: list[bool] | None = None,
                 issued: list[float] | None = None) -> tuple[list[float], torch.Tensor]:
    """`n` greedy decode steps, each timed alone (synchronised); stops early past `deadline` (perf_counter).
    `demoted`, when given, gets whether each step moved entries down from the device (a kvtier cache);
    `issued` the seconds the host took to issue each step (until the forward returned, before the wait for the
    device): a step whose issue takes about its whole time is bound by the host, not by the device."""
    times = []
    steps = range(n) if progress is None else progress.bar(range(n), desc, total=n)
    forward = _forward(model, cache)
    counters = getattr(getattr(cache, "cache", cache), "counters", None)
    moved = (lambda: counters.bytes_moved["device_to_host"]) if demoted is not None else (lambda: 0)
    for _ in steps:
        clock.sync()
        before = moved()
        t0 = time.perf_counter()
        token = forward(token)[:, -1:].argmax(-1)
        if issued is not None:
            issued.append(time.perf_counter() - t0)
        clock.sync()
        times.append(time.perf_counter() - t0)
        if demoted is not None:
            demoted.append(moved() > before)
        if deadline is not None and time.perf_counter() > deadline:
            break
    return times, token


def _forward(model: Any, cache: Any) -> Any:
    """A decode step's logits from a token: through `cache` (a `DecodeGraph` steps the model itself)."""
    from ...integrations.hf import cache_kwargs
    from ...integrations.model_graph import DecodeGraph

    if isinstance(cache, DecodeGraph):
        return cache
    return lambda token: model(token, **cache_kwargs(cache), use_cache=True).logits


def steps_in_turn(model: Any, runs: list[tuple[Any, torch.Tensor]], n: int, clock: Clock,
                  progress: Progress | None = None,
                  desc: str = "decode in turn") -> list[tuple[list[float], list[float], torch.Tensor]]:
    """`n` greedy decode steps of each ``(cache, token)`` of `runs`, one step of each in turn, each timed alone
    (`decode_steps`). A host-bound step's time drifts with the machine (on a shared VM by up to a factor of two
    over a few seconds); taken in turn, the drift falls on every cache alike. Returns, per cache, the seconds of
    its steps, the seconds the host took to issue each, and its next token."""
    times: list[list[float]] = [[] for _ in runs]
    issued: list[list[float]] = [[] for _ in runs]
    tokens = [token for _, token in runs]
    for _ in (range(n) if progress is None else progress.bar(range(n), desc, total=n)):
        for i, (cache, _) in enumerate(runs):
            got, tokens[i] = decode_steps(model, cache, tokens[i], 1, clock, issued=issued[i])
            times[i] += got
    return list(zip(times, issued, tokens))


GRAPH_WARMUP_MAX = 8   # extra warm-up steps a row with CUDA graphs may take until a step captures nothing new


def warm_until_replayed(model: Any, cache: Any, token: torch.Tensor,
                        clock: Clock) -> tuple[list[float], torch.Tensor]:
    """Decode steps until one replays and captures no new CUDA graph (at most `GRAPH_WARMUP_MAX`), where the
    cache's steps are captured (on CUDA, by default; `cache` may be a `DecodeGraph`, whose captures are its own):
    the timed steps are then the steady ones, which replay (a step that neither captures nor replays, such as
    one that demotes, does not end the warm-up). Returns the milliseconds of the steps that captured, and the
    next token. Nothing is run where no graph is captured."""
    from ...integrations.model_graph import DecodeGraph

    captured: list[float] = []
    whole = isinstance(cache, DecodeGraph)   # the whole step as one graph: its own captures
    if clock.device.type != "cuda" or not (cache.graphs.enabled if whole else
                                           getattr(cache.settings, "cuda_graphs", False)):
        return captured, token
    counts = (lambda: cache.stats()) if whole else (lambda: cache.stats()["cuda_graphs"])
    for _ in range(GRAPH_WARMUP_MAX):
        before = counts()
        ms, token = decode_steps(model, cache, token, 1, clock)
        after = counts()
        if after["captures"] == before["captures"]:
            if after["replays"] > before["replays"]:
                break
            continue   # neither captured nor replayed (a demoting step): not yet the steady steps
        captured.append(_r(ms[0] * 1e3))
    return captured, token


def _step_row(times: list[float], issued: list[float] | None = None, **extra: Any) -> dict[str, Any]:
    row = {"step_ms_median": _r(_median(times) * 1e3), "step_ms_min": _r(min(times) * 1e3),
           "step_ms_max": _r(max(times) * 1e3), "steps": len(times),
           "step_ms": [_r(t * 1e3) for t in times], **extra}
    if issued:
        row["issue_ms_median"] = _r(_median(issued) * 1e3)
    return row


def _tier_summary(stats: dict[str, Any]) -> dict[str, Any]:
    return {"device": stats["device"], "host": stats["host"], "disk": stats["disk"],
            "bytes_moved": stats["bytes_moved"], "pages_recalled": stats["pages_recalled"],
            "pages_recalled_from": stats["pages_recalled_from"],
            "pages_reused": stats["pages_reused"], "reuse_rate": stats["reuse_rate"], "prefetch": stats["prefetch"],
            "transfer_wait_seconds": _r(stats["transfer_wait_seconds"], 4),
            "scorer": stats["scorer"]}
