"""Each example runs in its short mode; a parked conversation continues exactly as one never parked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.integrations.chat import ChatSession

pytestmark = pytest.mark.slow
EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_short_mode(script):
    done = subprocess.run([sys.executable, str(script), "--short"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()


def test_examples_exist():
    assert {p.name for p in EXAMPLES} >= {"hf_generate.py", "long_chat.py", "needle_1m.py", "custom_scorer.py"}


@pytest.mark.parametrize("to", ["host", "disk"])
def test_parked_conversation_is_bit_identical(fresh_attention, to):
    model, tok = fresh_attention
    parked = ChatSession(model, tok, device_budget=0.2, host_budget=0.3)
    plain = ChatSession(model, tok, device_budget=0.2, host_budget=0.3)
    for text in ["Tell me about the sea. " * 20, "And about rivers?", "Which one did I ask about first?"]:
        assert parked.ask(text, max_new_tokens=16) == plain.ask(text, max_new_tokens=16)
        parked.park(to)
        assert parked.cache.parked == to and parked.cache.stats()["device"]["tokens"] == 0
        assert torch.equal(parked.ids, plain.ids)
    parked.cache.close()
    plain.cache.close()


def test_an_interrupted_turn_leaves_the_conversation_as_it_was(fresh_attention):
    """A turn stopped midway (here by an exception from a stopping criterion) empties the cache it had
    partly filled; the next turn re-prefills and answers as a conversation never interrupted."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Interrupt(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if input_ids.shape[1] > self.start + 3:
                raise KeyboardInterrupt
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    model, tok = fresh_attention
    chat = ChatSession(model, tok, device_budget=0.2, host_budget=0.3)
    plain = ChatSession(model, tok, device_budget=0.2, host_budget=0.3)
    first = "Tell me about the sea. " * 20
    assert chat.ask(first, max_new_tokens=8) == plain.ask(first, max_new_tokens=8)
    stop = Interrupt()
    stop.start = chat.ids.shape[1]
    with pytest.raises(KeyboardInterrupt):
        chat.ask("And about rivers?", max_new_tokens=16, stopping_criteria=StoppingCriteriaList([stop]))
    assert chat.cache.get_seq_length() == 0 and chat.ids.shape[1] == 0 and len(chat.messages) == 2
    assert chat.ask("And about rivers?", max_new_tokens=8) == plain.ask("And about rivers?", max_new_tokens=8)
    chat.cache.close()
    plain.cache.close()
