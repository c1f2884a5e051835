"""Generation traces for KVP: per (layer, KV head), the prompt's keys, values and positions, and the future
attention each prompt token receives from the continuation.

Importance follows the paper: for prompt token ``j``, ``c_j = sum_t max_g A_g(t, j)`` over continuation
steps ``t`` and the query heads ``g`` of the KV head's group, ``A`` being the causal softmax attention.
The same pass also records the scores of the attention-based baselines (TOVA, SnapKV, H2O), from the prompt
only: their own `QueryScorer` classes run on the prompt's queries and keys, exactly as the cache runs them
after a prefill, so `kvtier eval-scorer` grades the code the cache uses. Attention is computed by
`received_attention`, the function those scorers share. Traces are safetensors shards plus a ``manifest.json``.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors.torch import load_file, save_file

from ..scoring import BASELINES_ATTENTION_BASED, QueryScorer, checked_scores, make_scorer
from ..scoring.attention_stats import received_attention

NEXT_STEPS = 16      # `importance_next`: attention from the first 16 continuation tokens only
DECAY_STEPS = 32.0   # `importance_decay`: step t of the continuation weighted by exp(-t / 32)


def baseline_scorers() -> list[QueryScorer]:
    """The attention-based baselines with their default settings, as the cache would build them by name."""
    return [make_scorer(name) for name in BASELINES_ATTENTION_BASED]


def layer_statistics(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, prompt: int,
                     baselines: list[QueryScorer], layer_idx: int = 0,
                     targets: bool = False) -> dict[str, torch.Tensor]:
    """Importance and each baseline's scores of the `prompt` first tokens, each ``[kv_heads, prompt]`` float32.

    With `targets`, also the outcome-tied importance variants ``importance_next`` (the first `NEXT_STEPS`
    continuation steps only) and ``importance_decay`` (step ``t`` weighted by ``exp(-t / DECAY_STEPS)``).

    Parameters
    ----------
    query
        ``[1, q_heads, n, dim]``, the queries of prompt and continuation (``n`` tokens in all).
    key, value
        ``[1, kv_heads, n, dim]``.
    """
    length = key.shape[2]
    future = received_attention(query, key, length, scaling, slice(prompt, None))[..., :prompt]
    per_step = future.amax(dim=1)                                   # [kv_heads, steps, prompt]
    steps = torch.arange(per_step.shape[1], device=per_step.device, dtype=per_step.dtype)
    stats = {"importance": per_step.sum(dim=1)}
    if targets:   # outcome-tied variants: the next tokens' attention, and attention discounted by the step
        stats["importance_next"] = per_step[:, :NEXT_STEPS].sum(dim=1)
        stats["importance_decay"] = (per_step * torch.exp(-steps / DECAY_STEPS)[None, :, None]).sum(dim=1)
    k, v = key[:, :, :prompt], value[:, :, :prompt]
    positions = torch.arange(prompt, device=key.device)
    for scorer in baselines:  # scored as after a prefill of the prompt alone
        stats[scorer.name] = checked_scores(scorer, k, v, positions, layer_idx, query=query[:, :, :prompt],
                                            context_keys=k, scaling=scaling)[0]
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
    ``importance``, ``importance_next``, ``importance_decay``, ``tova``, ``snapkv``, ``h2o``
    ``[layers, kv_heads, prompt]`` float32.
    """
    prompt = prompt_ids.shape[1]
    full = torch.cat([prompt_ids, continuation_ids], dim=1)
    per_layer: dict[int, dict[str, torch.Tensor]] = {}
    baselines = baseline_scorers()

    def on_layer(module, query, key, value, kwargs):
        scaling = kwargs.get("scaling") or getattr(module, "scaling", 1 / math.sqrt(query.shape[-1]))
        stats = layer_statistics(query, key, value, scaling, prompt, baselines, module.layer_idx, targets=True)
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
