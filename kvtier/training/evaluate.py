"""Ranking quality on held-out traces: the share of future attention mass a scorer keeps at a budget.

Sinks and the recent window are always kept and count inside the budget, as in the cache's placement.
Attention-free scorers run through the same `Scorer` interface the cache uses; the attention-based ones
(TOVA, SnapKV, H2O) use the prompt attention recorded with the trace.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS
from ..scoring import BASELINES_ATTENTION_BASED, make_scorer
from ..scoring.kvp import KVPScorer


def trace_scores(name: str, raw: dict[str, torch.Tensor], kvp: KVPScorer | None = None,
                 seed: int = 0) -> torch.Tensor:
    """Scores ``[layers, heads, n]`` of a scorer for the prompt of one trace."""
    if name in BASELINES_ATTENTION_BASED:
        return raw[name].float()
    scorer = kvp if name == "kvp" else make_scorer(name, **({"seed": seed} if name == "random" else {}))
    keys, values, positions = raw["keys"].float(), raw["values"].float(), raw["positions"]
    return torch.stack([scorer.score(keys[l][None], values[l][None], positions, l)[0]
                        for l in range(keys.shape[0])])


def kept_mass(scores: torch.Tensor, importance: torch.Tensor, budget: float, sink_tokens: int = DEFAULT_SINK_TOKENS,
              recent_tokens: int = DEFAULT_RECENT_TOKENS) -> torch.Tensor:
    """Share of importance kept by the top entries, ``[...]`` from ``[..., n]`` inputs."""
    n = scores.shape[-1]
    keep_n = math.ceil(budget * n)
    protected = torch.zeros(n, dtype=torch.bool)
    protected[:sink_tokens] = True
    protected[max(n - recent_tokens, 0):] = True
    ranked = torch.where(protected, float("inf"), scores.float())
    top = torch.topk(ranked, min(max(keep_n, int(protected.sum())), n), dim=-1).indices
    return torch.gather(importance, -1, top).sum(-1) / importance.sum(-1).clamp_min(1e-12)


def evaluate_scorers(traces: list[dict[str, torch.Tensor]], scorers: list[str], budgets: list[float],
                     kvp: KVPScorer | None = None, progress: Any = iter) -> dict[str, Any]:
    """Mean kept mass per scorer and budget, overall and per layer."""
    sums: dict[str, dict[float, torch.Tensor]] = {s: {b: 0 for b in budgets} for s in scorers}
    for i, raw in enumerate(progress(traces)):
        for name in scorers:
            scores = trace_scores(name, raw, kvp, seed=i)
            for b in budgets:
                sums[name][b] = sums[name][b] + kept_mass(scores, raw["importance"], b).mean(dim=1)  # [layers]
    out: dict[str, Any] = {"budgets": budgets, "traces": len(traces), "mean": {}, "per_layer": {}}
    for name in scorers:
        out["mean"][name] = {str(b): float(sums[name][b].mean() / len(traces)) for b in budgets}
        out["per_layer"][name] = {str(b): (sums[name][b] / len(traces)).tolist() for b in budgets}
    return out
