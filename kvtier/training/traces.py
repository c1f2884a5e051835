"""Generation traces for KVP: per (layer, KV head), the prompt's keys, values and positions, and the future
attention each prompt token receives from the continuation.

Importance follows the paper: for prompt token ``j``, ``c_j = sum_t max_g A_g(t, j)`` over continuation
steps ``t`` and the query heads ``g`` of the KV head's group, ``A`` being the causal softmax attention.
The same pass also records the scores of the attention-based baselines (TOVA, SnapKV, H2O), from the prompt
only: their own `QueryScorer` classes run on the prompt's queries and keys, exactly as the cache runs them
after a prefill, so `kvtier eval-scorer` grades the code the cache uses. Attention is computed by
`kvtier.scoring.attention_stats`, the module those scorers share. Traces are safetensors shards plus a
``manifest.json``.

A trace is two forwards: the prompt into a cache (keys, values, baseline scores), then the continuation after
it (importance). A generated answer comes from that same cache, so a long prompt is computed once.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import DynamicCache

from ..errors import ConfigError
from ..integrations.hf import cache_kwargs
from ..outputs import save_tensors
from ..scoring import BASELINES_ATTENTION_BASED, QueryScorer, checked_scores, make_scorer
from ..scoring.attention_stats import received_attention

NEXT_STEPS = 16      # `importance_next`: attention from the first 16 continuation tokens only
DECAY_STEPS = 32.0   # `importance_decay`: step t of the continuation weighted by exp(-t / 32)


def baseline_scorers() -> list[QueryScorer]:
    """The attention-based baselines with their default settings, as the cache would build them by name."""
    return [make_scorer(name) for name in BASELINES_ATTENTION_BASED]


def future_importance(query: torch.Tensor, key: torch.Tensor, scaling: float, prompt: int,
                      targets: bool = False, softcap: float | None = None) -> dict[str, torch.Tensor]:
    """Importance of the `prompt` first tokens from the continuation's attention, ``[kv_heads, prompt]``
    float32 each.

    With `targets`, also the outcome-tied variants ``importance_next`` (the first `NEXT_STEPS` continuation
    steps only) and ``importance_decay`` (step ``t`` weighted by ``exp(-t / DECAY_STEPS)``).

    Parameters
    ----------
    query
        ``[1, q_heads, steps, dim]``, the continuation's queries.
    key
        ``[1, kv_heads, prompt + steps, dim]``, every key they read.
    softcap
        The model's attention logit cap (Gemma 2's ``attn_logit_softcapping``), so that the target is the
        attention the model computed.
    """
    future = received_attention(query, key, key.shape[2], scaling, softcap=softcap)[..., :prompt]
    per_step = future.amax(dim=1)                                   # [kv_heads, steps, prompt]
    steps = torch.arange(per_step.shape[1], device=per_step.device, dtype=per_step.dtype)
    stats = {"importance": per_step.sum(dim=1)}
    if targets:   # outcome-tied variants: the next tokens' attention, and attention discounted by the step
        stats["importance_next"] = per_step[:, :NEXT_STEPS].sum(dim=1)
        stats["importance_decay"] = (per_step * torch.exp(-steps / DECAY_STEPS)[None, :, None]).sum(dim=1)
    return stats


def prompt_statistics(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                      baselines: list[QueryScorer], layer_idx: int = 0,
                      softcap: float | None = None) -> dict[str, torch.Tensor]:
    """Each baseline's scores of the prompt, ``[kv_heads, prompt]`` float32, as after a prefill of the prompt
    alone (`query`, `key`, `value`: the prompt's own; `softcap`: the model's logit cap)."""
    positions = torch.arange(key.shape[2], device=key.device)
    return {scorer.name: checked_scores(scorer, key, value, positions, layer_idx, query=query, context_keys=key,
                                        scaling=scaling, softcap=softcap)[0]
            for scorer in baselines}


def layer_statistics(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, prompt: int,
                     baselines: list[QueryScorer], layer_idx: int = 0,
                     targets: bool = False, softcap: float | None = None) -> dict[str, torch.Tensor]:
    """`future_importance` and `prompt_statistics` of one pass over prompt and continuation (``query``
    ``[1, q_heads, n, dim]``, ``key`` and ``value`` ``[1, kv_heads, n, dim]``); the definition that
    `record_trace`'s two passes reproduce."""
    stats = future_importance(query[:, :, prompt:], key, scaling, prompt, targets, softcap)
    stats.update(prompt_statistics(query[:, :, :prompt], key[:, :, :prompt], value[:, :, :prompt], scaling,
                                   baselines, layer_idx, softcap))
    return stats


