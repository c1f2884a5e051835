"""The always-kept set: sinks and a recent window that is a token count or a share of the device budget."""

from __future__ import annotations

import math
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch

from kvtier import ConfigError, TieredCache
from kvtier.config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS, check_recent_tokens
from kvtier.eval.policies import Policy
from kvtier.placement import Budget
from kvtier.placement.planner import plan_device_demotion, protected_count, recent_window
from kvtier.training.dataset import REFERENCE_BUDGET, rankable
from kvtier.training.evaluate import kept_mass

CONFIG = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               hidden_size=32, _attn_implementation="sdpa")


def test_defaults_are_valid_settings():
    assert check_recent_tokens(DEFAULT_RECENT_TOKENS) == DEFAULT_RECENT_TOKENS
    assert isinstance(DEFAULT_SINK_TOKENS, int) and DEFAULT_SINK_TOKENS >= 0


@pytest.mark.parametrize("recent, budget, window", [
    (16, 205, 16), (0, 205, 0), (16, 3, 16), (0.25, 205, 52), (0.5, 103, 52), (0.25, 0, 0), (0.5, 1, 1),
])
def test_recent_window_resolution(recent, budget, window):
    assert recent_window(recent, budget) == window


def test_protected_count_with_a_share_needs_the_budget():
    assert protected_count(100, 4, 16) == 20
    assert protected_count(10, 4, 16) == 10
    assert protected_count(2048, 4, 0.25, budget_tokens=205) == 4 + 52
    with pytest.raises(ValueError, match="budget_tokens"):
        protected_count(2048, 4, 0.25)


@pytest.mark.parametrize("value", [1.0, 1.5, 0.0, -0.1, -1, float("nan"), 16.0, "16", None, True])
def test_bad_recent_tokens_name_the_value_and_what_is_allowed(value):
    with pytest.raises(ConfigError, match="recent_tokens") as err:
        TieredCache(CONFIG, recent_tokens=value)
    assert "allowed" in str(err.value) and "share of the device budget" in str(err.value)


def test_every_existing_keyword_still_works():
    with TieredCache(CONFIG, device_budget=0.1, sink_tokens=2, recent_tokens=8) as cache:
        assert cache.settings.recent_tokens == 8 and isinstance(cache.settings.recent_tokens, int)
        assert cache.settings.device_tokens(1000) == 100
        assert cache.settings.recent_window(1000) == 8
    with TieredCache(CONFIG, device_budget=0.1) as cache:
        assert cache.settings.recent_tokens == DEFAULT_RECENT_TOKENS
        assert cache.settings.sink_tokens == DEFAULT_SINK_TOKENS


def test_a_share_of_the_budget_grows_with_it():
    with TieredCache(CONFIG, device_budget=0.1, mode="evict", recent_tokens=0.25) as cache:
        s = cache.settings
        assert s.device_tokens(2048) == 205 and s.recent_window(2048) == 52
        assert s.device_tokens(4096) == 410 and s.recent_window(4096) == 103
        # floor: the sinks and the window of the budget itself (a budget of 5 had been its own window short of 4 + 2)
        assert s.device_tokens(10) == 6 and s.recent_window(10) == 2


@pytest.mark.parametrize("seen, budget, sinks, recent", [(18, 0.6, 3, 0.9), (200, 0.5, 20, 0.99), (1000, 0.01, 4, 0.5)])
def test_a_raised_budget_holds_the_window_of_the_budget_raised(seen, budget, sinks, recent):
    """A fractional budget too small for the sinks and a fractional window is raised to the least budget that
    holds the sinks and the window worked out from that budget, as the planner works it out: raised only to the
    window of the budget asked for, the device held more than the budget it reported (15 tokens against 13)."""
    with TieredCache(CONFIG, device_budget=budget, mode="evict", sink_tokens=sinks, recent_tokens=recent,
                     page_size=1) as cache:
        s = cache.settings
        b = s.device_tokens(seen)
        assert b >= min(seen, protected_count(seen, sinks, recent, b))
        assert b == budget_tokens(seen, budget) or b - 1 < min(seen, protected_count(seen, sinks, recent, b - 1))


