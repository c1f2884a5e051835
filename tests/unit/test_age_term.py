"""The recency term of a ranking: the age basis, KVP's per-agent table, the cache ranking by it at every placement,
weights files without it, and training that learns it from traces of several prompt lengths."""

from __future__ import annotations

import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtier import ScorerError, TieredCache
from kvtier.scoring import AgeAware, Scorer, ranking_scores
from kvtier.scoring.features import AGE_KNOTS, age_basis, entry_features
from kvtier.scoring.kvp import KVPAgents, KVPScorer, load_agents, save_agents
from kvtier.training.dataset import TraceTensors
from kvtier.training.train import TrainSettings, ranking, train_agents


def test_age_basis_interpolates_on_log2_knots():
    ages = torch.tensor([0, 1, 2, 3, 7, 1023, 10**9])
    lower, upper, w = age_basis(ages)
    # log2(1 + age): 0, 1, log2(3), 2, 3, 10, then flat at the last knot
    assert lower.tolist() == [0, 1, 1, 2, 3, 10, AGE_KNOTS - 2]
    assert torch.equal(upper, lower + 1)
    assert w[[0, 1, 3, 4, 5]].tolist() == [0.0, 0.0, 0.0, 0.0, 0.0]
    assert float(w[2]) == pytest.approx(torch.log2(torch.tensor(3.0)).item() - 1)
    assert float(w[6]) == 1.0
    assert torch.equal(age_basis(torch.tensor([-5]))[0], torch.tensor([0]))   # negative ages count as 0


def test_agent_tables_give_each_head_its_own_curve():
    agents = KVPAgents(3, 4, hidden=8)
    with torch.no_grad():
        agents.age.copy_(torch.arange(3 * AGE_KNOTS, dtype=torch.float32).view(3, AGE_KNOTS))
    ages = torch.tensor([0, 1, 2, 3])
    got = agents.age_bias(ages)                                        # one age row for every agent
    knots = torch.log2(1 + ages.float())
    assert torch.allclose(got, knots[None] + torch.tensor([0.0, 22.0, 44.0])[:, None])
    # per-agent ages, and a slice of agents (one layer's heads)
    per = agents.age_bias(torch.tensor([[0, 1], [3, 0]]), slice(1, 3))
    assert torch.allclose(per, torch.tensor([[22.0, 23.0], [46.0, 44.0]]))


def _file(tmp_path, agents, name="w.safetensors"):
    path = tmp_path / name
    save_agents(agents, path, {"model": "toy", "num_layers": 2, "num_kv_heads": 2, "head_dim": 4})
    return path


def test_kvp_scorer_is_age_aware_and_weights_keep_the_table(tmp_path):
    agents = KVPAgents(4, 4, hidden=8)
    with torch.no_grad():
        agents.age.normal_()
    scorer = KVPScorer(path=str(_file(tmp_path, agents)))
    assert isinstance(scorer, AgeAware) and isinstance(scorer, Scorer)
    ages = torch.tensor([[0, 5, 300], [2, 2, 2]])
    assert torch.equal(scorer.age_bias(ages, 1), agents.age_bias(ages, slice(2, 4)))


def test_weights_written_before_the_table_rank_by_content_alone(tmp_path):
    path = _file(tmp_path, KVPAgents(4, 4, hidden=8))
    state = load_file(str(path))
    del state["age"]
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    save_file(state, str(tmp_path / "old.safetensors"), metadata=meta)
    agents, _ = load_agents(tmp_path / "old.safetensors")
    assert torch.equal(agents.age, torch.zeros(4, AGE_KNOTS))
    scorer = KVPScorer(path=str(tmp_path / "old.safetensors"))
    scores = torch.randn(2, 6)
    positions = torch.arange(6).expand(2, 6)
    assert torch.equal(ranking_scores(scorer, scores, positions, 6, 0), scores)


class _OldestFirst:
    """Prefers the oldest entries by content; its age term (when on) prefers the newest by far more."""

    name = "oldest-first"

    def __init__(self, age_weight: float) -> None:
        self.age_weight = age_weight

    def score(self, keys, values, positions, layer_idx):
        return (-positions.float()).expand(keys.shape[:3]).clone()

    def age_bias(self, ages, layer_idx):
        return -self.age_weight * ages.float()


class _ContentOnly:
    name = "content-only"

    def score(self, keys, values, positions, layer_idx):
        return (-positions.float()).expand(keys.shape[:3]).clone()


def test_ranking_scores_adds_the_term_at_the_current_age():
    scores = torch.zeros(1, 4)
    positions = torch.tensor([[0, 3, 6, 9]])
    got = ranking_scores(_OldestFirst(1.0), scores, positions, 10, 0)
    assert got.tolist() == [[-9.0, -6.0, -3.0, -0.0]]          # the latest entry (position 9 of 10) has age 0
    assert ranking_scores(_ContentOnly(), scores, positions, 10, 0) is scores


def test_a_bad_age_term_is_named():
    class Bad(_OldestFirst):
        def age_bias(self, ages, layer_idx):
            return torch.zeros(3)

    with pytest.raises(ScorerError, match=r"'oldest-first': age_bias returned shape \[3\]; expected"):
        ranking_scores(Bad(1.0), torch.zeros(2, 5), torch.arange(5).expand(2, 5), 5, 0)


CONFIG = types.SimpleNamespace(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               hidden_size=32)


def _kept_positions(scorer, steps=48):
    torch.manual_seed(0)
    cache = TieredCache(CONFIG, device_budget=24, mode="evict", scorer=scorer, sink_tokens=0, recent_tokens=4,
                        page_size=4)
    k = torch.randn(1, 2, 32, 8)
    cache.update(k, k, 0)
    for _ in range(steps - 32):
        k = torch.randn(1, 2, 1, 8)
        cache.update(k, k, 0)
    return sorted(cache.layers[0].positions[0].tolist())


