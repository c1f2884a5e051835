"""The KVP objective in closed form, learnability on a synthetic trace, weights that round-trip, and the trace
statistics and scorer evaluation computed by the cache's own scorers."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvtier import ConfigError
from kvtier.scoring import BASELINES_ATTENTION_BASED
from kvtier.scoring.features import entry_features
from kvtier.scoring.kvp import KVPAgents, KVPScorer, load_agents, save_agents
from kvtier.training.dataset import TraceTensors
from kvtier.training.evaluate import trace_scores
from kvtier.training.objective import (listwise_loss, plackett_luce_log_prob, ranking_cost, reinforce_loss,
                                       reward)
from kvtier.training.traces import baseline_scorers, layer_statistics
from kvtier.training.train import TrainSettings, top_entries, train_agents


def test_reward_closed_form():
    c = torch.tensor([3.0, 2.0, 1.0])
    assert float(ranking_cost(c, torch.tensor([0, 1, 2]))) == 0 * 3 + 1 * 2 + 2 * 1
    assert float(reward(c, torch.tensor([0, 1, 2]))) == -1.0          # the oracle
    assert float(reward(c, torch.tensor([2, 1, 0]))) == -8.0 / 4.0     # reversed: 0*1 + 1*2 + 2*3 = 8
    rewards = {p: float(reward(c, torch.tensor(p))) for p in itertools.permutations(range(3))}
    assert max(rewards.values()) == -1.0 and min(rewards, key=rewards.get) == (2, 1, 0)
    # sampled orders broadcast against one importance vector
    orders = torch.tensor([[0, 1, 2], [2, 1, 0]])
    assert torch.equal(reward(c.unsqueeze(0), orders), torch.tensor([-1.0, -2.0]))


def test_plackett_luce_is_a_distribution():
    scores = torch.tensor([0.3, -1.0, 2.0, 0.5])
    total = sum(torch.exp(plackett_luce_log_prob(scores, torch.tensor(p))) for p in itertools.permutations(range(4)))
    assert abs(float(total) - 1.0) < 1e-5
    # the most likely first pick is the highest score
    first = float(torch.exp(plackett_luce_log_prob(scores[:1].new_tensor([2.0]), torch.tensor([0]))))
    assert first == pytest.approx(1.0)


def test_losses_push_scores_toward_the_oracle():
    c = torch.tensor([[5.0, 1.0, 3.0, 0.1]])
    for loss_fn in (lambda s: reinforce_loss(s, c, 16, torch.Generator().manual_seed(0))[0],
                    lambda s: listwise_loss(s, c)):
        s = torch.zeros(1, 4, requires_grad=True)
        opt = torch.optim.SGD([s], lr=0.5)
        for _ in range(200):
            opt.zero_grad()
            loss_fn(s).backward()
            opt.step()
        assert torch.equal(torch.argsort(s.detach(), descending=True), torch.tensor([[0, 2, 1, 3]]))


def _synthetic_traces(count, agents=2, n=160, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(agents, dim, generator=torch.Generator().manual_seed(99))
    out = []
    for _ in range(count):
        keys = torch.randn(agents, n, dim, generator=g)
        values = torch.randn(agents, n, dim, generator=g)
        importance = torch.exp(2 * torch.einsum("and,ad->an", keys, w))  # a known function of the key
        feats = entry_features(keys, values, torch.arange(n))
        out.append(TraceTensors(feats, importance, {}, torch.arange(n)))
    return out


def _spearman(a, b):
    ra, rb = a.argsort(-1).argsort(-1).float(), b.argsort(-1).argsort(-1).float()
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    return (ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1))


@pytest.mark.parametrize("objective", ["reinforce", "listwise"])
def test_agents_learn_a_known_importance(objective):
    torch.manual_seed(0)
    # REINFORCE's sampled gradient is the noisier one: after 300 steps a head sat at 0.85-0.97 depending on
    # the seed and the machine's float order, after 800 at 0.93 or more
    settings = TrainSettings(objective=objective, steps=800 if objective == "reinforce" else 300, batch_traces=4,
                             tokens_per_trace=128, samples=8, lr=1e-2, eval_every=20, hidden=32, seed=0)
    agents, report = train_agents(_synthetic_traces(8), head_dim=8, settings=settings)
    test = _synthetic_traces(2, seed=123)
    with torch.no_grad():
        corr = torch.stack([_spearman(agents(t.features), t.importance) for t in test])
    assert float(corr.min()) > 0.9, corr
    assert report["best_val_reward"] > report["history"][0]["val_reward"]


def test_weights_round_trip_exactly(tmp_path):
    agents = KVPAgents(6, 8, hidden=16)
    meta = {"model": "toy", "num_layers": 3, "num_kv_heads": 2, "head_dim": 8}
    save_agents(agents, tmp_path / "w.safetensors", meta)
    loaded, got = load_agents(tmp_path / "w.safetensors")
    for (k, a), (_, b) in zip(agents.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    assert got["model"] == "toy" and got["hidden"] == 16
    scorer = KVPScorer(path=str(tmp_path / "w.safetensors"))
    keys = torch.randn(1, 2, 5, 8)
    out = scorer.score(keys, keys, torch.arange(5), 2)
    assert out.shape == (1, 2, 5)
    expect = loaded(entry_features(keys[0], keys[0], torch.arange(5)), slice(4, 6))
    assert torch.equal(out[0], expect)
    with pytest.raises(ConfigError, match="trained for 3 layers x 2 KV heads"):
        scorer.check_model(30, 3, 64)


def test_not_a_weights_file(tmp_path):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"nonsense")
    with pytest.raises(ConfigError, match="cannot read KVP weights"):
        load_agents(bad)


def _causal_attention(query, keys, scaling):
    """Plain causal softmax attention of every query over every key: ``[kv_heads, group, n, n]`` float64."""
    kv, n = keys.shape[1], keys.shape[2]
    q = query[0].double().reshape(kv, -1, n, query.shape[3])
    logits = torch.einsum("hgqd,hkd->hgqk", q, keys[0].double()) * scaling
    return torch.softmax(logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")), dim=-1)


def test_trace_statistics_follow_their_definitions():
    """Importance and the TOVA, SnapKV, H2O rows of a trace, against the paper's formulas written out."""
    g = torch.Generator().manual_seed(0)
    prompt, cont = 45, 6
    query = torch.randn(1, 6, prompt + cont, 8, generator=g) * 2
    key, value = torch.randn(1, 2, prompt + cont, 8, generator=g) * 2, torch.randn(1, 2, prompt + cont, 8, generator=g)
    stats = layer_statistics(query, key, value, 0.3, prompt, baseline_scorers())
    assert set(stats) == {"importance", *BASELINES_ATTENTION_BASED}
    full = _causal_attention(query, key, 0.3)
    expect = {"importance": full[:, :, prompt:, :prompt].amax(dim=1).sum(dim=1)}
    att = _causal_attention(query[:, :, :prompt], key[:, :, :prompt], 0.3)   # the prompt alone, as at prefill
    expect["tova"] = att[:, :, -1].mean(dim=1)
    expect["h2o"] = att.sum(dim=2).mean(dim=1)
    window = att[:, :, -32:].sum(dim=2).mean(dim=1)
    expect["snapkv"] = torch.nn.functional.avg_pool1d(window[:, None], 5, stride=1, padding=2,
                                                      count_include_pad=False)[:, 0]   # the votes there are
    for name, value in expect.items():
        assert stats[name].shape == (2, prompt) and stats[name].dtype == torch.float32
        torch.testing.assert_close(stats[name], value.float(), rtol=1e-5, atol=1e-6, msg=name)


