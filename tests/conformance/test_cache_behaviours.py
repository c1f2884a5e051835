"""How a TieredCache behaves as a transformers cache, next to DynamicCache, on representative architectures:
a plain Llama, Gemma 3 (sliding + full layers), Gemma 2 (attention soft-capping) and GPT-OSS (attention sinks).

Unless a test says otherwise the tiered cache demotes and recalls (`SMALL`: 40 tokens per head on the
device, every page recallable), the model runs in float32 with eager attention, and greedy tokens must
equal DynamicCache's with logits within the float32 tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch

import archs
from checks import (FULL, SMALL, TOLERANCE, assert_identical, assert_same_greedy, dynamic, forward, generate,
                    tiered)
from kvtier import UnsupportedError

ARCHS = ["llama", "gemma3", "gemma2", "gpt-oss"]
NEW = 8
F32 = torch.float32


@pytest.fixture(params=ARCHS)
def name(request):
    return request.param


@pytest.fixture
def model(name):
    return archs.model(name)


def _has_sinks(model) -> bool:
    return hasattr(model.model.layers[0].self_attn, "sinks")


def _tiered_layers(model) -> list[int]:
    return [i for i, kind in enumerate(archs.layer_kinds(model.config)) if kind == "full_attention"]


def _returned_cache(out):
    """The cache `generate` hands back (``cache`` from transformers 5.24, ``past_key_values`` before)."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def test_continuing_from_the_returned_cache(model):
    ids = archs.prompt()
    ref1 = generate(model, dynamic(model), ids, NEW)
    ref2 = generate(model, _returned_cache(ref1), ref1.sequences, NEW)
    with tiered(model, **SMALL) as cache:
        got1 = generate(model, cache, ids, NEW)
        returned = _returned_cache(got1)
        assert returned is cache, f"generate handed back a {type(returned).__name__}, not the TieredCache"
        got2 = generate(model, returned, got1.sequences, NEW)
        assert cache.get_seq_length() == _returned_cache(ref2).get_seq_length() == archs.PROMPT + 2 * NEW - 1
    assert_same_greedy(got1, ref1, F32)
    assert_same_greedy(got2, ref2, F32)


def test_three_turns_on_one_cache(model):
    ref_cache, seq = dynamic(model), archs.prompt()
    refs = []
    for turn in range(3):
        ref = generate(model, ref_cache, seq, NEW)
        refs.append(ref)
        seq = torch.cat([ref.sequences, archs.prompt(24, seed=10 + turn)], dim=1)   # the user's next message
    with tiered(model, **SMALL) as cache:
        seq = archs.prompt()
        for turn, ref in enumerate(refs):
            got = generate(model, cache, seq, NEW)
            assert_same_greedy(got, ref, F32)
            seq = torch.cat([got.sequences, archs.prompt(24, seed=10 + turn)], dim=1)
        assert cache.get_seq_length() == ref_cache.get_seq_length()
        assert cache.stats()["bytes_moved"]["device_to_host"] > 0


def test_inputs_embeds(model):
    embeds = model.get_input_embeddings()(archs.prompt()).detach()
    ref = generate(model, dynamic(model), None, NEW, inputs_embeds=embeds)
    with tiered(model, **SMALL) as cache:
        got = generate(model, cache, None, NEW, inputs_embeds=embeds)
        assert cache.stats()["tokens_seen"] == archs.PROMPT + NEW - 1
    assert got.sequences.shape == ref.sequences.shape == (1, NEW)   # new tokens only, as with any cache
    assert_same_greedy(got, ref, F32)


def test_logits_to_keep(model):
    ids = archs.prompt()
    ref_cache = dynamic(model)
    ref_prefill = forward(model, ref_cache, ids, logits_to_keep=3).logits
    step = ref_prefill[:, -1:].argmax(-1)
    ref_step = forward(model, ref_cache, step, logits_to_keep=1).logits
    with tiered(model, **SMALL) as cache:
        prefill = forward(model, cache, ids, logits_to_keep=3).logits
        assert prefill.shape == ref_prefill.shape == (1, 3, archs.VOCAB)
        torch.testing.assert_close(prefill, ref_prefill, **TOLERANCE[F32])
        got_step = forward(model, cache, step, logits_to_keep=1).logits
        assert got_step.shape == (1, 1, archs.VOCAB)
        torch.testing.assert_close(got_step, ref_step, **TOLERANCE[F32])


def test_reset_then_a_different_prompt(model):
    other = archs.prompt(260, seed=2)
    ref = generate(model, dynamic(model), other, NEW)
    with tiered(model, **SMALL) as cache:
        generate(model, cache, archs.prompt(), NEW)
        cache.reset()
        assert cache.get_seq_length() == 0
        got = generate(model, cache, other, NEW)
        assert cache.get_seq_length() == 260 + NEW - 1
    assert_same_greedy(got, ref, F32)


def test_sampling_with_a_fixed_seed(model):
    ids = archs.prompt()
    torch.manual_seed(1234)
    ref = generate(model, dynamic(model), ids, NEW, do_sample=True)
    with tiered(model, **SMALL) as cache:
        torch.manual_seed(1234)
        got = generate(model, cache, ids, NEW, do_sample=True)
    assert torch.equal(got.sequences, ref.sequences), (got.sequences[0, -NEW:], ref.sequences[0, -NEW:])


def test_bfloat16(name):
    bf16 = archs.model(name, "bfloat16", "eager")
    ref = generate(bf16, dynamic(bf16), archs.prompt(), NEW)
    with tiered(bf16, **SMALL) as cache:
        got = generate(bf16, cache, archs.prompt(), NEW)
        assert cache.stats()["bytes_moved"]["device_to_host"] > 0
    assert got.logits[0].dtype == ref.logits[0].dtype
    assert_same_greedy(got, ref, torch.bfloat16)