@contextmanager
def capture_attention(model: Any, on_layer: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor,
                                                      torch.Tensor, dict], None]) -> Iterator[None]:
    """Run the model's own attention, but show each layer's query, key and value to `on_layer` first.

    The model's own mask is kept: transformers builds no mask for an implementation it does not know, and
    attention would then not be causal (eager), or causal from the wrong corner for queries that follow a
    cache (SDPA).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config.get_text_config()
    base = config._attn_implementation
    base_fn = ALL_ATTENTION_FUNCTIONS[base] if base in ALL_ATTENTION_FUNCTIONS else None

    def traced(module, query, key, value, attention_mask, **kwargs):
        on_layer(module, query, key, value, kwargs)
        fn = base_fn or __import__(type(module).__module__, fromlist=["x"]).eager_attention_forward
        return fn(module, query, key, value, attention_mask, **kwargs)

    name = f"kvtier_trace_{base}"   # one name per base, so no base's mask is ever lent to another
    AttentionInterface.register(name, traced)
    if base in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = base


def attention_scaling(module: torch.nn.Module, query: torch.Tensor, kwargs: dict) -> float:
    """The softmax scale a captured layer uses: the one passed to attention, else the module's, else
    ``1 / sqrt(dim)``."""
    return kwargs.get("scaling") or getattr(module, "scaling", 1 / math.sqrt(query.shape[-1]))


def _prefill(model: Any, prompt_ids: torch.Tensor) -> tuple[DynamicCache, dict[int, dict[str, torch.Tensor]]]:
    """The prompt's forward into a cache, with each layer's keys, values and baseline scores."""
    per_layer: dict[int, dict[str, torch.Tensor]] = {}
    baselines = baseline_scorers()

    def on_layer(module, query, key, value, kwargs):
        scaling = attention_scaling(module, query, kwargs)
        stats = prompt_statistics(query, key, value, scaling, baselines, module.layer_idx, kwargs.get("softcap"))
        stats["keys"] = key[0].to(torch.float16)
        stats["values"] = value[0].to(torch.float16)
        for name in ("keys", "values"):   # past float16's range they would be inf, and training on them NaN
            if not torch.isfinite(stats[name]).all():
                raise ConfigError(f"layer {module.layer_idx}'s {name} exceed float16's range (largest magnitude "
                                  f"{float((key if name == 'keys' else value).abs().max()):.4g}); traces keep them in "
                                  "float16; allowed: models whose keys and values stay below 65,504")
        per_layer[module.layer_idx] = stats

    cache = DynamicCache(config=model.config)
    with capture_attention(model, on_layer):
        model(prompt_ids, **cache_kwargs(cache), logits_to_keep=1)
    return cache, per_layer


def _continue(model: Any, cache: DynamicCache, prompt: int, continuation_ids: torch.Tensor,
              per_layer: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The continuation's forward after the prompt's `cache`; adds the prompt's importance to `per_layer` and
    stacks everything into the trace."""
    length = prompt + continuation_ids.shape[1]

    def on_layer(module, query, key, value, kwargs):
        if key.shape[2] != length:
            raise ValueError(f"layer {module.layer_idx} attends to {key.shape[2]} keys, not the {length} of prompt "
                             "and continuation: traces need layers that keep every token (no sliding window)")
        per_layer[module.layer_idx].update(
            future_importance(query, key, attention_scaling(module, query, kwargs), prompt, targets=True,
                              softcap=kwargs.get("softcap")))

    with capture_attention(model, on_layer):
        model(continuation_ids, **cache_kwargs(cache), logits_to_keep=1)
    layers = [per_layer[i] for i in sorted(per_layer)]
    trace = {name: torch.stack([s[name] for s in layers]).contiguous().cpu() for name in layers[0]}
    trace["positions"] = torch.arange(prompt)
    return trace


@torch.no_grad()
def record_trace(model: Any, prompt_ids: torch.Tensor, continuation_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The trace of the prompt tokens: a forward over the prompt, then one over the continuation.

    ``keys``, ``values`` ``[layers, kv_heads, prompt, dim]`` float16; ``positions`` ``[prompt]``;
    ``importance``, ``importance_next``, ``importance_decay``, ``tova``, ``snapkv``, ``h2o``
    ``[layers, kv_heads, prompt]`` float32.
    """
    cache, per_layer = _prefill(model, prompt_ids)
    return _continue(model, cache, prompt_ids.shape[1], continuation_ids, per_layer)


@torch.no_grad()
def record_answer_trace(model: Any, prompt_ids: torch.Tensor,
                        answer_tokens: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's greedy answer to the prompt (at most `answer_tokens`), and its trace as `record_trace`'s.

    The answer is generated from the recorded prefill, so a long prompt goes through the model once.
    """
    prompt = prompt_ids.shape[1]
    cache, per_layer = _prefill(model, prompt_ids)
    # crop(-n) removes n tokens in every supported transformers version; crop(0) is never called, since
    # some versions read it as "keep nothing"
    cache.crop(-1)           # generate computes the last prompt token again, for the first answer token
    answer = model.generate(prompt_ids, **cache_kwargs(cache), max_new_tokens=answer_tokens,
                            do_sample=False)[:, prompt:]
    extra = cache.get_seq_length() - prompt   # the answer's tokens but its last, which no step fed back
    if extra > 0:
        cache.crop(-extra)
    return answer, _continue(model, cache, prompt, answer, per_layer)


def save_trace(trace: dict[str, torch.Tensor], path: Path) -> None:
    save_tensors(trace, path)


def load_trace(path: Path) -> dict[str, torch.Tensor]:
    """A shard `save_trace` wrote; one that is not a readable safetensors file is a `ConfigError` naming it."""
    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise ConfigError(f"{path}: not a readable trace shard ({e}); record the folder again") from e


def read_manifest(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} holds no traces (no manifest.json); record some with `kvtier traces`")
    return json.loads(path.read_text())
