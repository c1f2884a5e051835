"""The rest of transformers' Cache contract: independent deep copies (pages on host and disk included), layer
keys/values, and refusals that name the feature asked for (beam search, several sequences, assisted decoding,
crop, shallow copies, pickling)."""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
from tiny_models import tiny_llama
from transformers import DynamicCache

from kvtier import TieredCache, UnsupportedError, cache_kwargs

PROMPT = torch.randint(0, 128, (1, 160), generator=torch.Generator().manual_seed(3))
TIERED = dict(device_budget=24, host_budget=40, recall_pages=1000, scorer="keynorm")


@torch.no_grad()
def greedy(model, cache, ids, n=6) -> list[int]:
    """Feed `ids`, then `n` greedy tokens one at a time."""
    out, step = [], ids
    for _ in range(n):
        logits = model(step, **cache_kwargs(cache)).logits
        step = logits[:, -1:].argmax(-1)
        out.append(int(step))
    return out


def test_deepcopy_is_an_independent_copy_of_every_tier(model, tmp_path):
    cache, ref = TieredCache(model.config, disk_dir=tmp_path, **TIERED), DynamicCache(config=model.config)
    assert greedy(model, cache, PROMPT, n=1) == greedy(model, ref, PROMPT, n=1)
    before = cache.stats()
    assert before["host"]["tokens"] and before["disk"]["tokens"]   # all three tiers hold pages
    twin, ref_twin = copy.deepcopy(cache), copy.deepcopy(ref)
    assert not twin.closed and twin.disk_path != cache.disk_path
    after = twin.stats()
    for tier in ("device", "host", "disk"):
        assert after[tier]["tokens"] == before[tier]["tokens"]
    assert after["tokens_seen"] == before["tokens_seen"]
    follow = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(4))
    assert greedy(model, twin, follow) == greedy(model, ref_twin, follow)
    other = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(5))
    assert greedy(model, cache, other) == greedy(model, ref, other)   # the copy's steps left the original alone
    path = cache.disk_path
    cache.close()                          # the original going away leaves the copy whole
    assert not os.path.exists(path)
    again, ref_again = copy.deepcopy(twin), copy.deepcopy(ref_twin)
    twin.close()
    assert greedy(model, again, other) == greedy(model, ref_again, other)
    again.close()


@pytest.mark.parametrize("promote", [False, True])
def test_a_deepcopy_that_fails_midway_raises_its_own_error_and_leaves_the_original_whole(model, tmp_path, monkeypatch,
                                                                                          promote):
    """The copy's disk store fails while it takes the disk pages: the error says so (the half-made copy, closed,
    frees only its own records, never the source's slot numbers in its own store), and the original decodes on."""
    from kvtier.errors import CapacityError
    from kvtier.tiers.disk import DiskStore

    with TieredCache(model.config, disk_dir=tmp_path, promote=promote, **TIERED) as cache, \
            TieredCache(model.config, disk_dir=tmp_path, promote=promote, **TIERED) as twin:
        for c in (cache, twin):
            greedy(model, c, PROMPT, n=4)
        assert cache.stats()["disk"]["tokens"]
        real, mine = DiskStore.store, cache._shared.disk_store

        def full_but_mine(self, k, v):
            if self is not mine:
                raise CapacityError("disk full: the copy's store")
            return real(self, k, v)

        monkeypatch.setattr(DiskStore, "store", full_but_mine)
        with pytest.raises(CapacityError, match="the copy's store"):
            copy.deepcopy(cache)
        monkeypatch.setattr(DiskStore, "store", real)
        other = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(5))
        assert greedy(model, cache, other) == greedy(model, twin, other)


def test_deepcopy_of_a_parked_cache_is_refused_and_changes_nothing(model, tmp_path):
    with TieredCache(model.config, disk_dir=tmp_path, **TIERED) as cache:
        greedy(model, cache, PROMPT, n=1)
        cache.park("host")
        with pytest.raises(UnsupportedError, match="resume"):
            copy.deepcopy(cache)
        assert cache.parked == "host"
        cache.resume()
        assert copy.deepcopy(cache).stats()["tokens_seen"] == cache.stats()["tokens_seen"]


def test_shallow_copies_and_pickling_are_refused(model):
    with TieredCache(model.config, device_budget=1.0) as cache:
        with pytest.raises(UnsupportedError, match="deepcopy"):
            copy.copy(cache)
        with pytest.raises(UnsupportedError, match="pickled"):
            pickle.dumps(cache)


