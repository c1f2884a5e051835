"""TieredCache on the real default model: exactness, recall, budgets, needle retrieval."""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache

from kvtier import TieredCache, UnsupportedError
from kvtier.integrations.hf import cache_kwargs
from kvtier.placement.page_table import HOST
from kvtier.tasks import make_needle_task

pytestmark = pytest.mark.slow


def _chat_ids(tokenizer, text):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        return_tensors="pt")
    return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]


PROMPT = ("Here is a short story about a lighthouse keeper named Ada who lives on a rocky island. "
          "Every night she climbs the stairs and lights the lamp for passing ships. ") * 6 + \
         "Continue the story in a few sentences."


@torch.no_grad()
def test_full_budget_is_identical_to_dynamic_cache(fresh_attention):
    model, tok = fresh_attention
    ids = _chat_ids(tok, PROMPT)
    ref_logits = model(ids, **cache_kwargs(DynamicCache(config=model.config))).logits
    ref = model.generate(ids, **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=64,
                         do_sample=False)
    cache = TieredCache(model.config, device_budget=1.0, host_budget=1.0, scorer="keynorm")
    out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=64, do_sample=False)
    assert torch.equal(out, ref)
    assert cache.stats()["bytes_moved"]["device_to_host"] == 0
    logits = model(ids, **cache_kwargs(TieredCache(model.config, device_budget=1.0))).logits
    assert torch.equal(logits, ref_logits)
    # other caches are untouched by the routed attention
    again = model.generate(ids, **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=64,
                           do_sample=False)
    assert torch.equal(again, ref)
    cache.close()


@pytest.mark.skipif(Version(transformers.__version__) < Version("5.24"), reason="`cache=` arrived in 5.24")
@torch.no_grad()
def test_cache_keyword(fresh_attention):
    model, tok = fresh_attention
    ids = _chat_ids(tok, PROMPT)
    ref = model.generate(ids, cache=DynamicCache(config=model.config), max_new_tokens=16, do_sample=False)
    out = model.generate(ids, cache=TieredCache(model.config, device_budget=1.0), max_new_tokens=16,
                         do_sample=False)
    assert torch.equal(out, ref)


@torch.no_grad()
def test_recall_of_every_page_matches_full_cache(fresh_attention):
    """device 10%, host 20%, the rest on disk, recall budget covering every page: the union is everything."""
    model, tok = fresh_attention
    ids = _chat_ids(tok, PROMPT * 3)
    ref_cache = DynamicCache(config=model.config)
    cache = TieredCache(model.config, device_budget=0.1, host_budget=0.2, recall_pages=100_000)
    ref = model(ids, **cache_kwargs(ref_cache)).logits[:, -1:]
    got = model(ids, **cache_kwargs(cache)).logits[:, -1:]
    torch.testing.assert_close(got, ref)
    s = cache.stats()
    assert s["disk"]["tokens"] > 0 and s["host"]["tokens"] > 0
    assert s["device"]["tokens"] < 0.11 * s["tokens_seen"] * s["layers"] * s["kv_heads"] + 2 * 20 * 90
    for _ in range(24):  # teacher-forced: both caches get the same next token
        nxt = ref[:, -1].argmax(-1, keepdim=True)
        ref = model(nxt, **cache_kwargs(ref_cache)).logits
        got = model(nxt, **cache_kwargs(cache)).logits
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    s = cache.stats()
    assert s["pages_recalled_from"]["disk"] > 0 and s["pages_recalled_from"]["host"] > 0
    assert s["bytes_moved"]["disk_to_device"] > 0
    cache.close()


@torch.no_grad()
def test_tiers_stay_within_budget_over_a_long_generation(fresh_attention):
    model, tok = fresh_attention
    ids = _chat_ids(tok, PROMPT)
    cache = TieredCache(model.config, device_budget=0.1, host_budget=0.2, recall_pages=8)
    logits = model(ids, **cache_kwargs(cache)).logits
    for step in range(160):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        logits = model(nxt, **cache_kwargs(cache)).logits
        seen = ids.shape[1] + step + 1
        device_budget = cache.settings.device_tokens(seen)
        host_budget = cache.settings.host_tokens(seen)
        for layer in cache.layers:
            engine = layer.engine
            # measured from the pool; whole pages move, so up to a page waits above the budget
            assert engine.pool.count <= device_budget + engine.cfg.page_size - 1
            assert int(engine.table.tokens(HOST).max()) <= host_budget
    s = cache.stats()
    assert s["tokens_seen"] == ids.shape[1] + 160
    total = s["device"]["tokens"] + s["host"]["tokens"] + s["disk"]["tokens"]
    assert total == s["tokens_seen"] * s["layers"] * s["kv_heads"]  # nothing lost
    cache.close()


@torch.no_grad()
def test_needle_is_found_with_ten_percent_on_device(fresh_attention):
    model, tok = fresh_attention
    task = make_needle_task(tok, context_tokens=3000, depth=0.1, seed=0)
    full = model.generate(task.input_ids, **cache_kwargs(DynamicCache(config=model.config)),
                          max_new_tokens=24, do_sample=False)
    full_text = tok.decode(full[0, task.prompt_tokens:], skip_special_tokens=True)
    cache = TieredCache(model.config, device_budget=0.1, host_budget=0.2, recall_pages=32)
    out = model.generate(task.input_ids, **cache_kwargs(cache), max_new_tokens=24, do_sample=False)
    text = tok.decode(out[0, task.prompt_tokens:], skip_special_tokens=True)
    assert task.is_correct(full_text), full_text
    assert task.is_correct(text), text
    s = cache.stats()
    assert s["device"]["tokens"] <= 0.1 * s["tokens_seen"] * s["layers"] * s["kv_heads"] + s["layers"] * 3
    cache.close()


def test_batch_of_two_is_refused(fresh_attention):
    model, tok = fresh_attention
    ids = _chat_ids(tok, "Hello there")
    with pytest.raises(UnsupportedError, match="batch size 2"):
        model(ids.repeat(2, 1), **cache_kwargs(TieredCache(model.config)))
