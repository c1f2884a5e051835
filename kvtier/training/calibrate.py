"""Calibrate KVP's recency term on outcomes: the slope that gives the lowest continuation loss under eviction.

The agents learn the shape of their recency term from attention mass, a proxy; how much recency to add on top
is chosen on what the model predicts. For each candidate slope ``s`` the term becomes
``age(a) - s * ln(1 + a)``, which is exact on the table's knots (they sit at ``log2(1 + a)``, so it is a
straight line in the knot index); each setting runs the model in evict mode over training-split prose and
needle tasks at several device budgets and scores the continuation's negative log-likelihood, teacher-forced in decode-sized
chunks, as `kvtier eval` scores perplexity. The slope with the lowest mean NLL is folded into the table.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import ConfigError
from ..scoring.features import AGE_KNOTS
from ..scoring.kvp import KVPAgents, KVPScorer

@dataclass
class Calibration:
    """Mean continuation NLL per slope (over texts and budgets), and the slope chosen."""

    slope: float
    nll: dict[float, float] = field(default_factory=dict)
    runs: int = 0


def with_slope(agents: KVPAgents, slope: float) -> KVPAgents:
    """A copy of `agents` whose recency term falls by ``slope * ln(1 + age)`` more."""
    out = copy.deepcopy(agents)
    with torch.no_grad():
        out.age -= slope * math.log(2.0) * torch.arange(AGE_KNOTS, dtype=out.age.dtype)
    return out


@torch.no_grad()
def calibrate_recency(model: Any, agents: KVPAgents, meta: dict[str, Any],
                      texts: Sequence[tuple[torch.Tensor, torch.Tensor]], *, slopes: Sequence[float],
                      budgets: Sequence[float], progress: Callable[[Any], Any] = iter) -> Calibration:
    """Pick the slope with the lowest mean NLL of each text's continuation under an evicting `TieredCache`.

    `texts` are ``(prompt_ids, continuation_ids)`` pairs from the training split; the prompt is prefilled
    once per text and shared by every setting.
    """
    from ..eval.runner import continuation_nll
    from ..eval.shared_prefill import PromptScores, load_prefill, shared_prefill
    from ..integrations.hf import TieredCache

    if not texts or not slopes or not budgets:
        raise ConfigError(f"calibration needs texts, slopes and budgets; got {len(texts)} texts, slopes "
                          f"{list(slopes)}, budgets {list(budgets)}")
    sums = {float(s): 0.0 for s in slopes}
    scorers = {float(s): KVPScorer.from_agents(with_slope(agents, s), meta) for s in slopes}
    for prompt, continuation in progress(list(texts)):
        pre = shared_prefill(model, prompt)
        for slope, scorer in scorers.items():
            shared = PromptScores(scorer, prompt.shape[1])   # the prompt is scored once for every budget
            for budget in budgets:
                cache = TieredCache(model.config, device_budget=budget, mode="evict", scorer=shared)
                try:
                    load_prefill(pre, cache)
                    sums[slope] += continuation_nll(model, cache, pre.last_logits, continuation)
                finally:
                    cache.close()
    nll = {s: v / (len(texts) * len(budgets)) for s, v in sums.items()}
    return Calibration(min(nll, key=nll.get), nll, len(texts))
