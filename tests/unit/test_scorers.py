"""The heuristic scorers and the checks on any scorer's output."""

from __future__ import annotations

import pytest
import torch

from kvtier import ScorerError, available_scorers, make_scorer
from kvtier.scoring import checked_scores


def _kv(tokens=10, heads=3, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, tokens, dim, generator=g), torch.randn(1, heads, tokens, dim, generator=g)


@pytest.mark.parametrize("name", ["recency", "keynorm", "random"])
def test_builtin_scorers_shape(name):
    k, v = _kv()
    out = checked_scores(make_scorer(name), k, v, torch.arange(100, 110), 0)
    assert out.shape == (1, 3, 10) and out.dtype == torch.float32
    assert set(available_scorers()) >= {"recency", "keynorm", "random"}


def test_keynorm_prefers_small_keys():
    k, v = _kv()
    k[0, 0, 3] *= 0.01
    out = make_scorer("keynorm").score(k, v, torch.arange(10), 0)
    assert int(out[0, 0].argmax()) == 3


def test_recency_sinks_then_newest():
    k, v = _kv()
    out = make_scorer("recency", sink_tokens=2).score(k, v, torch.arange(10), 0)[0, 0]
    assert torch.isinf(out[:2]).all() and (out[2:].diff() > 0).all()


def test_random_is_seeded():
    k, v = _kv()
    a = make_scorer("random", seed=7).score(k, v, torch.arange(10), 0)
    b = make_scorer("random", seed=7).score(k, v, torch.arange(10), 0)
    c = make_scorer("random", seed=8).score(k, v, torch.arange(10), 0)
    assert torch.equal(a, b) and not torch.equal(a, c)


class _Bad:
    name = "bad"

    def __init__(self, out):
        self.out = out

    def score(self, keys, values, positions, layer_idx):
        return self.out


@pytest.mark.parametrize("out, words", [
    (torch.zeros(1, 3, 9), r"shape \[1, 3, 9\]; expected .*\[1, 3, 10\]"),
    (torch.zeros(3, 10), "shape"),
    (torch.zeros(1, 3, 10, dtype=torch.int64), "dtype"),
    (torch.full((1, 3, 10), float("nan")), "NaN"),
    ([0.0] * 10, "returned list"),
])
def test_bad_scorer_output(out, words):
    k, v = _kv()
    with pytest.raises(ScorerError, match=words):
        checked_scores(_Bad(out), k, v, torch.arange(10), 0)
