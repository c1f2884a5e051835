"""Calibrating KVP's recency term on the continuation loss under eviction (`kvtier.training.calibrate`)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvtier import ConfigError
from kvtier.scoring.features import AGE_KNOTS
from kvtier.scoring.kvp import KVPAgents, KVPScorer
from kvtier.training.calibrate import calibrate_recency, with_slope

META = {"model": "tiny", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16}


def _agents(seed=0):
    torch.manual_seed(seed)
    agents = KVPAgents(4, 16, hidden=8)
    with torch.no_grad():
        agents.age.normal_()
    return agents


def test_a_slope_lowers_the_term_by_exactly_slope_ln_1_plus_age():
    agents = _agents()
    ages = torch.tensor([0, 1, 2, 5, 100, 4095, 2 ** (AGE_KNOTS - 1) - 1])
    got = with_slope(agents, 2.5).age_bias(ages)
    want = agents.age_bias(ages) - 2.5 * torch.log1p(ages.float())
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.equal(agents.age, with_slope(agents, 2.5).age)       # the input is left as it was
    # the content network is shared unchanged
    x = torch.randn(4, 3, 2 * 16 + 8)
    assert torch.equal(with_slope(agents, 2.5)(x), agents(x))


def test_scorer_from_agents_in_memory():
    agents = _agents()
    scorer = KVPScorer.from_agents(agents, META, name="cand")
    keys = torch.randn(1, 2, 5, 16)
    assert scorer.name == "cand" and scorer.shape == (2, 2, 16)
    assert scorer.score(keys, keys, torch.arange(5), 1).shape == (1, 2, 5)
    assert torch.equal(scorer.age_bias(torch.zeros(2, 3, dtype=torch.long), 1), agents.age_bias(torch.zeros(3), slice(2, 4)))


def _texts(n=2, prompt=96, cont=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 128, (1, prompt), generator=g), torch.randint(0, 128, (1, cont), generator=g))
            for _ in range(n)]


@torch.no_grad()
def _full_nll(model, prompt, cont):
    logits = model(torch.cat([prompt, cont[:, :-1]], dim=1)).logits[0, prompt.shape[1] - 1:]
    return float(F.cross_entropy(logits.float(), cont[0]))


def test_with_every_token_kept_each_slope_gives_the_full_cache_loss(model):
    texts = _texts()
    result = calibrate_recency(model, _agents(), META, texts, slopes=(0.0, 3.0), budgets=(1.0,))
    want = sum(_full_nll(model, p, c) for p, c in texts) / len(texts)
    assert result.runs == 2 and set(result.nll) == {0.0, 3.0}
    for nll in result.nll.values():
        assert nll == pytest.approx(want, rel=1e-4)


def test_the_slope_with_the_lowest_loss_is_chosen(model):
    result = calibrate_recency(model, _agents(), META, _texts(), slopes=(0.0, 1.0, 1000.0), budgets=(0.2, 0.3))
    assert result.slope == min(result.nll, key=result.nll.get)
    assert all(math.isfinite(v) for v in result.nll.values())
    # under eviction the slope changes what is kept, so the losses differ
    assert len({round(v, 6) for v in result.nll.values()}) > 1


def test_nothing_to_calibrate_on_is_refused(model):
    with pytest.raises(ConfigError, match="calibration needs texts"):
        calibrate_recency(model, _agents(), META, [], slopes=(0.0,), budgets=(0.1,))