def test_scorer_evaluation_runs_the_cache_scorers():
    g = torch.Generator().manual_seed(1)
    layers, heads, n, dim = 2, 2, 30, 8
    raw = {"keys": torch.randn(layers, heads, n, dim, generator=g).half(),
           "values": torch.randn(layers, heads, n, dim, generator=g).half(), "positions": torch.arange(n),
           "importance": torch.rand(layers, heads, n, generator=g), "tova": torch.rand(layers, heads, n, generator=g)}
    keys = raw["keys"].float()
    got = trace_scores("keynorm", raw)
    assert torch.equal(got, torch.stack([-torch.linalg.vector_norm(keys[l], dim=-1) for l in range(layers)]))
    assert torch.equal(trace_scores("tova", raw), raw["tova"])   # recorded by the scorer when the trace was
    with pytest.raises(ConfigError, match=r"trace holds no 'h2o' scores.*one the trace recorded \(tova\)"):
        trace_scores("h2o", raw)


def _needle_traces(count, n=1500, dim=8, seed=0):
    """Long traces whose importance sits on 3 rare tokens with a marked key (needles), as in a long prompt."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        keys, values = torch.randn(1, n, dim, generator=g), torch.randn(1, n, dim, generator=g)
        spots = torch.randperm(n, generator=g)[:3]
        keys[0, spots, 0] = 4.0
        importance = torch.rand(1, n, generator=g) * 0.01 + torch.exp(keys[..., 1]) * 1e-3
        importance[0, spots] = 5.0
        out.append((TraceTensors(entry_features(keys, values, torch.arange(n)), importance, {}, torch.arange(n)),
                    spots))
    return out


def test_top_entries_are_the_largest_share_of_some_agent():
    importance = torch.tensor([[1.0, 1.0, 8.0, 1.0, 1.0], [100.0, 300.0, 10.0, 90.0, 0.0]])
    assert top_entries(importance, 1).tolist() == [2]            # 8/12 of agent 0 beats 300/500 of agent 1
    assert sorted(top_entries(importance, 2).tolist()) == [1, 2]
    assert top_entries(importance, 9).numel() == 5


def test_problems_with_the_top_entries_learn_needles_random_ones_miss():
    def mean_needle_rank(top):
        torch.manual_seed(0)
        settings = TrainSettings(steps=150, batch_traces=4, tokens_per_trace=48, top_tokens=top, lr=1e-2,
                                 eval_every=25, hidden=16, seed=0)
        agents, report = train_agents([t for t, _ in _needle_traces(12)], head_dim=8, settings=settings)
        assert report["settings"]["top_tokens"] == top
        with torch.no_grad():
            ranks = [agents(t.features)[0].argsort(descending=True).argsort()[spots]
                     for t, spots in _needle_traces(4, seed=7)]
        return float(torch.cat(ranks).float().mean())

    assert mean_needle_rank(3) < 10 < 50 < mean_needle_rank(0)


def test_top_tokens_must_fit_the_problem():
    with pytest.raises(ConfigError, match="top_tokens=500"):
        TrainSettings(top_tokens=500)


def test_weights_and_traces_are_written_as_the_umask_says(tmp_path):
    """safetensors makes its files private (0600) whatever the umask: weights trained to share, and traces, could
    not be read by another user, where every other output of the command line is written with the umask."""
    import os

    from kvtier.training.traces import save_trace

    agents = KVPAgents(4, 4, hidden=8)
    old = os.umask(0o022)
    try:
        save_agents(agents, tmp_path / "w.safetensors", {"model": "toy", "num_layers": 2, "num_kv_heads": 2,
                                                          "head_dim": 4})
        save_trace({"keys": torch.zeros(2, 3)}, tmp_path / "t.safetensors")
        os.umask(0o077)
        save_trace({"keys": torch.zeros(2, 3)}, tmp_path / "private.safetensors")
    finally:
        os.umask(old)
    mode = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert mode == {"w.safetensors": 0o644, "t.safetensors": 0o644, "private.safetensors": 0o600}
