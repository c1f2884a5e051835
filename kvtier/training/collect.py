"""Choose prompts and continuations and record a folder of traces (behind `kvtier traces`)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from transformers import DynamicCache

from ..integrations.hf import cache_kwargs
from ..tasks import make_needle_task
from .chats import chat_prompts
from .corpus import corpus_prose
from .traces import record_trace, save_trace


CORPUS_NAMES = {
    "stdlib": "Python standard library docstrings (stdlib, split by module)",
    "packages": "documentation shipped in installed Python packages (license texts excluded, split by file)",
    "both": "Python standard library docstrings and installed packages' documentation (license texts excluded)",
}


def text_chunks(tokenizer: Any, split: str, prompt_tokens: int | Sequence[int], continuation_tokens: int,
                count: int, seed: int, corpus: str = "stdlib") -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``count`` windows of prose from `corpus`: the prompt, then the text that follows as continuation.

    `prompt_tokens` may list several lengths, taken in turn: a scorer trained at one prompt length cannot
    tell an entry's age from its position, since the latest token always sits at the same place.
    """
    lengths = [prompt_tokens] if isinstance(prompt_tokens, int) else list(prompt_tokens)
    rng = random.Random(seed)
    docs = corpus_prose(corpus, split)
    rng.shuffle(docs)
    out: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    stream: torch.Tensor | None = None
    pending = list(docs)
    while len(out) < count:
        prompt = lengths[len(out) % len(lengths)]
        need = prompt + continuation_tokens
        found = None
        while pending and found is None:
            name, text = pending.pop(0)
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
            if ids.shape[1] >= need:
                start = rng.randrange(0, ids.shape[1] - need + 1)
                found = (f"{name}@{start}", ids[:, start:start + need])
        if found is None:   # short modules: join several into one stream
            if stream is None:
                stream = tokenizer("\n\n".join(t for _, t in docs), return_tensors="pt",
                                   add_special_tokens=False)["input_ids"]
            start = rng.randrange(0, stream.shape[1] - need)
            found = (f"{corpus}:joined@{start}", stream[:, start:start + need])
        source, window = found
        out.append((source, window[:, :prompt], window[:, prompt:]))
    return out


@torch.no_grad()
def needle_prompts(model: Any, tokenizer: Any, split: str, context_tokens: int | Sequence[int], count: int,
                   answer_tokens: int, seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Needle tasks (disjoint seeds per split) with the model's own greedy answer as continuation.

    `context_tokens` may list several haystack lengths, taken in turn: a scorer that only saw needles in short
    prompts ranks them wrongly in long ones.
    """
    lengths = [context_tokens] if isinstance(context_tokens, int) else list(context_tokens)
    base = 1_000_000 if split == "eval" else 0
    out = []
    for i in range(count):
        task = make_needle_task(tokenizer, lengths[i % len(lengths)], depth=(i % 9 + 0.5) / 9,
                                seed=base + seed * 1000 + i)
        gen = model.generate(task.input_ids, **cache_kwargs(DynamicCache(config=model.config)),
                             max_new_tokens=answer_tokens, do_sample=False)
        out.append((f"needle:seed={base + seed * 1000 + i}", task.input_ids, gen[:, task.prompt_tokens:]))
    return out


def record_folder(model: Any, tokenizer: Any, out: str | Path, *, model_name: str, split: str, texts: int,
                  needles: int, prompt_tokens: int | Sequence[int], continuation_tokens: int,
                  needle_context: int | Sequence[int], answer_tokens: int, seed: int,
                  progress: Callable[[Any], Any] = iter, corpus: str = "stdlib", chats: int = 0,
                  chat_context: int | Sequence[int] = 4096) -> dict[str, Any]:
    """Record `texts` prose traces, `needles` needle-task traces and `chats` conversations
    (`kvtier.training.chats`) into `out`; returns the manifest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    items = [(s, p, c, "text") for s, p, c in text_chunks(tokenizer, split, prompt_tokens, continuation_tokens,
                                                           texts, seed, corpus)]
    items += [(s, p, c, "generated") for s, p, c in needle_prompts(model, tokenizer, split, needle_context,
                                                                    needles, answer_tokens, seed)]
    items += [(s, p, c, "chat") for s, p, c in chat_prompts(model, tokenizer, split, chat_context, chats,
                                                             answer_tokens, seed, corpus)]
    cfg = model.config.get_text_config()
    manifest: dict[str, Any] = {
        "model": model_name, "num_layers": cfg.num_hidden_layers, "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
        "split": split, "seed": seed, "corpus": CORPUS_NAMES[corpus],
        "traces": [],
    }
    for i, (source, prompt, continuation, kind) in enumerate(progress(items)):
        trace = record_trace(model, prompt, continuation)
        name = f"trace_{i:05d}.safetensors"
        save_trace(trace, out / name)
        manifest["traces"].append({"file": name, "source": source, "continuation": kind,
                                   "prompt_tokens": prompt.shape[1], "continuation_tokens": continuation.shape[1]})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest
