"""Choose prompts and continuations and record a folder of traces (behind `kvtier traces`)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..errors import ConfigError
from ..tasks import make_needle_task
from .chats import conversations, greedy_answer
from .corpus import corpus_prose, in_turn, joined_ids, window_start
from .traces import record_answer_trace, record_trace, save_trace


NEEDLE_SEEDS = 1000   # needle task seeds per run seed: the train split's are below NEEDLE_SEEDS ** 2
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
    lengths = in_turn(prompt_tokens)
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
                stream = joined_ids(tokenizer, docs)
            start = window_start(rng, stream.shape[1], need, f"a window of {prompt} prompt and "
                                 f"{continuation_tokens} continuation tokens")
            found = (f"{corpus}:joined@{start}", stream[:, start:start + need])
        source, window = found
        out.append((source, window[:, :prompt], window[:, prompt:]))
    return out


def needle_tasks(tokenizer: Any, split: str, context_tokens: int | Sequence[int],
                 count: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    """``(source, prompt)`` of `count` needle tasks (disjoint seeds per split).

    `context_tokens` may list several haystack lengths, taken in turn: a scorer that only saw needles in short
    prompts ranks them wrongly in long ones.
    """
    lengths = in_turn(context_tokens)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < NEEDLE_SEEDS:
        raise ConfigError(f"seed={seed!r} for needle tasks; allowed: 0 to {NEEDLE_SEEDS - 1} (a split's task seeds "
                          f"are seed * {NEEDLE_SEEDS} + i, and the eval split's start at {NEEDLE_SEEDS ** 2})")
    if count > NEEDLE_SEEDS:
        raise ConfigError(f"{count} needle tasks; allowed: at most {NEEDLE_SEEDS} per seed (the next seed's tasks "
                          "would repeat them)")
    base = NEEDLE_SEEDS ** 2 if split == "eval" else 0
    out = []
    for i in range(count):
        task = make_needle_task(tokenizer, lengths[i % len(lengths)], depth=(i % 9 + 0.5) / 9,
                                seed=base + seed * NEEDLE_SEEDS + i)
        out.append((f"needle:seed={base + seed * NEEDLE_SEEDS + i}", task.input_ids))
    return out


@torch.no_grad()
def needle_prompts(model: Any, tokenizer: Any, split: str, context_tokens: int | Sequence[int], count: int,
                   answer_tokens: int, seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """`needle_tasks` with the model's own greedy answer as continuation."""
    return [(source, prompt, greedy_answer(model, prompt, answer_tokens))
            for source, prompt in needle_tasks(tokenizer, split, context_tokens, count, seed)]


def record_folder(model: Any, tokenizer: Any, out: str | Path, *, model_name: str, split: str, texts: int,
                  needles: int, prompt_tokens: int | Sequence[int], continuation_tokens: int,
                  needle_context: int | Sequence[int], answer_tokens: int, seed: int,
                  progress: Callable[[Any], Any] = iter, corpus: str = "stdlib", chats: int = 0,
                  chat_context: int | Sequence[int] = 4096) -> dict[str, Any]:
    """Record `texts` prose traces, `needles` needle-task traces and `chats` conversations
    (`kvtier.training.chats`) into `out`; returns the manifest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # an earlier recording's manifest goes first: one cut short would otherwise list this run's shards as its own
    (out / "manifest.json").unlink(missing_ok=True)
    torch.manual_seed(seed)
    items: list[tuple[str, torch.Tensor, torch.Tensor | None, str]] = [
        (s, p, c, "text") for s, p, c in text_chunks(tokenizer, split, prompt_tokens, continuation_tokens, texts,
                                                     seed, corpus)]
    # no continuation yet: the model's greedy answer, generated from the trace's own prefill
    items += [(s, p, None, "generated") for s, p in needle_tasks(tokenizer, split, needle_context, needles, seed)]
    items += [(s, p, None, "chat") for s, p in conversations(model, tokenizer, split, chat_context, chats, seed,
                                                            corpus)]
    cfg = model.config.get_text_config()
    manifest: dict[str, Any] = {
        "model": model_name, "num_layers": cfg.num_hidden_layers, "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
        "split": split, "seed": seed, "corpus": CORPUS_NAMES[corpus],
        "traces": [],
    }
    for i, (source, prompt, continuation, kind) in enumerate(progress(items)):
        if continuation is None:
            continuation, trace = record_answer_trace(model, prompt, answer_tokens)
        else:
            trace = record_trace(model, prompt, continuation)
        name = f"trace_{i:05d}.safetensors"
        save_trace(trace, out / name)
        manifest["traces"].append({"file": name, "source": source, "continuation": kind,
                                   "prompt_tokens": prompt.shape[1], "continuation_tokens": continuation.shape[1]})
    written = out / "manifest.json.partial"
    written.write_text(json.dumps(manifest, indent=2))
    os.replace(written, out / "manifest.json")   # whole or not at all: the folder's traces are those it lists
    return manifest
