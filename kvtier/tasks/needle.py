"""Needle in a haystack (RULER-style): a fact hidden in filler text, then a question about it."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
NEEDLE_INTRO = "Some special magic numbers are hidden in the following text. Remember them."
KEYS = ("river", "garden", "lantern", "harbor", "meadow", "castle", "window", "forest", "pepper", "violin")


@dataclass(frozen=True)
class NeedleTask:
    """A prompt (chat-templated token ids), the expected answer, and where the needle sits."""

    input_ids: torch.Tensor      # [1, tokens]
    answer: str
    key: str
    needle_token: int            # index of the needle's first token in input_ids
    prompt_tokens: int

    def is_correct(self, text: str) -> bool:
        """RULER's string match: the answer appears in the model's output."""
        return self.answer in text


def make_needle_task(tokenizer: Any, context_tokens: int = 3000, depth: float = 0.1,
                     seed: int = 0) -> NeedleTask:
    """Hide "The special magic number for <key> is <7 digits>." at `depth` of ~`context_tokens` of noise."""
    rng = random.Random(seed)
    key = rng.choice(KEYS)
    answer = str(rng.randrange(1_000_000, 10_000_000))
    needle = f"The special magic number for {key} is {answer}. "
    noise_tokens = len(tokenizer(NOISE, add_special_tokens=False)["input_ids"])
    reps = max(1, context_tokens // noise_tokens)
    before = int(reps * depth)
    haystack = NOISE * before + needle + NOISE * (reps - before)
    question = f"What is the special magic number for {key}? Answer with the number only."
    content = f"{NEEDLE_INTRO}\n\n{haystack}\n\n{question}"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    prefix = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{NEEDLE_INTRO}\n\n{NOISE * before}"}], tokenize=False)
    needle_token = len(tokenizer(prefix, add_special_tokens=False)["input_ids"]) - 5
    return NeedleTask(ids, answer, key, max(needle_token, 0), ids.shape[1])
