"""RULER-style synthetic tasks, generated offline from templates and seeds, plus perplexity and multi-turn chat.

Haystacks are RULER's repeated-sentence noise, and the needle texts and haystacks come from
`kvtier.tasks.needle`, the builder the demo and the KVP traces use. Each example knows its expected answers;
scoring is RULER's string match (the share of expected answers found in the model's output).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..tasks.chat import chat_ids
from ..tasks.needle import (KEYS, NEEDLE, NEEDLE_ONE_OF, QUESTION, QUESTION_ALL, QUESTION_SEVERAL, haystack,
                            magic_number, needle_prompt, noise_tokens, scattered_haystack)

WORDS = ("apple", "bridge", "candle", "dragon", "engine", "falcon", "garden", "hammer", "island", "jacket",
         "kettle", "ladder", "marble", "needle", "orange", "pillow", "quartz", "rocket", "saddle", "tunnel",
         "umbrella", "violin", "walnut", "yogurt", "zipper", "anchor", "basket", "cactus", "dolphin", "feather")


@dataclass
class Example:
    """One prompt and what a correct answer contains (or, for perplexity, the continuation to score)."""

    task: str
    length: int
    seed: int
    input_ids: torch.Tensor                  # [1, tokens]
    answers: list[str] = field(default_factory=list)
    max_new_tokens: int = 32
    continuation: torch.Tensor | None = None  # [1, tokens], perplexity tasks only

    def score(self, text: str) -> float:
        """RULER string_match_all: the share of expected answers present in `text`, as RULER scores it (a
        substring match, so a longer number that holds an answer counts for it)."""
        return sum(a.lower() in text.lower() for a in self.answers) / len(self.answers)


def niah_single(tokenizer, length, rng):
    key, value = rng.choice(KEYS), magic_number(rng)
    hay = scattered_haystack(tokenizer, length, [NEEDLE.format(key=key, value=value)], rng)
    return chat_ids(tokenizer, needle_prompt(hay, QUESTION.format(key=key))), [value], 24


def niah_multikey(tokenizer, length, rng):
    keys = rng.sample(KEYS, 4)
    values = [magic_number(rng) for _ in keys]
    hay = scattered_haystack(tokenizer, length, [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)], rng)
    return chat_ids(tokenizer, needle_prompt(hay, QUESTION.format(key=keys[0]))), [values[0]], 24


def niah_multivalue(tokenizer, length, rng):
    key = rng.choice(KEYS)
    values = [magic_number(rng) for _ in range(3)]
    hay = scattered_haystack(tokenizer, length, [NEEDLE_ONE_OF.format(key=key, value=v) for v in values], rng)
    return chat_ids(tokenizer, needle_prompt(hay, QUESTION_ALL.format(key=key))), values, 48


def niah_multiquery(tokenizer, length, rng):
    keys = rng.sample(KEYS, 3)
    values = [magic_number(rng) for _ in keys]
    hay = scattered_haystack(tokenizer, length, [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)], rng)
    q = QUESTION_SEVERAL.format(keys=f"{keys[0]} and {keys[1]}")
    return chat_ids(tokenizer, needle_prompt(hay, q)), values[:2], 48


def variable_tracking(tokenizer, length, rng):
    names = ["".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5)) for _ in range(6)]
    value = str(rng.randrange(10_000, 100_000))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = {names[i - 1]}." for i in range(1, 4)]
    hay = scattered_haystack(tokenizer, length, chain, rng)
    q = f"Find all variables that are assigned the value {value} in the text above. Answer with the names only."
    intro = "Memorize and track the chain of variable assignments in the text."
    return chat_ids(tokenizer, needle_prompt(hay, q, intro)), names[:4], 32


def shuffled_words(counts: dict[str, int], rng: random.Random) -> list[str]:
    """Each word its count of times, in a shuffled order."""
    words = [w for w, n in counts.items() for _ in range(n)]
    rng.shuffle(words)
    return words


def common_words(tokenizer, length, rng):
    """A numbered list in which three words are each about a tenth of the list, and every other word strictly less
    frequent, so the three are the answer whatever the length."""
    common = rng.sample(WORDS, 3)
    rare = [w for w in WORDS if w not in common]
    n_words = max(30, length // 5)
    top = max(3, round(0.1 * n_words))
    counts = dict.fromkeys(common, top)
    for _ in range(n_words - 3 * top):
        open_ = [w for w in rare if counts.get(w, 0) < top - 1]
        if not open_:
            break
        w = rng.choice(open_)
        counts[w] = counts.get(w, 0) + 1
    listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(shuffled_words(counts, rng)))
    q = "What are the 3 most common words in the list above? Answer with the words only."
    return chat_ids(tokenizer, f"Below is a numbered list of words.\n\n{listing}\n\n{q}"), common, 24


def frequent_words(tokenizer, length, rng):
    """Coded words in Zipf-like proportions; the three most frequent are each strictly more frequent than any
    other (raised where rounding would have tied them)."""
    vocab: list[str] = []
    while len(vocab) < 40:   # distinct: two equal codes would share one count
        code = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5))
        if code not in vocab:
            vocab.append(code)
    weights = [1 / (i + 1) ** 1.5 for i in range(len(vocab))]
    n_words = max(30, length // 3)
    counts = [max(1, round(n_words * w / sum(weights))) for w in weights]
    for i in (2, 1, 0):
        counts[i] = max(counts[i], counts[3] + 1)
    text = " ".join(shuffled_words(dict(zip(vocab, counts)), rng))
    q = "What are the 3 most frequently used coded words in the text above? Answer with the words only."
    return chat_ids(tokenizer, f"Read the following coded text and track how often each coded word appears.\n\n"
                               f"{text}\n\n{q}"), vocab[:3], 24


def multi_turn(tokenizer, length, rng):
    key, value = rng.choice(KEYS), magic_number(rng)
    per = noise_tokens(tokenizer)
    turns = [{"role": "user", "content": f"Please remember this: the code number for {key} is {value}."},
             {"role": "assistant", "content": "Noted, I will remember it."}]
    chunk = haystack(max(1, (length // 4) // per))
    for _ in range(3):
        turns += [{"role": "user", "content": f"Here is some text to read: {chunk}"},
                  {"role": "assistant", "content": "I have read it."}]
    turns.append({"role": "user", "content": f"What is the code number for {key}? Answer with the number only."})
    ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return ids["input_ids"], [value], 24


def perplexity(tokenizer, length, rng):
    """A window of held-out prose (the evaluation half of the corpus): prompt, then 256 tokens to score."""
    from ..training.corpus import stdlib_prose, window_start

    docs = stdlib_prose("eval")
    stream = tokenizer("\n\n".join(t for _, t in docs), add_special_tokens=False, return_tensors="pt")["input_ids"]
    cont = 256
    start = window_start(rng, stream.shape[1], length + cont, f"a perplexity window of {length} prompt and {cont} "
                         "scored tokens")
    window = stream[:, start:start + length + cont]
    return window[:, :length], window[:, length:]


GENERATION_TASKS: dict[str, Callable] = {
    "niah_single": niah_single, "niah_multikey": niah_multikey, "niah_multivalue": niah_multivalue,
    "niah_multiquery": niah_multiquery, "variable_tracking": variable_tracking, "common_words": common_words,
    "frequent_words": frequent_words, "multi_turn": multi_turn,
}
TASKS = (*GENERATION_TASKS, "perplexity")


def make_example(tokenizer: Any, task: str, length: int, seed: int) -> Example:
    """The example of `task` at about `length` tokens for `seed` (the same every time)."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length={length!r}; allowed: a whole number of prompt tokens >= 1")
    rng = random.Random(f"{task}/{length}/{seed}")
    if task == "perplexity":
        prompt, cont = perplexity(tokenizer, length, rng)
        return Example(task, length, seed, prompt, continuation=cont)
    if task not in GENERATION_TASKS:
        raise ValueError(f"task {task!r}; allowed: {', '.join(TASKS)}")
    ids, answers, max_new = GENERATION_TASKS[task](tokenizer, length, rng)
    return Example(task, length, seed, ids, answers, max_new)
