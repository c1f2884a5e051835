"""The prompts KVP traces are recorded on: needle haystacks of several lengths, and multi-turn conversations."""

from __future__ import annotations

import pytest
import torch

from kvtier.training.chats import FACTS, QUESTIONS, chat_prompts
from kvtier.training.collect import needle_prompts


def test_needle_haystacks_take_the_lengths_in_turn(default_model):
    model, tok = default_model
    out = needle_prompts(model, tok, "train", [300, 600], 3, answer_tokens=2, seed=0)
    sizes = [prompt.shape[1] for _, prompt, _ in out]
    assert sizes[0] < sizes[1] and abs(sizes[0] - sizes[2]) < 40
    assert len({source for source, _, _ in out}) == 3


def test_the_splits_needle_tasks_never_overlap(default_model):
    """Every allowed seed keeps the train split's needle tasks apart from the eval split's (a train seed of 1,000
    had drawn exactly the eval split's tasks of seed 0), and the seeds and counts that would not are refused."""
    from kvtier import ConfigError
    from kvtier.training.collect import NEEDLE_SEEDS, needle_tasks

    _, tok = default_model
    train = {source for source, _ in needle_tasks(tok, "train", 256, 2, seed=NEEDLE_SEEDS - 1)}
    evals = {source for source, _ in needle_tasks(tok, "eval", 256, 2, seed=0)}
    assert train == {"needle:seed=999000", "needle:seed=999001"} and not train & evals
    for seed, count in ((NEEDLE_SEEDS, 1), (-1, 1), (0, NEEDLE_SEEDS + 1)):
        with pytest.raises(ConfigError, match="needle tasks"):
            needle_tasks(tok, "train", 256, count, seed=seed)


def test_a_conversation_has_the_fact_prose_turns_and_the_question(default_model):
    model, tok = default_model
    torch.manual_seed(0)
    out = chat_prompts(model, tok, "train", [400, 600], 2, answer_tokens=4, seed=3, reply_tokens=8)
    assert [source for source, _, _ in out] == ["chat:train/seed=3/0", "chat:train/seed=3/1"]
    for (_, prompt, answer), target in zip(out, (400, 600)):
        assert target - 200 < prompt.shape[1] <= target + 16     # re-encoded replies may run a few tokens over
        assert 1 <= answer.shape[1] <= 4
        text = tok.decode(prompt[0])
        form = next(i for i, f in enumerate(FACTS) if f.split("{")[0] in text)
        assert text.index(FACTS[form].split("{")[0]) < text.index(QUESTIONS[form].split("{")[0])
        assert text.rstrip().endswith("assistant")
        assert text.count("<|im_start|>assistant") >= 4    # the acknowledgement, the model's replies, the answer


@pytest.mark.parametrize("answer_tokens", [6, 1])
def test_a_trace_recorded_in_two_passes_equals_the_one_pass_definition(default_model, answer_tokens):
    """`record_answer_trace` prefills the prompt once, answers from that cache and reads the answer's
    attention after it; the answer and every tensor must equal a plain generate and `layer_statistics` over
    one forward of prompt plus answer."""
    from kvtier.tasks import make_needle_task
    from kvtier.training.chats import greedy_answer
    from kvtier.training.traces import baseline_scorers, capture_attention, layer_statistics, record_answer_trace

    model, tok = default_model
    prompt = make_needle_task(tok, 400, depth=0.3, seed=5).input_ids
    answer, trace = record_answer_trace(model, prompt, answer_tokens)
    assert torch.equal(answer, greedy_answer(model, prompt, answer_tokens))
    assert answer.shape[1] == answer_tokens        # a one-token answer leaves the cache at the prompt itself
    n = prompt.shape[1]
    expect: dict[int, dict[str, torch.Tensor]] = {}

    def on_layer(module, query, key, value, kwargs):
        stats = layer_statistics(query, key, value, module.scaling, n, baseline_scorers(), module.layer_idx,
                                 targets=True)
        expect[module.layer_idx] = {**stats, "keys": key[0, :, :n], "values": value[0, :, :n]}

    with torch.no_grad(), capture_attention(model, on_layer):
        model(torch.cat([prompt, answer], dim=1), use_cache=False)
    assert set(trace) == {*expect[0], "positions"}
    assert torch.equal(trace["positions"], torch.arange(n))
    for name in expect[0]:
        want = torch.stack([expect[i][name] for i in sorted(expect)])
        assert trace[name].shape == want.shape, name
        tol = dict(rtol=2e-3, atol=2e-3) if name in ("keys", "values") else dict(rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(trace[name].float(), want.float(), msg=name, **tol)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_capture_keeps_the_models_own_attention_after_a_cache(implementation):
    """Under `capture_attention` the logits equal a plain forward, for a prefill and for queries after a cache:
    transformers builds no mask for an implementation it does not know, so the capture must lend the model's."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from kvtier.integrations.hf import cache_kwargs
    from kvtier.training.traces import capture_attention

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation=implementation)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 24))
    seen = []
    with torch.no_grad():
        plain = model(ids).logits
        with capture_attention(model, lambda module, q, k, v, kw: seen.append(q.shape[2])):
            captured = model(ids).logits
            cache = DynamicCache(config=config)
            model(ids[:, :17], **cache_kwargs(cache))
            after = model(ids[:, 17:], **cache_kwargs(cache)).logits
    torch.testing.assert_close(captured, plain)
    torch.testing.assert_close(after, plain[:, 17:], rtol=1e-4, atol=1e-5)
    assert seen == [24, 24, 17, 17, 7, 7]
    assert model.config._attn_implementation == implementation
