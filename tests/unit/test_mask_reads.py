"""kvtier's own checks of an attention mask read its values once per mask, not once per layer: transformers
hands every layer of a step the same tensor, and each read is a host sync on a GPU (an eager model's mask is a
4D float tensor at every step)."""

from __future__ import annotations

import gc

import pytest
import torch

from kvtier import TieredCache, cache_kwargs
from kvtier.errors import UnsupportedError
from kvtier.integrations import attention, tiered_layer
from kvtier.integrations.mask_reads import MaskVerdicts

from tiny_models import tiny_llama


def test_a_mask_is_read_once_and_a_new_mask_again():
    verdicts, reads = MaskVerdicts(keep=2), []

    def read(m):
        reads.append(m)
        return bool(m.any())

    a, b, c = torch.zeros(3), torch.ones(3), torch.zeros(3)
    assert [verdicts.verdict(a, read) for _ in range(5)] == [False] * 5 and len(reads) == 1
    assert verdicts.verdict(b, read) and verdicts.verdict(a, read) is False and len(reads) == 2
    verdicts.verdict(c, read)   # a third mask: the oldest (a) is no longer kept
    verdicts.verdict(a, read)
    assert len(reads) == 4


def test_a_freed_masks_verdict_is_never_given_to_a_new_tensor():
    verdicts, reads = MaskVerdicts(), []
    for value in (0.0, 1.0, 0.0, 1.0):
        mask = torch.full((4,), value)   # may reuse the freed tensor's id
        assert verdicts.verdict(mask, lambda m: (reads.append(1), bool(m.any()))[1]) == bool(value)
        del mask
        gc.collect()
    assert len(reads) == 4


def test_a_mask_with_biases_is_refused_on_every_layer_while_checked_once():
    biased = torch.zeros(1, 1, 2, 4)
    biased[..., 1] = -3.0   # an ALiBi-like bias
    for _ in range(3):
        with pytest.raises(UnsupportedError, match="position biases"):
            tiered_layer.check_plain_mask(biased)
    tiered_layer.check_plain_mask(torch.zeros(1, 1, 2, 4))


@torch.no_grad()
def test_an_eager_models_decode_step_reads_its_mask_once_per_check_not_per_layer(monkeypatch):
    model = tiny_llama()
    model.config._attn_implementation = "eager"   # a 4D float mask at every step, for each of the 2 layers
    reads = []
    real = MaskVerdicts.verdict

    def counted(self, mask, read):
        return real(self, mask, lambda m: (reads.append(self), read(m))[1])

    monkeypatch.setattr(MaskVerdicts, "verdict", counted)
    with TieredCache(model.config, device_budget=48, recall_pages=2, page_size=8) as cache:
        ids = torch.randint(0, 128, (1, 160), generator=torch.Generator().manual_seed(1))
        logits = model(ids, **cache_kwargs(cache)).logits[:, -1:]
        for _ in range(3):
            reads.clear()
            logits = model(logits.argmax(-1), **cache_kwargs(cache)).logits[:, -1:]
            assert cache.stats()["pages_recalled"] > 0
            # one read for each check (biases, padding), where each layer read both before
            assert sorted(map(id, reads)) == sorted([id(tiered_layer._BIASED), id(attention._ALL_SEEN)]), reads


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_mask_that_is_not_causal_is_refused_at_a_step_that_recalls(kind):
    """A 4D mask letting a chunk's tokens see each other both ways (a user's mask, Gemma 3's bidirectional
    attention) was applied as causal once pages were recalled: other logits than DynamicCache's, no word. Refused
    before any layer takes the step; a causal 4D mask gives DynamicCache's logits."""
    from transformers import DynamicCache

    model = tiny_llama()
    g = torch.Generator().manual_seed(1)
    prompt, chunk = torch.randint(3, 128, (1, 200), generator=g), torch.randint(3, 128, (1, 8), generator=g)
    q, pos = chunk.shape[1], torch.arange(200, 208)[None]

    def mask(cache, both_ways):
        kv_len, _ = cache.get_mask_sizes(q, 0)
        allowed = torch.ones(1, 1, q, kv_len, dtype=torch.bool)
        if not both_ways:
            allowed[..., kv_len - q:] = torch.ones(q, q, dtype=torch.bool).tril()
        return allowed if kind == "bool" else torch.where(allowed, 0.0, torch.finfo(torch.float32).min)

    with torch.no_grad(), TieredCache(model.config, device_budget=48, scorer="keynorm", recall_pages=1000) as cache:
        full = DynamicCache(config=model.config)
        for c in (cache, full):
            model(prompt, **cache_kwargs(c))
        with pytest.raises(UnsupportedError, match="the attention mask is not causal"):
            model(chunk, attention_mask=mask(cache, True), position_ids=pos, **cache_kwargs(cache))
        assert cache.broken is None and cache.get_seq_length() == 200
        want = model(chunk, attention_mask=mask(full, False), position_ids=pos, **cache_kwargs(full)).logits
        for sized_for in (cache, full):   # kvtier's mask sizes, or one made for every token seen (DynamicCache's)
            with TieredCache(model.config, device_budget=48, scorer="keynorm", recall_pages=1000) as other:
                model(prompt, **cache_kwargs(other))
                got = model(chunk, attention_mask=mask(sized_for if sized_for is full else other, False),
                            position_ids=pos, **cache_kwargs(other)).logits
                assert other.stats()["recall_steps"] and torch.allclose(got, want, atol=1e-5)
