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
