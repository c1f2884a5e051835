"""The split attention does what the model's own attention does: soft-capped logits (Gemma 2), learned sink
logits (GPT-OSS), custom scaling, and the attention weights for ``output_attentions``."""

from __future__ import annotations

import pytest
import torch

from kvtier import TieredCache, cache_kwargs
from kvtier.engine.attention import attend_split
from kvtier.engine.weights import unpack_rows, weights_by_position


def _reference(q, k, v, scale, softcap=None, sinks=None, causal_from=None):
    """Eager attention in float64 over one key set, per query head (GQA by repeating KV heads)."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    logits = q.double() @ k.transpose(-1, -2) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if causal_from is not None:   # query t sits at key causal_from + t
        L, S = logits.shape[-2:]
        allowed = torch.arange(S)[None, :] <= causal_from + torch.arange(L)[:, None]
        logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.double().reshape(1, -1, 1, 1).expand(*logits.shape[:3], 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    return (probs @ v).transpose(1, 2), probs


@pytest.mark.parametrize("softcap", [None, 0.5, 5.0])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("q_len", [1, 7])
def test_split_attention_matches_eager_with_softcap_and_sinks(softcap, with_sinks, q_len):
    g = torch.Generator().manual_seed(0)
    kv, group, dim = 2, 3, 16
    past = [torch.randn(1, kv, n, dim, generator=g) * 3 for n in (20, 9)]
    values = [torch.randn(1, kv, n, dim, generator=g) for n in (20, 9)]
    new_k, new_v = torch.randn(1, kv, q_len, dim, generator=g) * 3, torch.randn(1, kv, q_len, dim, generator=g)
    q = torch.randn(1, kv * group, q_len, dim, generator=g)
    sinks = torch.randn(kv * group, generator=g) * 2 if with_sinks else None
    out = attend_split(q, list(zip(past, values)), new_k, new_v, 0, 0.3, softcap=softcap, sinks=sinks)
    k_all = torch.cat(past + [new_k], dim=2)
    v_all = torch.cat(values + [new_v], dim=2)
    ref, _ = _reference(q, k_all, v_all, 0.3, softcap, sinks, causal_from=29)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    if softcap is not None or with_sinks:   # the variant matters at these sizes: ignoring it would be caught
        plain, _ = _reference(q, k_all, v_all, 0.3, None, None, causal_from=29)
        assert (out.double() - plain).abs().max() > 1e-3


def test_weights_by_position_equal_the_softmax_over_the_sequence():
    g = torch.Generator().manual_seed(1)
    kv, group, dim, L = 2, 2, 8, 3
    k = torch.randn(1, kv, 12, dim, generator=g)
    q = torch.randn(1, kv * group, L, dim, generator=g)
    _, probs = _reference(q, k, torch.zeros_like(k), 0.5, softcap=2.0, causal_from=9)
    # the same keys as two sets whose positions are shuffled per head, as the tiers hold them
    perm = torch.stack([torch.randperm(12, generator=g) for _ in range(kv)])
    keys = torch.gather(k[0], 1, perm[..., None].expand(-1, -1, dim))
    packed = q.reshape(1, kv, group * L, dim)
    logits = torch.tanh(packed[0] @ k[0].transpose(-1, -2) * 0.5 / 2.0) * 2.0
    rows = torch.arange(9, 12).repeat(group)
    logits = logits.masked_fill(torch.arange(12)[None, None, :] > rows[None, :, None], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)[None]
    w = weights_by_position(packed, [(keys[:, :5], perm[:, :5]), (keys[:, 5:], perm[:, 5:])], lse,
                            torch.arange(9, 12), 12, 0.5, softcap=2.0)
    torch.testing.assert_close(unpack_rows(w, kv * group).double(), probs, atol=1e-6, rtol=1e-5)


def _tiny(config_cls, **kw):
    torch.manual_seed(0)
    cfg = config_cls(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, vocab_size=256, num_hidden_layers=4, sliding_window=64,
                     layer_types=["sliding_attention", "full_attention"] * 2, **kw)
    cfg._attn_implementation = "eager"
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(cfg).eval()


def _generate(model, cache, ids):
    return model.generate(ids, max_new_tokens=10, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, **cache_kwargs(cache))


@pytest.mark.parametrize("gpu_path", [False, True], ids=["cpu-path", "gpu-path"])
@pytest.mark.parametrize("variant", ["softcap", "sinks"])
def test_models_whose_attention_differs_decode_the_same_with_recall(variant, gpu_path, monkeypatch):
    """With every page recalled, a soft-capped model (Gemma 2) and one with attention sinks (GPT-OSS) decode as
    with DynamicCache; on the GPU's path too (forced here: the kernels' twins), whose decode steps attend through
    `attend_slabs` and `attend_pages`, soft-cap included, as launches only (what a CUDA graph replays)."""
    from transformers import DynamicCache, Gemma2Config, GptOssConfig

    from kvtier import native
    from kvtier.engine.layer import LayerEngine

    if variant == "softcap":   # a cap small enough to change every logit
        model = _tiny(Gemma2Config, attn_logit_softcapping=1.0, final_logit_softcapping=None)
    else:
        model = _tiny(GptOssConfig, num_local_experts=4, num_experts_per_tok=2)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-2.0, 3.0, layer.self_attn.sinks.numel()))
    # no pad token (id 0) in the prompt: generate would take it for padding, which kvtier takes only on the left
    ids = torch.randint(1, 256, (1, 200), generator=torch.Generator().manual_seed(2))
    ref = _generate(model, DynamicCache(config=model.config), ids)
    launched = []
    launches = LayerEngine._decode_launches
    monkeypatch.setattr(LayerEngine, "_decode_launches",
                        lambda self, run, *a: launched.append(run[1]) or launches(self, run, *a))
    native.reset_stats()
    with TieredCache(model.config, device_budget=40, recall_pages=64) as cache:
        if gpu_path:
            cache.take_gpu_path()
        out = _generate(model, cache, ids)
        assert cache.stats()["pages_recalled"] > 0
    if gpu_path:   # every decode step of every tiered layer as launches only, the cap handed to the kernels
        assert len(launched) == 9 * len(cache._engines) and {"attend_slabs", "attend_pages"} <= \
            set(native.backend()["ops"])
        assert set(launched) == ({model.config.attn_logit_softcapping} if variant == "softcap" else {None})
    else:
        assert not launched
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(ref.logits, out.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_the_models_own_attention_sees_its_own_name_in_the_config(monkeypatch):
    """Where kvtier hands a step to the model's own flash attention (nothing demoted yet), that function finds
    its own name in ``module.config._attn_implementation``, not kvtier's: transformers' flash attention loads its
    kernels by that name and knows no ``kvtier_`` one. Nothing shared changes meanwhile: the model's config
    still names kvtier's implementation, for other layers and threads. (A stand-in registered as
    ``flash_attention_2`` records what it sees and attends as sdpa.)"""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tiny_models import tiny_llama

    model = tiny_llama()
    seen = []

    def flash_stand_in(module, *args, **kwargs):
        seen.append((module.config._attn_implementation, model.config._attn_implementation))
        return sdpa_attention_forward(module, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "flash_attention_2", flash_stand_in)
    model.config._attn_implementation = "flash_attention_2"
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        assert seen == [("flash_attention_2", "flash_attention_2")] * 2
        seen.clear()
        with TieredCache(model.config) as cache:
            got = model(ids, **cache_kwargs(cache)).logits
    assert seen == [("flash_attention_2", "kvtier_flash_attention_2")] * 2 and torch.equal(got, want)


@pytest.mark.parametrize("where", ["first step", "later step", "stored entry"])
def test_a_padding_refusal_on_a_model_whose_first_layer_slides_leaves_the_cache_as_it_was(where):
    """Gemma 2's first layer is a sliding window, which takes a step before the first tiered layer can refuse its
    padding: the window's update is undone with the tiered layer's write, so the cache is not broken and goes on
    as a twin never asked (it had been left broken). A mask that hides an entry the device holds, written at an
    earlier step, is refused the same way (it had been laid over whichever entry stood in its column, or left
    out where the layer recalled)."""
    from transformers import Gemma2Config

    from kvtier import UnsupportedError

    model = _tiny(Gemma2Config, attn_logit_softcapping=1.0, final_logit_softcapping=None)
    a, b = (TieredCache(model.config, device_budget=0.5) for _ in range(2))
    ids = torch.randint(1, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        if where != "first step":
            for c in (a, b):
                model(ids[:, :30], **cache_kwargs(c))
        padded, mask = ids.clone(), torch.ones_like(ids)
        mask[0, 25 if where == "stored entry" else 34] = 0
        start = 0 if where == "first step" else 30
        words = "hides 1 of the 14 stored entries" if where == "stored entry" else "left padding"
        with pytest.raises(UnsupportedError, match=words):
            model(padded[:, start:], attention_mask=mask, **cache_kwargs(a))
        assert a.broken is None and a.get_seq_length() == b.get_seq_length() == start
        assert [w.cumulative_length for w in a._state.windows] == [start, start]
        assert torch.equal(model(ids[:, start:], **cache_kwargs(a)).logits,
                           model(ids[:, start:], **cache_kwargs(b)).logits)
        for _ in range(3):   # decode steps after it, the windows' entries included
            nxt = torch.randint(1, 256, (1, 1), generator=torch.Generator().manual_seed(_))
            assert torch.equal(model(nxt, **cache_kwargs(a)).logits, model(nxt, **cache_kwargs(b)).logits)
    a.close()
    b.close()


def test_a_model_that_changes_the_values_after_update_is_refused_where_it_would_recall():
    """DiffLlama attends over halves of the values the cache returned, twice: where a layer recalls, the split
    attention (which reads the values the cache keeps) cannot give its answer, so the step is refused before any
    layer takes it (it had answered over other values, then over the device's entries alone). Where nothing is
    recalled the model's own attention runs: the answer is DynamicCache's."""
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM, DynamicCache

    from kvtier import UnsupportedError

    torch.manual_seed(0)
    model = DiffLlamaForCausalLM(DiffLlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                                 num_key_value_heads=2, intermediate_size=128, vocab_size=128,
                                                 attn_implementation="sdpa")).eval()
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(2))
    nxt = torch.tensor([[5]])
    with torch.no_grad():
        full, plain = TieredCache(model.config, device_budget=1.0), DynamicCache(config=model.config)
        assert torch.equal(model(ids, **cache_kwargs(full)).logits, model(ids, **cache_kwargs(plain)).logits)
        assert torch.equal(model(nxt, **cache_kwargs(full)).logits, model(nxt, **cache_kwargs(plain)).logits)
        cache = TieredCache(model.config, scorer="keynorm", device_budget=40, recall_pages=64)
        model(ids, **cache_kwargs(cache))
        with pytest.raises(UnsupportedError, match="values other than those the cache returned"):
            model(nxt, **cache_kwargs(cache))
        assert cache.broken is None and cache.get_seq_length() == 200


def test_layers_that_reuse_another_layer_s_keys_and_values_are_refused():
    """Gemma 3n's last layers attend with an earlier layer's cached keys and values, which kvtier hands that
    layer's own attention only: they had answered over the device's entries, with no error."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma3nTextConfig"):
        pytest.skip("this transformers has no Gemma 3n")
    from kvtier import UnsupportedError
    from kvtier.integrations.support import support

    def config(shared):
        return transformers.Gemma3nTextConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=256, vocab_size_per_layer_input=256, hidden_size_per_layer_input=8,
            sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2, laurel_rank=4,
            altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4, num_kv_shared_layers=shared)

    with pytest.raises(UnsupportedError, match="num_kv_shared_layers=2: its last 2 layers attend with the keys"):
        TieredCache(config(2))
    assert not support(config(2))["supported"]
    TieredCache(config(0)).close()


