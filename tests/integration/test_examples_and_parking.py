"""Each example runs in its short mode; a parked conversation continues exactly as one never parked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.integrations.chat import ChatSession

pytestmark = pytest.mark.slow
EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_short_mode(script):
    done = subprocess.run([sys.executable, str(script), "--short"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_an_example_says_its_options_and_refuses_others(script):
    """`--help` prints the usage and runs nothing; a misspelt option is an error, not the full-size run."""
    shown = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "--short" in shown.stdout and "--device" in shown.stdout
    wrong = subprocess.run([sys.executable, str(script), "--shrot"], capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "unrecognized arguments: --shrot" in wrong.stderr


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_an_example_s_checks_hold_under_python_optimize(script):
    """An example checks what it shows with `if`, not `assert`: under `python -O` an assert is dropped, and
    long_chat.py then printed "identical ... yes" without running the conversation it compares with."""
    import ast

    tree = ast.parse(script.read_text())
    assert not [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]


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


def test_a_conversation_stepped_by_decode_graph_is_bit_identical(fresh_attention):
    """`ChatSession(decode_graph=True)`: each reply's steps through a `DecodeGraph` (planned whole and launched
    eagerly here, recall planned on the device as on a GPU), parked between turns, give the same tokens as a
    plain conversation, and the cache as the plain one leaves it."""
    from kvtier import TieredCache

    model, tok = fresh_attention

    def gpu_path_cache():
        cache = TieredCache(model.config, device_budget=0.2, host_budget=None, recall_pages=4)   # no disk pages
        return cache.take_gpu_path()   # recall planned, pages chosen, entries scored and checked as on a GPU

    stepped = ChatSession(model, tok, cache=gpu_path_cache(), decode_graph=True)
    plain = ChatSession(model, tok, cache=gpu_path_cache())
    assert plain.decode_graph is None
    for text in ["Tell me about the sea. " * 10, "And about rivers?"]:
        assert stepped.ask(text, max_new_tokens=10) == plain.ask(text, max_new_tokens=10)
        assert torch.equal(stepped.ids, plain.ids)
        stepped.park("host")
        plain.park("host")
    s = stepped.decode_graph.stats()
    assert s["eager"] > s["ordinary"] and s["failed"] is None, s   # most steps planned whole
    a, b = stepped.cache.stats(), plain.cache.stats()
    assert a["demotions"] == b["demotions"] and a["tokens_seen"] == b["tokens_seen"]
    with pytest.raises(ConfigError, match="decode_graph='yes'"):
        ChatSession(model, tok, decode_graph="yes")
    stepped.cache.close()
    plain.cache.close()


def test_a_reply_ending_in_whitespace_does_not_stop_the_conversation(fresh_attention):
    """A reply cut by max_new_tokens right after "\n\n" (its tokens end so) had been kept stripped in the messages,
    so the next turn's rendering did not start with the tokens the cache holds, and every later turn failed. The
    messages keep the reply as generated (the caller still gets it stripped), and the conversation goes on from
    the cache; a template that renders earlier turns otherwise prefills the conversation again, with a warning."""
    import warnings

    model, tok = fresh_attention
    chat = ChatSession(model, tok, device_budget=1.0)
    for q in ["Hi, I am Ada.", "What is my name?", "Tell me a joke."]:
        reply = chat.ask(q, max_new_tokens=20)
        assert reply == reply.strip() and chat.messages[-1]["content"].strip() == reply
    assert tok.decode(chat.ids[0]).endswith("\n\n")
    held = chat.cache.get_seq_length()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chat.ask("Another one, please.", max_new_tokens=5)
    assert chat.cache.stats()["tokens_seen"] > held   # went on from the cache, not prefilled again
    chat.messages[0]["content"] = "Hi, I am Bob."        # the rendering no longer matches the tokens held
    with pytest.warns(RuntimeWarning, match="prefilled again"):
        chat.ask("Who am I?", max_new_tokens=5)
    said = tok.decode(chat.ids[0])
    assert "Hi, I am Bob." in said and "Hi, I am Ada." not in said
    with pytest.raises(ConfigError, match="cache settings device_budget given with a cache"):
        ChatSession(model, tok, cache=chat.cache, device_budget=0.1)
    chat.cache.close()


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