def test_evict_mode_ranks_by_the_age_term_at_every_demotion():
    # content alone keeps the oldest entries and the recent window; a dominant age term keeps the latest ones
    content = _kept_positions(_ContentOnly())
    aged = _kept_positions(_OldestFirst(100.0))
    last = content[-1]
    assert content[:4] == [0, 1, 2, 3] and content[-4:] == list(range(last - 3, last + 1))
    assert aged == list(range(last + 1 - len(aged), last + 1)) and len(aged) >= 20
    # a weak age term changes nothing: the content gap (one per position) outweighs it
    assert _kept_positions(_OldestFirst(0.1)) == content


def _aged_traces(count, lengths=(64, 128, 256), agents=2, dim=4, seed=0):
    """Importance that only the age explains: exp(-age / 16), on noise keys and values, at several lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = lengths[i % len(lengths)]
        keys, values = torch.randn(agents, n, dim, generator=g), torch.randn(agents, n, dim, generator=g)
        ages = torch.arange(n - 1, -1, -1)
        importance = torch.exp(-ages.float() / 16).expand(agents, n) + 1e-3 * torch.rand(agents, n, generator=g)
        feats = entry_features(keys, values, torch.arange(n))
        out.append(TraceTensors(feats, importance, {"positions": torch.arange(n)}, torch.arange(n)))
    return out


def test_training_learns_the_age_term_across_prompt_lengths():
    torch.manual_seed(0)
    settings = TrainSettings(objective="listwise", steps=150, batch_traces=3, tokens_per_trace=64, lr=1e-2,
                             eval_every=25, hidden=16, seed=0)
    agents, report = train_agents(_aged_traces(9), head_dim=4, settings=settings)
    test = _aged_traces(3, lengths=(96, 200, 320), seed=7)
    # the term falls with age, and the ranking keeps the latest tokens of prompts of lengths never seen
    curve = agents.age_bias(torch.tensor([0, 3, 15, 63]))
    assert bool((curve[:, :-1] > curve[:, 1:]).all()), curve
    for t in test:
        with torch.no_grad():
            top = torch.topk(ranking(agents, t.features, t.ages), 16, dim=-1).indices
        n = t.features.shape[1]
        assert set(top[0].tolist()) == set(range(n - 16, n)), top
    assert report["best_val_reward"] > report["history"][0]["val_reward"]


def test_untrained_knots_hold_the_last_trained_value():
    from kvtier.training.train import flatten_untrained_ages

    agents = KVPAgents(2, 4, hidden=8)
    with torch.no_grad():
        agents.age.copy_(torch.arange(2 * AGE_KNOTS, dtype=torch.float32).view(2, AGE_KNOTS))
    ages = torch.arange(301)
    before = agents.age_bias(ages)
    flatten_untrained_ages(agents, max_age=300)   # log2(301) = 8.2: ages up to 300 reach knots 8 and 9
    assert agents.age[0, :10].tolist() == list(range(10)) and agents.age[0, 10:].tolist() == [9.0] * (AGE_KNOTS - 10)
    assert torch.equal(agents.age_bias(torch.tensor([10 ** 6]))[:, 0], agents.age[:, 9])
    assert torch.equal(agents.age_bias(ages), before)   # unchanged wherever training saw an age
    flatten_untrained_ages(agents, max_age=255)   # log2(256) = 8 exactly: knot 9 has weight 0 at age 255
    assert torch.equal(agents.age_bias(ages[:256]), before[:, :256])


def test_age_only_training_keeps_the_network_and_learns_the_term():
    torch.manual_seed(0)
    start = KVPAgents(2, 4, hidden=16)
    settings = TrainSettings(objective="listwise", steps=100, batch_traces=3, tokens_per_trace=64, lr=1e-2,
                             eval_every=25, hidden=16, seed=0)
    agents, report = train_agents(_aged_traces(9), head_dim=4, settings=settings, age_only=start)
    for (name, a), (_, b) in zip(agents.state_dict().items(), start.state_dict().items()):
        assert torch.equal(a, b) == (name != "age"), name
    assert torch.equal(start.age, torch.zeros_like(start.age))          # the starting agents are left as they were
    curve = agents.age_bias(torch.tensor([0, 3, 15, 63]))
    assert bool((curve[:, :-1] > curve[:, 1:]).all()), curve
    assert report["best_val_reward"] > report["history"][0]["val_reward"]


def test_the_saved_agents_score_the_reported_validation_reward():
    """What training saves (the best checkpoint, its untrained knots flattened) ranks the validation traces as
    the report says: the flattening had moved a knot training used, and the saved term scored otherwise."""
    import random

    from kvtier.training.train import mean_reward

    g = torch.Generator().manual_seed(0)
    traces = []
    for n in (700, 900, 1000, 800):
        keys = torch.randn(2, n, 4, generator=g)
        ages = torch.arange(n - 1, -1, -1)
        importance = (torch.exp(-ages.float() / 300) + 0.3 * torch.rand(n, generator=g)).expand(2, n).contiguous()
        features = torch.cat([keys, keys, torch.zeros(2, n, 8)], dim=-1)
        traces.append(TraceTensors(features, importance, {"positions": torch.arange(n)}, torch.arange(n)))
    settings = TrainSettings(steps=60, eval_every=10, tokens_per_trace=256, hidden=8, val_share=0.25, seed=0)
    agents, report = train_agents(traces, 4, settings)
    order = list(range(len(traces)))
    random.Random(settings.seed).shuffle(order)
    assert mean_reward(agents, [traces[i] for i in order[:1]]) == pytest.approx(report["best_val_reward"], abs=1e-6)