def budget_tokens(seen, fraction):
    return Budget(fraction).tokens(seen)


def test_a_token_budget_must_leave_room_for_a_fractional_window():
    with pytest.raises(ConfigError, match=r"device_budget=5 tokens .* 4 sink .* 3-token recent window \(0.5 of "
                                          r"the budget\); allowed: a token count >= 8"):
        TieredCache(CONFIG, device_budget=5, recent_tokens=0.5)
    TieredCache(CONFIG, device_budget=8, recent_tokens=0.5).close()
    with pytest.raises(ConfigError, match="16-token recent window"):   # the old message, for a fixed window
        TieredCache(CONFIG, device_budget=10, recent_tokens=16)


def _plan(recent, budget, n=64, page=4, sinks=2):
    scores = torch.arange(n, 0, -1, dtype=torch.float32)[None].repeat(2, 1)   # older = higher: recent ones go first
    positions = torch.arange(n)[None].repeat(2, 1)
    return plan_device_demotion(scores, positions, n, budget, sinks, recent, page)


def test_the_planner_protects_a_share_of_the_budget():
    budget = 32
    idx = _plan(0.5, budget)                       # window: the 16 latest of 64
    assert idx is not None
    moved = set(idx[0].tolist())
    assert len(moved) == 32
    assert not moved & set(range(48, 64)) and not moved & {0, 1}
    # a fixed window of 4 lets the same scorer demote the latest tokens instead
    fixed = set(_plan(4, budget)[0].tolist())
    assert fixed & set(range(48, 60)) and not fixed & set(range(60, 64))


def test_the_planner_reads_a_fixed_window_as_before():
    assert torch.equal(_plan(4, 32), _plan(4, 32))
    assert _plan(16, 64) is None


def test_evict_mode_keeps_the_latest_share_of_the_budget(make_engine):
    engine = make_engine(heads=2, head_dim=8, device_budget=0.25, mode="evict", page_size=4, sink_tokens=2,
                         recent_tokens=0.5, scorer="keynorm")
    g = torch.Generator().manual_seed(0)
    for _ in range(16):   # 16 writes of 16 tokens
        k = torch.randn(1, 2, 16, 8, generator=g)
        engine.write(k, torch.randn(1, 2, 16, 8, generator=g))
        engine.commit()
    seen = 256
    window = engine.cfg.recent_window(seen)
    assert window == math.ceil(0.5 * engine.cfg.device_tokens(seen)) == 32
    pos, _ = engine.pool.meta()
    for h in range(2):
        kept = set(pos[h].tolist())
        assert set(range(seen - window, seen)) <= kept and {0, 1} <= kept
        assert len(kept) <= engine.cfg.device_tokens(seen) + 4


def test_grading_and_training_use_the_same_window():
    n = 1000
    imp = torch.zeros(1, n)
    imp[0, -40:] = 1.0                        # all the mass in the 40 latest tokens
    low = -torch.arange(n, dtype=torch.float32)[None]      # a scorer that prefers old tokens
    assert float(kept_mass(low, imp, 0.1, 4, 16)) == pytest.approx(16 / 40)
    assert float(kept_mass(low, imp, 0.1, 4, 0.5)) == pytest.approx(1.0)    # window: 50 of a 100-token budget
    assert rankable(n, 4, 16).tolist() == list(range(4, n - 16))
    window = math.ceil(0.5 * math.ceil(REFERENCE_BUDGET * n))
    assert rankable(n, 4, 0.5).tolist() == list(range(4, n - window))


@pytest.mark.parametrize("text, recent", [("evict:kvp", None), ("evict:kvp@64", 64), ("tier:kvp@0.25", 0.25)])
def test_policies_carry_a_recent_window(text, recent):
    policy = Policy.parse(text)
    assert policy.recent == recent and policy.name == text
    settings = policy.cache_settings(0.1)
    assert settings.get("recent_tokens") == recent


