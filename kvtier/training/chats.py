"""Multi-turn conversations for KVP traces: a fact in the first turn (acknowledged), turns of prose with the
model's own sampled replies, then a question about the fact, answered greedily.

Needle traces put the fact in a haystack of repeated noise, and prose traces have no question at all; a chat
mixes real text, the model's own words and a fact that matters only at the end, as the users' long chats do.
The wording differs from the evaluation's multi-turn task (`kvtier.eval.tasks.multi_turn`), so a scorer
trained on these cannot have learned that task's sentences.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import torch
from transformers import DynamicCache

from ..integrations.hf import cache_kwargs
from ..tasks.needle import KEYS, magic_number
from .corpus import corpus_prose, in_turn, joined_ids, window_start

FACTS = (
    "Before we start, please note: the access code for the {key} room is {value}.",
    "Keep this in mind for later: my {key} account number is {value}.",
    "One thing first. The ticket number for the {key} order is {value}; I will ask about it later.",
)
QUESTIONS = (
    "What was the access code for the {key} room? Answer with the number only.",
    "What is my {key} account number? Answer with the number only.",
    "What was the ticket number for the {key} order? Answer with the number only.",
)
ACKNOWLEDGEMENTS = ("Noted, I will keep it in mind.", "Got it.", "Understood, I will remember that.")
REQUESTS = (
    "Summarize this passage in two sentences.",
    "What is the following text about?",
    "List the main points of the following.",
    "Explain the following to a beginner.",
    "Which function or idea in this text matters most, and why?",
)
READING_TURNS = 4


def _ids(tokenizer: Any, turns: list[dict[str, str]]) -> torch.Tensor:
    return tokenizer.apply_chat_template(turns, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


@torch.no_grad()
def greedy_answer(model: Any, ids: torch.Tensor, tokens: int) -> torch.Tensor:
    """The model's greedy ``[1, <= tokens]`` tokens after `ids`."""
    return model.generate(ids, **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=tokens,
                          do_sample=False)[:, ids.shape[1]:]


@torch.no_grad()
def _reply(model: Any, tokenizer: Any, turns: list[dict[str, str]], tokens: int) -> dict[str, str]:
    """The assistant's sampled turn after `turns`."""
    ids = _ids(tokenizer, turns)
    gen = model.generate(ids, **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=tokens,
                         do_sample=True, temperature=0.8, top_p=0.95,
                         pad_token_id=tokenizer.eos_token_id)[:, ids.shape[1]:]
    return {"role": "assistant", "content": tokenizer.decode(gen[0], skip_special_tokens=True).strip()}


def conversations(model: Any, tokenizer: Any, split: str, context_tokens: int | Sequence[int], count: int,
                  seed: int, corpus: str = "stdlib", reply_tokens: int = 48) -> list[tuple[str, torch.Tensor]]:
    """``(source, prompt)`` of ``count`` conversations of about `context_tokens` (several lengths are taken in
    turn) from `split`'s prose, each ending on the closing question."""
    lengths = in_turn(context_tokens)
    rng = random.Random(f"chat/{split}/{seed}")
    docs = corpus_prose(corpus, split)
    rng.shuffle(docs)
    stream = joined_ids(tokenizer, docs)
    out = []
    for i in range(count):
        target = lengths[i % len(lengths)]
        form = rng.randrange(len(FACTS))
        key, value = rng.choice(KEYS), magic_number(rng)
        turns = [{"role": "user", "content": FACTS[form].format(key=key, value=value)}]
        turns.append({"role": "assistant", "content": rng.choice(ACKNOWLEDGEMENTS)})
        question = {"role": "user", "content": QUESTIONS[form].format(key=key)}
        for turn in range(READING_TURNS):
            room = target - _ids(tokenizer, [*turns, question]).shape[1] - reply_tokens - 24
            size = room // (READING_TURNS - turn)
            if size < 32:
                break
            start = window_start(rng, stream.shape[1], size, f"a reading turn of a {target}-token conversation")
            text = tokenizer.decode(stream[0, start:start + size])
            turns.append({"role": "user", "content": f"{rng.choice(REQUESTS)}\n\n{text}"})
            turns.append(_reply(model, tokenizer, turns, reply_tokens))
        out.append((f"chat:{split}/seed={seed}/{i}", _ids(tokenizer, [*turns, question])))
    return out


def chat_prompts(model: Any, tokenizer: Any, split: str, context_tokens: int | Sequence[int], count: int,
                 answer_tokens: int, seed: int, corpus: str = "stdlib",
                 reply_tokens: int = 48) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """`conversations` with the model's greedy answer to the closing question as continuation."""
    return [(source, prompt, greedy_answer(model, prompt, answer_tokens))
            for source, prompt in conversations(model, tokenizer, split, context_tokens, count, seed, corpus,
                                                reply_tokens)]
