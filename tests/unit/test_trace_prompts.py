"""The prompts KVP traces are recorded on: needle haystacks of several lengths, and multi-turn conversations."""

from __future__ import annotations

import torch

from kvtier.training.chats import FACTS, QUESTIONS, chat_prompts
from kvtier.training.collect import needle_prompts


def test_needle_haystacks_take_the_lengths_in_turn(default_model):
    model, tok = default_model
    out = needle_prompts(model, tok, "train", [300, 600], 3, answer_tokens=2, seed=0)
    sizes = [prompt.shape[1] for _, prompt, _ in out]
    assert sizes[0] < sizes[1] and abs(sizes[0] - sizes[2]) < 40
    assert len({source for source, _, _ in out}) == 3


def test_a_conversation_has_the_fact_prose_turns_and_the_question(default_model):
    model, tok = default_model
    torch.manual_seed(0)
    out = chat_prompts(model, tok, "train", [700, 1000], 2, answer_tokens=4, seed=3, reply_tokens=8)
    assert [source for source, _, _ in out] == ["chat:train/seed=3/0", "chat:train/seed=3/1"]
    for (_, prompt, answer), target in zip(out, (700, 1000)):
        assert target - 200 < prompt.shape[1] <= target + 16     # re-encoded replies may run a few tokens over
        assert 1 <= answer.shape[1] <= 4
        text = tok.decode(prompt[0])
        form = next(i for i, f in enumerate(FACTS) if f.split("{")[0] in text)
        assert text.index(FACTS[form].split("{")[0]) < text.index(QUESTIONS[form].split("{")[0])
        assert text.rstrip().endswith("assistant")
        assert text.count("<|im_start|>assistant") >= 4    # the acknowledgement, the model's replies, the answer

