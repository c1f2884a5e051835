"""How well what is on the device predicts each decode step's page choice, with and without prefetch.

Every setting decodes the same prompt greedily with recall planned on the device (forced on a CPU, where the
torch twins run the same plan and the side stream is the caller's own), and differs only in `prefetch_pages`.
The first decode step, which finds the recall buffer empty after the prefill, is run before counting starts.
Reported per setting: the share of chosen pages already on the device when chosen (kept from the step before,
or prefetched after it), the pages fetched on demand and the pages prefetched per layer, KV head and step,
and the share of prefetched pages a later step chose. Prefetch changes what moves and when, never what is
attended: the tokens must agree across settings, and the report says whether they do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..integrations.hf import TieredCache
from .decode import time_decode


@dataclass(frozen=True)
class PrefetchRow:
    prefetch_pages: int
    tokens: list[int]
    decode_seconds: float
    layer_steps: int            # recalls summed over layers (one per layer and decode step)
    chosen: int                 # pages chosen, summed over layers, KV heads and steps
    on_demand: int              # of those, fetched when chosen
    prefetched: int
    prefetch_used: int

    def as_dict(self, kv_heads: int) -> dict[str, Any]:
        per = max(1, self.layer_steps * kv_heads)
        return {"prefetch_pages": self.prefetch_pages,
                "on_device_when_chosen": round(1 - self.on_demand / self.chosen, 4) if self.chosen else None,
                "on_demand_pages_per_step": round(self.on_demand / per, 3),
                "prefetched_pages_per_step": round(self.prefetched / per, 3),
                "prefetch_hit_rate": round(self.prefetch_used / self.prefetched, 4) if self.prefetched else None,
                "decode_seconds": round(self.decode_seconds, 3), "layer_steps": self.layer_steps,
                "pages_chosen": self.chosen, "pages_on_demand": self.on_demand, "pages_prefetched": self.prefetched,
                "prefetch_used": self.prefetch_used}


def _counts(stats: dict[str, Any]) -> dict[str, int]:
    ahead = stats["prefetch"]
    return {"steps": stats["recall_steps"], "reused": stats["pages_reused"], "prefetched": ahead["pages"],
            "on_demand": stats["pages_recalled"] - ahead["pages"], "used": ahead["used"]}


def prefetch_study(model: Any, input_ids: torch.Tensor, spares: list[int], new_tokens: int,
                   device_budget: float | int, recall_pages: int, scorer: str | None = None,
                   progress: Callable[[str], None] | None = None) -> list[PrefetchRow]:
    """One `PrefetchRow` per `prefetch_pages` setting in `spares`, same prompt, same decode."""
    rows = []
    for spare in spares:
        if progress:
            progress(f"prefetch_pages={spare}: prefill {input_ids.shape[1]:,} tokens, decode {new_tokens}")
        with TieredCache(model.config, device_budget=device_budget, recall_pages=recall_pages,
                         prefetch_pages=spare, scorer=scorer) as cache:
            for engine in cache._engines:   # planned on the device from the first step, as on a GPU
                engine.device_recall = True
            first: dict[str, Any] = {}
            seconds, tokens = time_decode(model, input_ids, cache, new_tokens, warmup=1,
                                          before_timing=lambda: first.update(_counts(cache.stats())))
            last = _counts(cache.stats())
        got = {key: last[key] - first[key] for key in last}
        rows.append(PrefetchRow(spare, tokens[0].tolist(), seconds, got["steps"], got["reused"] + got["on_demand"],
                                got["on_demand"], got["prefetched"], got["used"]))
    return rows
