"""One exact prefill shared by every policy of an example.

Every policy prefills with full causal attention (placement happens after the prefill), so the prompt's
keys, values and last logits are the same for all of them: the harness computes them once, with the
queries that attention-based scorers need, and loads them into each policy's cache the way a prefill would.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from ..integrations.hf import TieredCache, cache_kwargs
from ..scoring import AgeAware, QueryScorer, Scorer, check_scorer_model, needs_query, scorer_name, takes_softcap
from ..training.traces import attention_scaling, capture_attention


@dataclass
class Prefill:
    cache: DynamicCache
    # layer -> (query [1, q_heads, n, dim], scaling, logit soft-cap or None)
    queries: dict[int, tuple[torch.Tensor, float, float | None]]
    last_logits: torch.Tensor                          # [vocab]


@torch.no_grad()
def shared_prefill(model: Any, input_ids: torch.Tensor) -> Prefill:
    queries: dict[int, tuple[torch.Tensor, float, float | None]] = {}

    def on_layer(module, query, key, value, kwargs):
        queries[module.layer_idx] = (query.detach(), attention_scaling(module, query, kwargs), kwargs.get("softcap"))

    cache = DynamicCache(config=model.config)
    with capture_attention(model, on_layer):
        logits = model(input_ids.to(model.device), **cache_kwargs(cache)).logits[0, -1]
    return Prefill(cache, queries, logits)


def load_prefill(prefill: Prefill, tiered: TieredCache) -> None:
    """Write the shared prompt KV into `tiered` and place it, as its own prefill would have."""
    for i, layer in enumerate(tiered.layers):
        source = prefill.cache.layers[i]
        layer.update(source.keys, source.values)
        query, scaling, softcap = prefill.queries[i]
        layer.engine.commit(query=query, scaling=scaling, softcap=softcap)


def full_copy(prefill: Prefill) -> DynamicCache:
    return copy.deepcopy(prefill.cache)


class PromptScores:
    """A scorer that ranks the shared prompt once per layer and hands the same scores to every budget.

    Prompt scores depend only on the prompt (and, for attention-based scorers, its queries), never on the
    budget; H2O's ``q x q`` attention per layer is the cost this saves. Later writes are scored afresh.
    It is the same kind of scorer (`Scorer` or `QueryScorer`) as the one it wraps, and passes the model
    check and the recency term (`AgeAware`, zero for a scorer without one) on to it.
    """

    def __init__(self, scorer: Scorer | QueryScorer, prompt_tokens: int) -> None:
        self.scorer, self.prompt_tokens = scorer, prompt_tokens
        self.name = scorer_name(scorer)
        self.needs_query = needs_query(scorer)
        self._memo: dict[int, torch.Tensor] = {}
        self._softcap = takes_softcap(scorer)

    def check_model(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        check_scorer_model(self.scorer, num_layers, num_kv_heads, head_dim)

    def check_sizes(self, hidden_size: int | None, vocab_size: int | None) -> None:
        check_sizes = getattr(self.scorer, "check_sizes", None)
        if callable(check_sizes):
            check_sizes(hidden_size, vocab_size)

    def age_bias(self, ages: torch.Tensor, layer_idx: int) -> torch.Tensor:
        if isinstance(self.scorer, AgeAware):
            return self.scorer.age_bias(ages, layer_idx)
        return torch.zeros(ages.shape, dtype=torch.float32, device=ages.device)

    def score(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, layer_idx: int,
              **query_kwargs: Any) -> torch.Tensor:
        if not self._softcap:   # a wrapped scorer without the keyword is called as the cache would call it
            query_kwargs.pop("softcap", None)
        prompt = keys.shape[2] == self.prompt_tokens and int(positions[0]) == 0
        if not prompt:
            return self.scorer.score(keys, values, positions, layer_idx, **query_kwargs)
        if layer_idx not in self._memo:
            self._memo[layer_idx] = self.scorer.score(keys, values, positions, layer_idx, **query_kwargs)
        return self._memo[layer_idx]
