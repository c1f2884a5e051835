"""Needle in a haystack (RULER-style): facts hidden in filler text, then a question about them.

The one home of the needle and question sentences, the noise and the haystack. `make_needle_task` (one needle
at a chosen depth: the demo, KVP traces, tests) and `kvtier.eval.tasks` (RULER's variants, needles at random
depths) both build their prompts here, so the two can never drift apart.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .chat import chat_ids

NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
NEEDLE_INTRO = "Some special magic numbers are hidden in the following text. Remember them."
KEYS = ("river", "garden", "lantern", "harbor", "meadow", "castle", "window", "forest", "pepper", "violin")

NEEDLE = "The special magic number for {key} is {value}."
NEEDLE_ONE_OF = "One of the special magic numbers for {key} is {value}."        # several values per key
QUESTION = "What is the special magic number for {key}? Answer with the number only."
QUESTION_ALL = "What are all the special magic numbers for {key}? List the numbers only."
QUESTION_SEVERAL = "What are the special magic numbers for {keys}? List the numbers only."


def magic_number(rng: random.Random) -> str:
    """A 7-digit number: long enough that the model cannot guess it."""
    return str(rng.randrange(1_000_000, 10_000_000))


def noise_tokens(tokenizer: Any) -> int:
    """Tokens in one copy of `NOISE`, the unit haystacks are measured in."""
    return len(tokenizer(NOISE, add_special_tokens=False)["input_ids"])


def haystack(copies: int, inserts: Sequence[tuple[int, str]] = ()) -> str:
    """`copies` of `NOISE`, each insert ``(after, text)`` placed after `after` copies and followed by a space.

    Inserts at the same spot keep their order.
    """
    at: dict[int, list[str]] = {}
    for after, text in inserts:
        if not 0 <= after <= copies:
            raise ValueError(f"insert after {after} copies of the noise; allowed: 0 to {copies}")
        at.setdefault(after, []).append(text + " ")
    parts = []
    for i in range(copies + 1):
        parts += at.get(i, [])
        if i < copies:
            parts.append(NOISE)
    return "".join(parts)


def scattered_haystack(tokenizer: Any, length: int, inserts: Sequence[str], rng: random.Random) -> str:
    """About `length` tokens of noise with `inserts` at random depths, in order (RULER's layout)."""
    per = noise_tokens(tokenizer)
    copies = max(len(inserts) + 1, (length - 60 * len(inserts)) // per)
    spots = sorted(rng.sample(range(copies), len(inserts)))
    return haystack(copies, [(s + 1, text) for s, text in zip(spots, inserts)])


def needle_prompt(hay: str, question: str, intro: str = NEEDLE_INTRO) -> str:
    """The user message: the instruction, the haystack, then the question."""
    return f"{intro}\n\n{hay}\n\n{question}"


@dataclass(frozen=True)
class NeedleTask:
    """A prompt (chat-templated token ids), the expected answer, and where the needle sits."""

    input_ids: torch.Tensor      # [1, tokens]
    answer: str
    key: str
    needle_token: int            # index of the needle's first token in input_ids
    prompt_tokens: int

    def is_correct(self, text: str) -> bool:
        """The answer appears in the model's output as a whole number: a longer number that holds it (95288866 for
        9528886) is wrong, where RULER's string match would count it."""
        return re.search(rf"(?<!\d){re.escape(self.answer)}(?!\d)", text) is not None


def make_needle_task(tokenizer: Any, context_tokens: int = 3000, depth: float = 0.1,
                     seed: int = 0) -> NeedleTask:
    """Hide `NEEDLE` (a 7-digit number for a key) at `depth` of ~`context_tokens` of noise, then ask for it."""
    if not 0.0 <= depth <= 1.0:   # NaN too: int() of it, or a depth just outside, had failed or been clamped
        raise ValueError(f"depth={depth!r}; allowed: a share of the context from 0 to 1")
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) or context_tokens < 1:
        raise ValueError(f"context_tokens={context_tokens!r}; allowed: a whole number of tokens >= 1")
    rng = random.Random(seed)
    key = rng.choice(KEYS)
    answer = magic_number(rng)
    copies = max(1, context_tokens // noise_tokens(tokenizer))
    before = int(copies * depth)
    needle = NEEDLE.format(key=key, value=answer)
    content = needle_prompt(haystack(copies, [(before, needle)]), QUESTION.format(key=key))
    ids = chat_ids(tokenizer, content)
    return NeedleTask(ids, answer, key, _first_token_of(tokenizer, content, needle, ids), ids.shape[1])


def _first_token_of(tokenizer: Any, content: str, part: str, ids: torch.Tensor) -> int:
    """The index in `ids` (the chat prompt of `content`) of the first token of `part`, found by the tokens'
    character offsets in the prompt's text (counting the tokens of a prefix is off where the prefix's last token
    merges with what follows it)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    at = text.index(part)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if enc["input_ids"] != ids[0].tolist():
        raise ValueError("the chat prompt's text does not tokenize to the prompt's ids; cannot place the needle")
    return next(i for i, (_, end) in enumerate(enc["offset_mapping"]) if end > at)
