"""Ranking quality on held-out traces: the share of future attention mass a scorer keeps at a budget.

Sinks and the recent window are always kept and count inside the budget, as in the cache's placement.
Every scorer is the class the cache runs, called through `checked_scores`: a `Scorer` here, on the trace's
keys, values and positions; a `QueryScorer` (TOVA, SnapKV, H2O) needs the prompt's queries, which traces do
not keep, so its scores were computed by the same class when the trace was recorded (see `traces`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS
from ..errors import ConfigError
from ..placement.budget import ceil_share
from ..placement.planner import kept_first, recent_window
from ..scoring import BASELINES_ATTENTION_BASED, checked_scores, make_scorer, needs_query, ranking_scores
from ..scoring.kvp import KVPScorer
from .dataset import importance_target


def trace_scores(name: str, raw: dict[str, torch.Tensor], kvp: KVPScorer | None = None,
                 seed: int = 0) -> torch.Tensor:
    """Scores ``[layers, heads, n]`` of a scorer for the prompt of one trace, as the cache ranks them when the
    prompt ends (an `AgeAware` scorer's recency term included)."""
    if name == "kvp" and kvp is not None:
        scorer = kvp
    else:
        scorer = make_scorer(name, **({"seed": seed} if name == "random" else {}))
    if needs_query(scorer):
        if name not in raw:
            recorded = [n for n in BASELINES_ATTENTION_BASED if n in raw]
            raise ConfigError(f"scorer {name!r} ranks from attention, and the trace holds no {name!r} scores "
                              "(traces keep no queries); allowed: an attention-free scorer or one the trace "
                              f"recorded ({', '.join(recorded) or 'none: record the traces again'})")
        return raw[name].float()
    keys, values, positions = raw["keys"].float(), raw["values"].float(), raw["positions"]
    heads, n = keys.shape[1], positions.numel()
    return torch.stack([ranking_scores(scorer, checked_scores(scorer, keys[l][None], values[l][None], positions, l)[0],
                                       positions.expand(heads, n), n, l) for l in range(keys.shape[0])])


def kept_mass(scores: torch.Tensor, importance: torch.Tensor, budget: float, sink_tokens: int = DEFAULT_SINK_TOKENS,
              recent_tokens: int | float = DEFAULT_RECENT_TOKENS) -> torch.Tensor:
    """Share of importance kept by the top entries, ``[...]`` from ``[..., n]`` inputs.

    `recent_tokens` is a token count or a share of the budget, as in the cache (`recent_window`).
    """
    n = scores.shape[-1]
    keep_n = ceil_share(budget, n)   # as the cache rounds it: 7% of 100 is 7
    protected = torch.zeros(n, dtype=torch.bool)
    protected[:sink_tokens] = True
    protected[max(n - recent_window(recent_tokens, keep_n), 0):] = True
    top = torch.topk(kept_first(scores, protected), min(max(keep_n, int(protected.sum())), n), dim=-1).indices
    return torch.gather(importance, -1, top).sum(-1) / importance.sum(-1).clamp_min(1e-12)


def evaluate_scorers(traces: list[dict[str, torch.Tensor]], scorers: list[str], budgets: list[float],
                     kvp: KVPScorer | None = None, progress: Any = iter, importance: str = "importance",
                     sink_tokens: int = DEFAULT_SINK_TOKENS,
                     recent_tokens: int | float = DEFAULT_RECENT_TOKENS) -> dict[str, Any]:
    """Mean kept mass per scorer and budget, overall and per layer, of the target `importance`
    (see `dataset.importance_target`), with the always-kept set of `sink_tokens` and `recent_tokens`."""
    sums: dict[str, dict[float, torch.Tensor]] = {s: {b: 0 for b in budgets} for s in scorers}
    for i, raw in enumerate(progress(traces)):
        for name in scorers:
            scores = trace_scores(name, raw, kvp, seed=i)
            for b in budgets:
                sums[name][b] = sums[name][b] + kept_mass(scores, importance_target(raw, importance), b, sink_tokens,
                                                                 recent_tokens).mean(dim=1)  # [layers]
    out: dict[str, Any] = {"budgets": budgets, "traces": len(traces), "mean": {}, "per_layer": {}}
    for name in scorers:
        out["mean"][name] = {str(b): float(sums[name][b].mean() / len(traces)) for b in budgets}
        out["per_layer"][name] = {str(b): (sums[name][b] / len(traces)).tolist() for b in budgets}
    return out