def test_layer_keys_and_values_are_the_device_entries(model, tmp_path):
    with TieredCache(model.config, disk_dir=tmp_path, **TIERED) as cache:
        assert cache.layers[0].keys is None        # no step yet, as transformers' own layers
        greedy(model, cache, PROMPT, n=1)
        layer = cache.layers[0]
        keys, values, pos = layer.keys, layer.values, layer.positions
        assert keys.shape == values.shape == (1, 2, pos.shape[1], 16)
        assert keys.shape[2] == cache.stats()["device"]["tokens"] // (2 * len(cache.layers))
        ref = DynamicCache(config=model.config)
        with torch.no_grad():
            model(PROMPT, **cache_kwargs(ref))
        for h in range(2):   # the same entries a plain cache holds at those positions
            assert torch.equal(keys[0, h], ref.layers[0].keys[0, h, pos[h]])
            assert torch.equal(values[0, h], ref.layers[0].values[0, h, pos[h]])
        keys.zero_()                                # a copy: the cache is untouched
        assert not torch.equal(layer.keys, keys)
        with pytest.raises(UnsupportedError, match="cannot be assigned"):
            layer.keys = torch.zeros(1)
        cache.park("host")
        with pytest.raises(UnsupportedError, match="resume"):
            _ = layer.keys


@pytest.mark.parametrize("kwargs, feature", [
    (dict(num_beams=3), "beam search"),
    (dict(do_sample=True, num_return_sequences=2), "num_return_sequences=2"),
])
def test_generate_features_that_need_several_sequences_are_named(model, kwargs, feature):
    with TieredCache(model.config) as cache:
        with pytest.raises(UnsupportedError, match=feature):
            model.generate(PROMPT[:, :20], max_new_tokens=3, **kwargs, **cache_kwargs(cache))
        assert cache.broken is None and cache.get_seq_length() == 0   # refused before any layer took it


def test_assisted_decoding_and_crop_are_named(model):
    assistant = tiny_llama(seed=1)
    with TieredCache(model.config) as cache:
        with pytest.raises(UnsupportedError, match="assisted decoding"):
            model.generate(PROMPT[:, :20], max_new_tokens=3, assistant_model=assistant, do_sample=False,
                           **cache_kwargs(cache))
        with pytest.raises(UnsupportedError, match=r"crop\(-2\)"):
            cache.crop(-2)
        # the options generate passes differ between transformers releases; each gets the refusal, not a TypeError
        for options in ({}, {"recurrent_states_to_keep": 3}, {"recurrent_states_to_keep": None}):
            with pytest.raises(UnsupportedError, match="assisted decoding"):
                cache.activate_past_recording(**options)
            with pytest.raises(UnsupportedError, match="assisted decoding"):
                cache.layers[0].activate_past_recording(**options)


def test_batched_prompts_are_refused_by_batch_size(model):
    with TieredCache(model.config) as cache:
        with pytest.raises(UnsupportedError, match="batch size 2"):
            model(PROMPT[:, :10].repeat(2, 1), **cache_kwargs(cache))


@torch.no_grad()
@pytest.mark.parametrize("on_device", [False, True], ids=["host-plan", "device-plan"])
def test_attention_weights_with_recall_equal_a_plain_caches(on_device):
    """Eager weights over every recalled page, whichever path planned the recall."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, vocab_size=128,
                                         attn_implementation="eager")).eval()
    ids = PROMPT[:, :150]
    ref = DynamicCache(config=model.config)
    model(ids, **cache_kwargs(ref))
    want = model(torch.tensor([[5]]), output_attentions=True, **cache_kwargs(ref)).attentions
    with TieredCache(model.config, device_budget=40, recall_pages=1000, scorer="keynorm") as cache:
        model(ids, **cache_kwargs(cache))
        for e in cache._engines:
            e.device_recall = on_device
        got = model(torch.tensor([[5]]), output_attentions=True, **cache_kwargs(cache)).attentions
        assert cache.stats()["pages_recalled"] > 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@torch.no_grad()
def test_prefetching_recall_gives_the_host_paths_tokens_and_weights():
    """Device-planned recall that prefetches the next-ranked pages (forced on the CPU) picks and attends to the
    same pages as the host path at partial recall: the same greedy tokens, the same eager weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, vocab_size=128,
                                         attn_implementation="eager")).eval()
    ids = PROMPT[:, :200]
    runs = []
    for on_device in (False, True):
        with TieredCache(model.config, device_budget=40, recall_pages=3, prefetch_pages=4, page_size=4,
                         scorer="keynorm") as cache:
            model(ids, **cache_kwargs(cache))
            for e in cache._engines:
                e.device_recall = on_device
            token, tokens, maps = torch.tensor([[5]]), [], []
            for _ in range(12):
                out = model(token, output_attentions=True, **cache_kwargs(cache))
                token = out.logits[:, -1:].argmax(-1)
                tokens.append(int(token))
                maps.append(out.attentions)
            runs.append((tokens, maps, cache.stats()))
    (tokens, maps, host), (tokens_dev, maps_dev, dev) = runs
    assert tokens == tokens_dev
    for step, (a, b) in enumerate(zip(maps, maps_dev)):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, atol=1e-6, rtol=1e-5, msg=f"step {step}")
    assert host["prefetch"] == {"pages": 0, "used": 0, "hit_rate": None}
    assert dev["prefetch"]["pages"] > 0 and dev["reuse_rate"] > host["reuse_rate"]
    assert dev["recall_steps"] == host["recall_steps"]


