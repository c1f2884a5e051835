"""Synthetic long contexts: fill a tiered layer with KV of a real architecture's shape, plant needle entries,
and check that recall finds them — far past what a small machine could prefill with a real model.

Everything here is synthetic and labelled so: keys are Gaussian, a needle is a key far along one direction
with a distinctive value, and a query along that direction should attend to it. The reference is exact
attention over every key, computed chunk by chunk from the same seeds (nothing is kept beside the cache).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..config import ModelShape, TieredCacheConfig
from ..engine import LayerEngine
from ..engine.resources import SharedResources
from ..errors import ConfigError
from ..placement import Budget
from ..scoring import make_scorer

ARCHS = {  # layers, query heads, KV heads, head size
    "llama-3.1-8b": (32, 32, 8, 128),
    "llama-3.2-1b": (16, 32, 8, 64),
    "qwen2.5-7b": (28, 28, 4, 128),
    "smollm2-135m": (30, 9, 3, 64),
}
QUERY_NORM, NEEDLE_NORM = 8.0, 60.0


def parse_tokens(text: str) -> int:
    """'1M' -> 1048576, '128K' -> 131072, '5000' -> 5000."""
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


@dataclass
class _Plan:
    kv_heads: int
    q_heads: int
    dim: int
    context: int
    chunk: int
    seed: int

    def chunk_kv(self, start: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + start)
        n = min(self.chunk, self.context - start)
        k = torch.randn(1, self.kv_heads, n, self.dim, generator=g)
        v = torch.randn(1, self.kv_heads, n, self.dim, generator=g)
        return k.to(dtype), v.to(dtype)


def synthetic_needles(arch: str = "llama-3.1-8b", context: int = 2**20, needles: int = 4,
                      device_budget: float = 0.01, host_budget: float = 0.05, recall_pages: int = 32,
                      disk_dir: str | None = None, chunk: int = 65536, seed: int = 0,
                      progress: Callable[[Any], Any] = iter, device: str | torch.device = "cpu",
                      scorer: str = "keynorm") -> dict[str, Any]:
    """One layer of `arch` filled with `context` synthetic tokens and `needles` planted entries, its device tier on
    `device` (the same tokens on any device: they are drawn on the CPU; so is the exact reference), its entries
    ranked by `scorer` (one that needs no model: no model runs)."""
    layers, q_heads, kv_heads, dim = ARCHS[arch]
    device = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    dtype = torch.bfloat16
    plan = _Plan(kv_heads, q_heads, dim, context, chunk, seed)
    g = torch.Generator().manual_seed(seed)
    spots = sorted(torch.randperm(context - 64, generator=g)[:needles].add(32).tolist())
    directions = torch.nn.functional.normalize(torch.randn(needles, kv_heads, dim, generator=g), dim=-1)
    marks = torch.randn(needles, kv_heads, dim, generator=g)
    cfg = TieredCacheConfig(shape=ModelShape(1, kv_heads, dim), device_budget=Budget(device_budget, "device_budget"),
                            host_budget=Budget(host_budget, "host_budget", allow_zero=True), recall_pages=recall_pages)
    if cfg.device_tokens(context) >= context:
        raise ConfigError(f"device_budget={device_budget!r} holds all {context:,} tokens: nothing is demoted, so "
                          "recall has nothing to find; allowed: a budget below the context")
    shared = SharedResources(disk_dir)   # a private folder inside disk_dir, removed on close
    engine = LayerEngine(0, cfg, make_scorer(scorer), shared)

    def planted(start: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = plan.chunk_kv(start, dtype)
        for i, p in enumerate(spots):
            if start <= p < start + k.shape[2]:
                k[0, :, p - start] = (directions[i] * NEEDLE_NORM).to(dtype)
                v[0, :, p - start] = marks[i].to(dtype)
        return k, v

    try:
        start_fill = time.perf_counter()
        for start in progress(range(0, context, chunk)):
            k, v = planted(start)
            engine.write(k.to(device), v.to(device))
            engine.commit()
        sync()
        fill_seconds = time.perf_counter() - start_fill
        usage = engine.usage()
        if shared.disk_store is not None:   # the page file is the cache's to count, as `TieredCache.stats` does
            usage["disk"]["reserved_bytes"] += shared.disk_store.file_bytes()
        found = []
        for i, p in enumerate(spots):
            query = (directions[i] * QUERY_NORM).repeat_interleave(q_heads // kv_heads, dim=0)[None, :, None]
            step_k = torch.zeros(1, kv_heads, 1, dim, dtype=dtype, device=device)
            step_q = query.to(device, dtype)
            sync()
            t0 = time.perf_counter()
            engine.write(step_k, step_k)
            out, _ = engine.attend(step_q, 1 / math.sqrt(dim))   # pages are demoted (the budget is below the context)
            sync()
            tiered_s = time.perf_counter() - t0
            engine.commit()
            hit = _recalled(engine, engine.last_recall, p)
            t0 = time.perf_counter()
            ref = _full_attention(plan, planted, query, zero_tokens=i + 1)
            full_s = time.perf_counter() - t0
            got = out[0, 0].float().cpu()  # [q_heads, dim]
            found.append({"position": p, "recalled": hit,
                          "cosine_to_needle_value": float(torch.nn.functional.cosine_similarity(
                              got, marks[i].repeat_interleave(q_heads // kv_heads, dim=0), dim=-1).min()),
                          "max_abs_error_vs_full": float((got - ref).abs().max()),
                          "tiered_step_seconds": tiered_s, "reference_seconds": full_s})
        return {"arch": arch, "synthetic": True, "layers_simulated": 1, "layers_in_arch": layers,
                "context": context, "needles": found, "fill_seconds": fill_seconds, "usage": usage,
                "bytes_moved": dict(engine.counters.bytes_moved),
                "pages_recalled": dict(engine.counters.pages_recalled),
                "settings": {"device_budget": device_budget, "host_budget": host_budget, "scorer": scorer,
                             "recall_pages": recall_pages, "page_size": cfg.page_size, "dtype": str(dtype),
                             "device": str(device)}}
    finally:
        engine.close()
        shared.close()


def _recalled(engine: LayerEngine, page_ids: torch.Tensor, position: int) -> bool:
    """Whether the page holding `position` was recalled for every KV head (or it sits on the device)."""
    pos, _ = engine.pool.meta()
    return all(bool((pos[h] == position).any()) or
               any(position in engine.table.positions(h, p) for p in page_ids[h].tolist())
               for h in range(engine.heads))


def _full_attention(plan: _Plan, planted: Callable, query: torch.Tensor, zero_tokens: int) -> torch.Tensor:
    """Exact attention over every synthetic key and the all-zero step tokens, with a running softmax."""
    group = plan.q_heads // plan.kv_heads
    q = query[0, :, 0].float().view(plan.kv_heads, group, plan.dim)
    m = torch.full((plan.kv_heads, group), float("-inf"))
    den = torch.zeros(plan.kv_heads, group)
    num = torch.zeros(plan.kv_heads, group, plan.dim)
    for start in range(0, plan.context, plan.chunk):
        k, v = planted(start)
        logits = torch.einsum("hgd,hnd->hgn", q, k[0].float()) / math.sqrt(plan.dim)
        new_m = torch.maximum(m, logits.amax(-1))
        scale = torch.exp(m - new_m)
        w = torch.exp(logits - new_m[..., None])
        den = den * scale + w.sum(-1)
        num = num * scale[..., None] + torch.einsum("hgn,hnd->hgd", w, v[0].float())
        m = new_m
    new_m = torch.maximum(m, torch.zeros_like(m))  # step tokens: logit 0, value 0
    scale = torch.exp(m - new_m)
    den = den * scale + zero_tokens * torch.exp(-new_m)
    num = num * scale[..., None]
    return (num / den[..., None]).reshape(plan.q_heads, plan.dim)
