"""One exact prefill shared by every policy of an example.

Every policy prefills with full causal attention (placement happens after the prefill), so the prompt's
keys, values and last logits are the same for all of them: the harness computes them once, with the
queries that attention-based scorers need, and loads them into each policy's cache the way a prefill would.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from ..integrations.hf import TieredCache, cache_kwargs
from ..training.traces import capture_attention


@dataclass
class Prefill:
    cache: DynamicCache
    queries: dict[int, tuple[torch.Tensor, float]]   # layer -> (query [1, q_heads, n, dim], scaling)
    last_logits: torch.Tensor                          # [vocab]


@torch.no_grad()
def shared_prefill(model: Any, input_ids: torch.Tensor) -> Prefill:
    queries: dict[int, tuple[torch.Tensor, float]] = {}

    def on_layer(module, query, key, value, kwargs):
        scaling = kwargs.get("scaling") or getattr(module, "scaling", 1 / math.sqrt(query.shape[-1]))
        queries[module.layer_idx] = (query.detach(), scaling)

    cache = DynamicCache(config=model.config)
    with capture_attention(model, on_layer):
        logits = model(input_ids, **cache_kwargs(cache)).logits[0, -1]
    return Prefill(cache, queries, logits)


def load_prefill(prefill: Prefill, tiered: TieredCache) -> None:
    """Write the shared prompt KV into `tiered` and place it, as its own prefill would have."""
    for i, layer in enumerate(tiered.layers):
        source = prefill.cache.layers[i]
        layer.update(source.keys, source.values)
        query, scaling = prefill.queries[i]
        layer.engine.commit(query=query, scaling=scaling)


def full_copy(prefill: Prefill) -> DynamicCache:
    return copy.deepcopy(prefill.cache)