def test_deepcopy_carries_the_history_and_its_own_scorer(model, tmp_path):
    cache = TieredCache(model.config, disk_dir=tmp_path, device_budget=24, host_budget=40, recall_pages=8,
                        scorer="random", scorer_kwargs={"seed": 3})
    for e in cache._engines:
        e.device_recall = True      # counts wait on the device until stats(): the copy must not lose them
    greedy(model, cache, PROMPT, n=4)
    twin = copy.deepcopy(cache)
    a, b = cache.stats(), twin.stats()
    for key in ("pages_recalled", "pages_reused", "recall_steps", "bytes_moved", "read_ahead", "tokens_seen"):
        assert a[key] == b[key], key
    assert twin.scorer is not cache.scorer
    follow = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(6))
    untouched = copy.deepcopy(cache)
    greedy(model, twin, follow)     # running the copy leaves the original's scorer where it was
    assert greedy(model, cache, follow) == greedy(model, untouched, follow)
    for c in (cache, twin, untouched):
        c.close()


def test_a_first_step_interrupted_between_layers_is_caught(model):
    with TieredCache(model.config, device_budget=48, recall_pages=8, scorer="keynorm") as cache:
        def boom(*args, **kwargs):
            raise KeyboardInterrupt
        hook = model.model.layers[0].mlp.register_forward_pre_hook(boom)
        try:
            with pytest.raises(KeyboardInterrupt), torch.no_grad():
                model(PROMPT[:, :100], **cache_kwargs(cache))
        finally:
            hook.remove()
        from kvtier.errors import BrokenCacheError
        with pytest.raises(BrokenCacheError, match="disagree"), torch.no_grad():
            model(PROMPT[:, 100:120], **cache_kwargs(cache))
        cache.reset()
        assert greedy(model, cache, PROMPT[:, :50], n=2)   # reset makes it usable again


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_left_padded_prompt_at_full_budget_gives_the_tokens_and_logits_within_rounding(attention):
    """The padding of a left-padded prompt is never stored, where DynamicCache keeps it as masked columns: the
    attention sums over fewer columns, so the logits agree within float rounding (not bit for bit, as the docs
    say), and the tokens are the same."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=256, pad_token_id=0, eos_token_id=None,
                         attn_implementation=attention)
    lm = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 256, (1, 150), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([torch.zeros(1, 7, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 7, dtype=torch.long), torch.ones_like(ids)], 1)
    kw = dict(attention_mask=mask, max_new_tokens=10, return_dict_in_generate=True, output_logits=True,
              do_sample=False)
    plain = lm.generate(padded, **cache_kwargs(DynamicCache(config=config)), **kw)
    with TieredCache(config, device_budget=1.0) as cache:
        tiered = lm.generate(padded, **cache_kwargs(cache), **kw)
    assert torch.equal(plain.sequences, tiered.sequences)
    for a, b in zip(plain.logits, tiered.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@torch.no_grad()
def test_detaching_the_attention_acts_for_every_cache_of_the_model_and_says_so():
    """`detach_attention` gives the config back its attention: a second cache of the same model cannot recall
    through it, and says why; a new cache routes the attention again."""
    lm = tiny_llama(seed=4)
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    first, second = (TieredCache(lm.config, device_budget=24, recall_pages=1000, scorer="keynorm") for _ in range(2))
    token = lm(ids, **cache_kwargs(second)).logits[:, -1:].argmax(-1)
    first.detach_attention()
    seen = second.get_seq_length()
    for _ in range(2):   # refused before any layer takes the step: the model's own attention reads no demoted entry
        with pytest.raises(UnsupportedError, match=r"no longer runs through kvtier.*call detach_attention\(\) only "
                                                   "when no TieredCache of the model"):
            lm(token, **cache_kwargs(second))
    assert second.broken is None and second.get_seq_length() == seen
    third = TieredCache(lm.config, device_budget=24, recall_pages=1000, scorer="keynorm")
    lm(ids, **cache_kwargs(third))        # routed again
    for cache in (first, second, third):
        cache.close()
    from kvtier.integrations.attention import restore_attention
    restore_attention(lm.config)