@pytest.mark.parametrize("text", ["evict:kvp@", "evict:kvp@x", "evict:kvp@1.5", "evict:kvp@-3", "full@3"])
def test_bad_policy_windows_are_refused(text):
    with pytest.raises(ConfigError, match="allowed"):
        Policy.parse(text)


def test_outcome_tied_targets_follow_their_definitions():
    """``importance_next`` / ``importance_decay`` (recorded in traces) and ``importance_value`` (computed)."""
    from kvtier.training.dataset import importance_target
    from kvtier.training.traces import DECAY_STEPS, NEXT_STEPS, baseline_scorers, layer_statistics

    g = torch.Generator().manual_seed(0)
    prompt, cont = 40, 24
    query = torch.randn(1, 4, prompt + cont, 8, generator=g)
    key, value = torch.randn(1, 2, prompt + cont, 8, generator=g), torch.randn(1, 2, prompt + cont, 8, generator=g)
    stats = layer_statistics(query, key, value, 0.35, prompt, baseline_scorers(), targets=True)
    q = query[0].double().reshape(2, 2, prompt + cont, 8)
    logits = torch.einsum("hgqd,hkd->hgqk", q, key[0].double()) * 0.35
    att = torch.softmax(logits.masked_fill(torch.ones(prompt + cont, prompt + cont, dtype=torch.bool).triu(1),
                                           float("-inf")), dim=-1)[:, :, prompt:, :prompt].amax(dim=1)
    weights = torch.exp(-torch.arange(cont, dtype=torch.float64) / DECAY_STEPS)
    torch.testing.assert_close(stats["importance"].double(), att.sum(1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats["importance_next"].double(), att[:, :NEXT_STEPS].sum(1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats["importance_decay"].double(), (att * weights[None, :, None]).sum(1),
                               rtol=1e-4, atol=1e-5)
    raw = {"importance": stats["importance"][None], "values": value[:, :, :prompt].half()}
    torch.testing.assert_close(importance_target(raw, "importance_value"),
                               stats["importance"][None] * value[:, :, :prompt].half().float().norm(dim=-1))
    with pytest.raises(ConfigError, match="importance_next.*no such tensor"):
        importance_target(raw, "importance_next")
    with pytest.raises(ConfigError, match="allowed"):
        importance_target(raw, "kl")


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(budget=st.sampled_from([0.1, 0.3, 24, 40]), recent=st.sampled_from([0.25, 0.5, 3, 0]),
       sinks=st.integers(0, 5), page=st.sampled_from([2, 4]), mode=st.sampled_from(["tier", "evict"]),
       pad=st.integers(0, 6), chunks=st.lists(st.integers(1, 30), min_size=2, max_size=12))
def test_the_engine_counts_the_kept_entries_on_the_host(make_engine, monkeypatch, budget, recent, sinks, page,
                                                        mode, pad, chunks):
    """The kept set's size that the engine hands the planner (so a GPU step reads nothing back) is the count
    of device entries the planner would find itself, at every demotion, with left padding never stored."""
    import kvtier.engine.layer as layer

    try:
        engine = make_engine(heads=2, head_dim=4, device_budget=budget, mode=mode, page_size=page,
                             sink_tokens=sinks, recent_tokens=recent, recall_pages=0)
    except ConfigError:
        return
    checked, real = [], plan_device_demotion     # the planner itself, whatever an earlier example patched

    def plan(scores, positions, seen, budget_tokens, sink_tokens, recent_tokens, page_size, kept=None, min_pages=1):
        window = recent_window(recent_tokens, budget_tokens)
        mine = ((positions < sink_tokens) | (positions >= seen - window)).sum(dim=1)
        assert (mine == kept).all(), (mine.tolist(), kept)
        checked.append(kept)
        return real(scores, positions, seen, budget_tokens, sink_tokens, recent_tokens, page_size, kept, min_pages)

    monkeypatch.setattr(layer, "plan_device_demotion", plan)
    g = torch.Generator().manual_seed(sum(chunks))
    for i, q in enumerate(chunks):
        k = torch.randn(1, 2, q, 4, generator=g)
        engine.write(k, -k)
        if i == 0 and pad:
            engine.mask_new_tokens(torch.arange(q) < pad)
        engine.commit()
    assert engine.seen == sum(chunks)
    if checked:
        assert engine.pool.count >= checked[-1]


def test_a_scorers_own_inf_never_outranks_the_always_kept_set():
    """Scores of +inf are allowed (the recency scorer gives them to its own first tokens); they had tied with the
    sinks and the recent window, which the planner ranks +inf, and the older positions (the sinks) were demoted
    first. Every movable entry now goes before any always-kept one."""
    n = 20
    positions = torch.arange(n)[None]
    idx = plan_device_demotion(torch.full((1, n), float("inf")), positions, n, budget_tokens=10, sink_tokens=4,
                               recent_tokens=4, page_size=2)
    moved = set(idx[0].tolist())
    assert len(moved) == 10 and not moved & ({0, 1, 2, 3} | set(range(16, 20)))


@pytest.mark.parametrize("scorer", ["recency", "inf"])
def test_the_sinks_stay_on_the_device_with_scores_of_inf(model, scorer):
    """The recency scorer with its 4 sinks against the cache's 2, and a scorer of +inf everywhere: the cache's
    sinks and window stay on the device, and the device holds its budget."""
    from kvtier import cache_kwargs

    class Inf:
        name = "inf"

        def score(self, keys, values, positions, layer_idx):
            return torch.full(keys.shape[:3], float("inf"))

    cache = TieredCache(model.config, device_budget=4, scorer=Inf() if scorer == "inf" else scorer, recall_pages=1000,
                        page_size=2, sink_tokens=2, recent_tokens=2)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, **cache_kwargs(cache))
    for engine in cache._engines:   # every movable entry (2 to 9) demoted, the recency scorer's 2 and 3 too
        on_device = set(engine.pool.meta()[0][0].tolist())
        assert on_device == {0, 1, 10, 11}, (engine.layer_idx, sorted(on_device))
    cache.close()


@pytest.mark.parametrize("mode", ["evict", "tier"])
def test_the_sinks_of_a_left_padded_prompt_are_its_first_real_tokens(model, mode):
    """The sinks were positions 0 to sink_tokens - 1, padding that is never stored: the prompt's first real
    tokens, the sinks the setting is for, were demoted (dropped in evict mode) as any other entry."""
    from kvtier import cache_kwargs

    pad, real, sinks = 8, 60, 4
    ids = torch.randint(1, 128, (1, pad + real), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, :pad] = 0
    cache = TieredCache(model.config, device_budget=24, mode=mode, page_size=4, sink_tokens=sinks, recent_tokens=8,
                        scorer="recency", recall_pages=0)
    with torch.no_grad():
        model(ids, attention_mask=mask, **cache_kwargs(cache))
        for _ in range(3):
            mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], 1)
            model(torch.tensor([[5]]), attention_mask=mask, **cache_kwargs(cache))
    for engine in cache._engines:
        on_device = set(engine.pool.meta()[0][0].tolist())
        assert set(range(pad, pad + sinks)) <= on_device, (engine.layer_idx, sorted(on_device))
        assert engine.pool.count <= 24 + 3
    cache.close()


@pytest.mark.parametrize("seen, fraction, sinks, recent", [(18, 0.6, 3, 0.9), (200, 0.5, 20, 0.99)])
def test_the_device_holds_its_reported_budget_with_a_fractional_window(model, seen, fraction, sinks, recent):
    from kvtier import cache_kwargs

    cache = TieredCache(model.config, device_budget=fraction, scorer="keynorm", recall_pages=1000, page_size=1,
                        sink_tokens=sinks, recent_tokens=recent)
    with torch.no_grad():
        model(torch.randint(0, 128, (1, seen), generator=torch.Generator().manual_seed(1)), **cache_kwargs(cache))
    s = cache.stats()
    assert s["device"]["tokens"] // (s["layers"] * s["kv_heads"]) <= s["budget_tokens_per_head"]["device"]
    cache.close()
