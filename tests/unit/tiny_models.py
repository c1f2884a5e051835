"""The tiny random-weight model the reliability tests run (importable from subprocesses too)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvtier import cache_kwargs


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama with 2 KV heads, sdpa attention, vocabulary 128: milliseconds a step."""
    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=128, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def small_llama(layers: int = 4, seed: int = 0) -> LlamaForCausalLM:
    """A random-weight Llama with the default model's heads (3 KV heads of 64), `layers` deep, vocabulary 512:
    for what holds of the cache's own work at any size, at a fraction of the default model's time."""
    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=192, num_attention_heads=3, num_key_value_heads=3,
                         intermediate_size=256, vocab_size=512, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def random_ids(model, n: int, seed: int = 2) -> torch.Tensor:
    """`n` random token ids ``[1, n]`` in `model`'s vocabulary."""
    return torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def random_kvp(model):
    """A KVP scorer with random networks for `model`'s shape (the shipped weights fit the default model only)."""
    from kvtier.scoring.kvp import KVPAgents, KVPScorer

    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    torch.manual_seed(3)
    agents = KVPAgents(cfg.num_hidden_layers * cfg.num_key_value_heads, head_dim, hidden=16)
    meta = {"model": "random", "num_layers": cfg.num_hidden_layers, "num_kv_heads": cfg.num_key_value_heads,
            "head_dim": head_dim}
    return KVPScorer.from_agents(agents, meta)


@torch.no_grad()
def continue_greedy(model, cache, logits, n=4) -> tuple[list[int], torch.Tensor]:
    """`n` greedy tokens after `logits`, one step at a time through `cache`: the tokens and the last logits."""
    tokens = []
    for _ in range(n):
        nxt = logits[:, -1:].argmax(-1)
        tokens.append(int(nxt))
        logits = model(nxt, **cache_kwargs(cache)).logits
    return tokens, logits


@torch.no_grad()
def greedy_logits(model, cache, prompt: int = 200, steps: int = 40, seed: int = 3) -> torch.Tensor:
    """A random `prompt`-token prompt through `cache`, then `steps` greedy steps: their logits ``[steps, 1, vocab]``."""
    logits = model(random_ids(model, prompt, seed), **cache_kwargs(cache)).logits[:, -1:]
    out = []
    for _ in range(steps):
        logits = model(logits.argmax(-1), **cache_kwargs(cache)).logits[:, -1:]
        out.append(logits)
    return torch.cat(out)
