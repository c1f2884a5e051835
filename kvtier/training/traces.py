"""Generation traces for KVP: per (layer, KV head), the prompt's keys, values and positions, and the future
attention each prompt token receives from the continuation.

Importance follows the paper: for prompt token ``j``, ``c_j = sum_t max_g A_g(t, j)`` over continuation
steps ``t`` and the query heads ``g`` of the KV head's group, ``A`` being the causal softmax attention.
The same pass also records what attention-based baselines would have used (all from the prompt only):
TOVA (the last prompt query's attention), SnapKV (the last 32 prompt queries, pooled) and H2O (attention
accumulated over every prompt query). Traces are safetensors shards plus a ``manifest.json``.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

SNAPKV_WINDOW, SNAPKV_KERNEL = 32, 5


def _group_attention(query: torch.Tensor, key: torch.Tensor, scaling: float, q_start: int) -> torch.Tensor:
    """Causal softmax attention of queries ``q_start..`` over all keys: ``[kv_heads, group, q, keys]``."""
    q_heads, length, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads = key.shape[1]
    q = query[0, :, q_start:].float().reshape(kv_heads, q_heads // kv_heads, length - q_start, dim)
    logits = torch.einsum("hgqd,hkd->hgqk", q, key[0].float()) * scaling
    rows = torch.arange(q_start, length, device=query.device)[:, None]
    logits = logits.masked_fill(torch.arange(length, device=query.device)[None, :] > rows, float("-inf"))
    return torch.softmax(logits, dim=-1)


def layer_statistics(query: torch.Tensor, key: torch.Tensor, scaling: float, prompt: int) -> dict[str, torch.Tensor]:
    """Importance and baseline scores of the `prompt` first tokens, each ``[kv_heads, prompt]``."""
    future = _group_attention(query, key, scaling, prompt)[..., :prompt]
    stats = {"importance": future.amax(dim=1).sum(dim=1)}
    att = _group_attention(query[:, :, :prompt], key[:, :, :prompt], scaling, 0)  # prompt on prompt
    stats["h2o"] = att.sum(dim=2).mean(dim=1)
    stats["tova"] = att[:, :, -1].mean(dim=1)
    window = att[:, :, -SNAPKV_WINDOW:].sum(dim=2).mean(dim=1)
    stats["snapkv"] = F.avg_pool1d(window[:, None], SNAPKV_KERNEL, stride=1, padding=SNAPKV_KERNEL // 2)[:, 0]
    return stats


@contextmanager
def capture_attention(model: Any, on_layer: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor,
                                                      torch.Tensor, dict], None]) -> Iterator[None]:
    """Run the model's own attention, but show each layer's query, key and value to `on_layer` first."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config.get_text_config()
    base = config._attn_implementation
    base_fn = ALL_ATTENTION_FUNCTIONS[base] if base in ALL_ATTENTION_FUNCTIONS else None

    def traced(module, query, key, value, attention_mask, **kwargs):
        on_layer(module, query, key, value, kwargs)
        fn = base_fn or __import__(type(module).__module__, fromlist=["x"]).eager_attention_forward
        return fn(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvtier_trace", traced)
    config._attn_implementation = "kvtier_trace"
    try:
        yield
    finally:
        config._attn_implementation = base


@torch.no_grad()
def record_trace(model: Any, prompt_ids: torch.Tensor, continuation_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """One forward over prompt + continuation; returns the trace tensors of the prompt tokens.

    ``keys``, ``values`` ``[layers, kv_heads, prompt, dim]`` float16; ``positions`` ``[prompt]``;
    ``importance``, ``tova``, ``snapkv``, ``h2o`` ``[layers, kv_heads, prompt]`` float32.
    """
    prompt = prompt_ids.shape[1]
    full = torch.cat([prompt_ids, continuation_ids], dim=1)
    per_layer: dict[int, dict[str, torch.Tensor]] = {}

    def on_layer(module, query, key, value, kwargs):
        scaling = kwargs.get("scaling") or getattr(module, "scaling", 1 / math.sqrt(query.shape[-1]))
        stats = layer_statistics(query, key, scaling, prompt)
        stats["keys"] = key[0, :, :prompt].to(torch.float16)
        stats["values"] = value[0, :, :prompt].to(torch.float16)
        per_layer[module.layer_idx] = stats

    with capture_attention(model, on_layer):
        model(full, use_cache=False)
    layers = [per_layer[i] for i in sorted(per_layer)]
    trace = {name: torch.stack([s[name] for s in layers]).contiguous().cpu() for name in layers[0]}
    trace["positions"] = torch.arange(prompt)
    return trace


def save_trace(trace: dict[str, torch.Tensor], path: Path) -> None:
    save_file(trace, str(path))


def load_trace(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def read_manifest(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} holds no traces (no manifest.json); record some with `kvtier traces`")
    return json.loads(path.read_text())