def test_left_padding_with_an_attention_mask(model):
    pad = 7
    ids = torch.cat([torch.full((1, pad), model.config.pad_token_id), archs.prompt()], dim=1)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones(1, archs.PROMPT, dtype=torch.long)], dim=1)
    ref = generate(model, dynamic(model), ids, NEW, attention_mask=mask)
    with tiered(model, **SMALL) as cache:
        got = generate(model, cache, ids, NEW, attention_mask=mask)
    assert_same_greedy(got, ref, F32)


def _check_attentions(model, got, ref, exact: bool) -> None:
    assert got is not None and len(got) == len(ref) == model.config.num_hidden_layers
    for layer, (g, r) in enumerate(zip(got, ref)):
        assert g is not None, f"layer {layer} returned no attention weights"
        assert g.shape == r.shape, (layer, g.shape, r.shape)
        sums = g.float().sum(-1)
        if _has_sinks(model):   # the sink takes its share and is dropped: rows sum to less than 1
            assert (sums > 0).all() and (sums <= 1 + 1e-5).all(), layer
        else:
            torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-4, rtol=0)
        if exact:
            assert torch.equal(g, r), f"layer {layer}: max difference {(g - r).abs().max():.3g}"
        else:
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4, msg=lambda m, layer=layer: f"layer {layer}: {m}")


@pytest.mark.parametrize("settings", [FULL, SMALL], ids=["full-budget", "small-budget"])
def test_output_attentions_with_eager(model, settings):
    ids = archs.prompt()
    ref_cache = dynamic(model)
    ref_prefill = forward(model, ref_cache, ids, output_attentions=True)
    step = ref_prefill.logits[:, -1:].argmax(-1)
    ref_step = forward(model, ref_cache, step, output_attentions=True)
    with tiered(model, **settings) as cache:
        prefill = forward(model, cache, ids, output_attentions=True)
        got_step = forward(model, cache, step, output_attentions=True)
    exact = settings is FULL
    _check_attentions(model, prefill.attentions, ref_prefill.attentions, exact)
    _check_attentions(model, got_step.attentions, ref_step.attentions, exact)
    assert got_step.attentions[0].shape[:3] == (1, model.config.num_attention_heads, 1)


def test_deepcopy_after_a_prefill(model):
    ids = archs.prompt()
    head = ids[:, :-1]
    ref_cache = dynamic(model)
    forward(model, ref_cache, head)
    ref = generate(model, ref_cache, ids, NEW)
    ref_later = generate(model, ref_cache, ref.sequences, 4)
    with tiered(model, **SMALL) as original:
        forward(model, original, head)
        twin, spare = copy.deepcopy(original), copy.deepcopy(original)
        try:
            from_twin = generate(model, twin, ids, NEW)
            assert original.get_seq_length() == head.shape[1], "generating from the copy moved the original"
            from_original = generate(model, original, ids, NEW)
            assert_identical(from_twin, from_original)
            assert_same_greedy(from_original, ref, F32)
            twin.close()
            later = generate(model, original, from_original.sequences, 4)   # still usable with its twin closed
            assert_same_greedy(later, ref_later, F32)
            original.close()
            from_spare = generate(model, spare, ids, NEW)                   # and the other way round
            assert_identical(from_spare, from_original)
        finally:
            twin.close()
            spare.close()


@pytest.mark.parametrize("settings", [FULL, SMALL], ids=["full-budget", "small-budget"])
def test_layer_keys_and_values_are_tensors(model, settings):
    ids = archs.prompt()
    ref_cache = dynamic(model)
    forward(model, ref_cache, ids)
    forward(model, ref_cache, ids[:, -1:])
    kv_heads = model.config.num_key_value_heads
    with tiered(model, **settings) as cache:
        forward(model, cache, ids)
        forward(model, cache, ids[:, -1:])
        assert _tiered_layers(model)
        for i in _tiered_layers(model):
            layer = cache.layers[i]
            for got, ref in ((layer.keys, ref_cache.layers[i].keys), (layer.values, ref_cache.layers[i].values)):
                assert isinstance(got, torch.Tensor), f"layer {i}: {type(got).__name__}"
                assert got.dim() == 4 and got.shape[:2] == (1, kv_heads) and got.shape[3] == ref.shape[3], got.shape
                assert 0 < got.shape[2] <= archs.PROMPT + 1 and got.dtype == ref.dtype
                if settings is FULL:   # everything is on the device: the same entries as DynamicCache's
                    assert torch.equal(got, ref), f"layer {i}"


def test_beam_search_is_refused(model):
    with tiered(model, **SMALL) as cache:
        with pytest.raises(UnsupportedError, match="beam search"):
            generate(model, cache, archs.prompt(), 4, num_beams=2)


@pytest.mark.parametrize("how", ["prompt-lookup", "assistant-model"])
def test_assisted_decoding_is_refused(model, how):
    kwargs = {"prompt_lookup_num_tokens": 3} if how == "prompt-lookup" else {"assistant_model": model}
    with tiered(model, **SMALL) as cache:
        with pytest.raises(UnsupportedError, match="assisted"):
            generate(model, cache, archs.prompt(), 4, **kwargs)


def test_crop_is_refused(model):
    with tiered(model, **SMALL) as cache:
        forward(model, cache, archs.prompt())
        with pytest.raises(UnsupportedError, match="crop"):
            cache.crop(archs.PROMPT - 5)