def test_attention_set_layer_by_layer_is_refused_by_name():
    """Gemma 4's layers differ in head size: transformers' own error had come out of TieredCache and `support`."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma4TextConfig"):
        pytest.skip("this transformers has no Gemma 4")
    from kvtier import UnsupportedError
    from kvtier.integrations.support import support

    cfg = transformers.Gemma4TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        global_head_dim=32, vocab_size=256)
    with pytest.raises(UnsupportedError, match="sets head_dim layer by layer"):
        TieredCache(cfg)
    assert "layer by layer" in support(cfg)["reason"]


def test_a_reset_cache_is_not_initialized():
    """As transformers' layers after a reset (PaliGemma reads it to tell its first step); it had stayed set."""
    from tiny_models import tiny_llama

    model = tiny_llama()
    with TieredCache(model.config, device_budget=0.5) as cache:
        model(torch.randint(0, 128, (1, 20)), **cache_kwargs(cache))
        assert cache.is_initialized and cache.layers[0].keys is not None
        cache.reset()
        assert not cache.is_initialized and cache.layers[0].keys is None


@pytest.mark.parametrize("name", ["h2o", "tova", "snapkv"])
def test_attention_based_scorers_rank_by_the_capped_logits_of_a_soft_capped_model(name):
    """Gemma 2 caps its logits before the softmax: H2O, TOVA and SnapKV score an entry by the attention it
    receives, so they get the cap the model's attention got and rank by the attention it computed (they had
    ranked by uncapped logits, another order). A scorer whose ``score`` has no such keyword is called as before."""
    from transformers import Gemma2Config

    from kvtier.scoring import make_scorer
    from kvtier.scoring.attention_stats import received_attention

    model = _tiny(Gemma2Config, attn_logit_softcapping=1.0, final_logit_softcapping=None)
    seen = []

    class Spy:
        needs_query = True

        def __init__(self, inner, takes):
            self.inner, self.name, self.takes = inner, inner.name, takes

        def score(self, keys, values, positions, layer_idx, **kw):
            seen.append((self.takes, kw.get("softcap")))
            if not self.takes:
                assert "softcap" not in kw
            return self.inner.score(keys, values, positions, layer_idx, **kw)

    class Plain(Spy):   # a user's scorer with the contract's keywords only
        def score(self, keys, values, positions, layer_idx, *, query, context_keys, scaling):
            return super().score(keys, values, positions, layer_idx, query=query, context_keys=context_keys,
                                 scaling=scaling)

    ids = torch.randint(1, 256, (1, 24), generator=torch.Generator().manual_seed(5))
    for scorer in (Spy(make_scorer(name), True), Plain(make_scorer(name), False)):
        with TieredCache(model.config, device_budget=1.0, scorer=scorer) as cache, torch.no_grad():
            model(ids, **cache_kwargs(cache))
    assert {s for t, s in seen if t} == {1.0} and {s for t, s in seen if not t} == {None}

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 12, 8, generator=g) * 4, torch.randn(1, 2, 12, 8, generator=g) * 4
    scorer = make_scorer(name)
    capped = scorer.score(k, k, torch.arange(12), 0, query=q, context_keys=k, scaling=0.35, softcap=1.0)
    plain = scorer.score(k, k, torch.arange(12), 0, query=q, context_keys=k, scaling=0.35)
    assert not torch.allclose(capped, plain)
    if name == "tova":   # the last query's capped softmax, averaged over each KV head's query heads
        want = received_attention(q, k, 12, 0.35, slice(-1, None), softcap=1.0)[:, :, 0].mean(dim=1)
        logits = (q[0, :, -1:] @ k[0].repeat_interleave(2, dim=0).transpose(-1, -2)) * 0.35
        direct = torch.softmax(torch.tanh(logits) * 1.0, dim=-1)[:, 0].view(2, 2, 12).mean(dim=1)
        torch.testing.assert_close(capped[0], want)
        torch.testing.assert_close(capped[0], direct)
