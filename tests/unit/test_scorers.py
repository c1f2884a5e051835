"""The heuristic scorers, the checks on any scorer's output, and how a scorer's kind is told."""

from __future__ import annotations

import pytest
import torch

from kvtier import ConfigError, ScorerError, available_scorers, make_scorer
from kvtier.scoring import QueryScorer, Scorer, check_scorer_model, checked_scores, needs_query, scorer_name


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


@pytest.mark.parametrize("seed", [-1, 2**32, 2**40])
def test_random_seeds_the_hash_would_fold_onto_others_are_refused(seed):
    """The hash took the seed's low 32 bits: 2**32 scored exactly as 0, -1 as 2**32 - 1."""
    with pytest.raises(ConfigError, match=f"seed={seed}; allowed: a whole number from 0 to 4,294,967,295"):
        make_scorer("random", seed=seed)
    make_scorer("random", seed=2**32 - 1)


def test_a_scorer_class_or_settings_beside_an_object_are_refused():
    """A class passed its check (it has a callable score) and failed at every step; settings given with an object
    were dropped."""
    from kvtier.scoring.keynorm import KeyNormScorer
    from kvtier.scoring.random import RandomScorer

    with pytest.raises(ConfigError, match=r"scorer=KeyNormScorer is a class; allowed: an instance of it"):
        make_scorer(KeyNormScorer)
    with pytest.raises(ConfigError, match="settings seed given with a scorer object"):
        make_scorer(RandomScorer(), seed=5)


def test_an_age_term_that_is_nan_or_no_float_tensor_is_refused_by_name(make_engine):
    """Only its shape was checked: a NaN term ranked entries without a word."""
    from kvtier.scoring import ranking_scores

    class Aged:
        name = "aged"

        def __init__(self, term):
            self.term = term

        def score(self, keys, values, positions, layer_idx):
            return keys.float().norm(dim=-1)

        def age_bias(self, ages, layer_idx):
            return self.term(ages)

    scores, pos = torch.zeros(2, 6), torch.arange(6).expand(2, 6)
    for term, words in [(lambda a: torch.where(a > 2, float("nan"), 0.0), "returned NaN scores at layer 1"),
                        (lambda a: a, "age_bias returned dtype torch.int64"),
                        (lambda a: a.tolist(), "age_bias returned list")]:
        with pytest.raises(ScorerError, match=words):
            ranking_scores(Aged(term), scores, pos, 6, 1)
    for defer in (False, True):   # checked at once, and as a GPU's step defers it
        nan = Aged(lambda a: torch.where(a > 40, float("nan"), 0.0))
        engine = make_engine(heads=2, head_dim=4, device_budget=16, page_size=4, scorer=nan, mode="evict")
        engine.defer_nan = defer
        with pytest.raises(ScorerError, match="'aged' returned NaN"):
            for _ in range(8):
                k = torch.randn(1, 2, 8, 4)
                engine.write(k, k)
                engine.commit()


def test_random_is_seeded():
    k, v = _kv()
    a = make_scorer("random", seed=7).score(k, v, torch.arange(10), 0)
    b = make_scorer("random", seed=7).score(k, v, torch.arange(10), 0)
    c = make_scorer("random", seed=8).score(k, v, torch.arange(10), 0)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_random_scores_depend_on_the_entry_only():
    """An entry's score is a function of seed, layer, KV head and position: the same whatever was scored before
    (an evaluation's runs share one scorer, and a resumed run must give a whole run's numbers), and a prompt
    scored in two chunks gets the scores of one pass; uniform in [0, 1) and unrelated between heads and layers."""
    scorer = make_scorer("random", seed=7)
    k = torch.zeros(1, 4, 4000, 8)
    whole = scorer.score(k, k, torch.arange(4000), 1)
    scorer.score(k[:, :, :100], k[:, :, :100], torch.arange(100), 0)   # other calls in between change nothing
    parts = torch.cat([scorer.score(k[:, :, :1500], k[:, :, :1500], torch.arange(1500), 1),
                       scorer.score(k[:, :, 1500:], k[:, :, 1500:], torch.arange(1500, 4000), 1)], dim=2)
    assert torch.equal(whole, parts) and whole.dtype == torch.float32
    assert 0 <= whole.min() and whole.max() < 1 and abs(whole.mean().item() - 0.5) < 0.02
    assert not torch.equal(whole, scorer.score(k, k, torch.arange(4000), 2))
    assert abs(torch.corrcoef(whole[0, :2])[0, 1].item()) < 0.1


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
    (torch.zeros(1, 3, 10, device="meta"), r"returned scores on meta; expected them on the keys' device, cpu"),
])
def test_bad_scorer_output(out, words):
    k, v = _kv()
    with pytest.raises(ScorerError, match=words):
        checked_scores(_Bad(out), k, v, torch.arange(10), 0)


class _MarkerOnlyQueryScorer:
    """A plugin written against the bare ``needs_query`` marker, naming none of the protocols."""

    name = "marker-only"
    needs_query = True

    def score(self, keys, values, positions, layer_idx, *, query, context_keys, scaling):
        return context_keys[:, :, -keys.shape[2]:, 0].float() * scaling


def test_marker_only_query_scorer_is_a_query_scorer(make_engine):
    scorer = _MarkerOnlyQueryScorer()
    assert make_scorer(scorer) is scorer and needs_query(scorer)
    assert isinstance(scorer, QueryScorer) and not isinstance(scorer, Scorer)
    engine = make_engine(scorer=scorer, device_budget=8, sink_tokens=1, recent_tokens=2)
    k = torch.randn(1, engine.heads, 20, engine.head_dim)
    engine.write(k, k)
    with pytest.raises(ScorerError, match="scorer 'marker-only' needs the attention query"):
        engine.commit()
    engine.commit(query=torch.randn(1, engine.heads, 20, engine.head_dim), scaling=0.5)
    assert engine.pending is None


@pytest.mark.parametrize("marker, kind", [(False, Scorer), (None, None), ("yes", None), (1, None)])
def test_needs_query_marker_must_be_a_bool(marker, kind):
    class Marked:
        name = "marked"
        needs_query = marker

        def score(self, keys, values, positions, layer_idx):
            return keys[..., 0].float()

    scorer = Marked()
    if kind is Scorer:
        assert make_scorer(scorer) is scorer and not needs_query(scorer)
        assert isinstance(scorer, Scorer) and not isinstance(scorer, QueryScorer)
        return
    assert not isinstance(scorer, Scorer) and not isinstance(scorer, QueryScorer)
    with pytest.raises(ScorerError, match=rf"scorer 'marked' has needs_query={marker!r}; allowed: True .* or False"):
        make_scorer(scorer)


def test_scorer_without_model_shape_fits_any_model_and_nameless_ones_get_their_class_name():
    class Nameless:
        def score(self, keys, values, positions, layer_idx):
            return keys[..., 1:, 0]    # one score short

    check_scorer_model(Nameless(), 1, 1, 1)
    assert scorer_name(Nameless()) == "Nameless" and scorer_name(make_scorer("keynorm")) == "keynorm"
    with pytest.raises(ScorerError, match="scorer 'Nameless' returned shape"):
        checked_scores(Nameless(), *_kv(), torch.arange(10), 0)


def test_snapkv_settings_are_checked():
    with pytest.raises(ConfigError, match="kernel=4; allowed: an odd whole number >= 1"):
        make_scorer("snapkv", kernel=4)
    with pytest.raises(ConfigError, match="window=0; allowed: a whole number >= 1"):
        make_scorer("snapkv", window=0)


def test_kvp_computes_a_steps_position_features_once_for_every_layer(monkeypatch):
    """Every layer of a decode step passes KVP the same positions tensor (`SharedResources.positions`), so the
    position features are computed once a step, not once a layer; the scores are those computed afresh. A
    decode step's position and its features are kept tensors, written each step (one address every step)."""
    from kvtier.bench.launches import LaunchCounter
    from kvtier.engine.resources import SharedResources
    from kvtier.scoring import features, kvp

    cpu = torch.device("cpu")
    shared = SharedResources(None)
    scorer = make_scorer("kvp")
    calls = []
    real = features.position_features
    monkeypatch.setattr(kvp, "position_features", lambda p, out=None: calls.append(p) or real(p, out=out))
    g = torch.Generator().manual_seed(0)
    heads, dim = scorer.shape[1], scorer.shape[2]
    k, v = torch.randn(1, heads, 1, dim, generator=g), torch.randn(1, heads, 1, dim, generator=g)
    kept = first = None
    for start in (40, 41, 5000):
        pos = shared.positions(start, 1, cpu)
        assert shared.positions(start, 1, cpu) is pos and pos.tolist() == [start]
        assert first is None or pos is first                             # the same tensor, rewritten
        first = pos
        calls.clear()
        with LaunchCounter() as counter:
            scores = [scorer.score(k, v, pos, layer) for layer in range(3)]
            feats = scorer._position_features(pos, cpu)
        assert len(calls) == 1                                           # once a step
        assert counter.host_reads == 0                                   # finding them reads nothing back
        assert kept is None or feats is kept                             # the features' tensor, rewritten
        kept = feats
        assert torch.equal(feats, real(torch.tensor([start])))
        calls.clear()
        fresh = [scorer.score(k, v, torch.tensor([start]), layer) for layer in range(3)]   # a new tensor each
        assert len(calls) == 3 and all(torch.equal(a, b) for a, b in zip(scores, fresh))
    with torch.inference_mode():   # rewritten in inference mode, the kept tensor still says so by its version
        for start in (70, 71):
            pos = shared.positions(start, 1, cpu)
            assert pos is first and not pos.is_inference()
            assert torch.equal(scorer._position_features(pos, cpu), real(torch.tensor([start])))
            fresh = torch.tensor([start])                                # made in inference mode: no version
            assert torch.equal(scorer._position_features(fresh, cpu), real(torch.tensor([start])))
    longer = shared.positions(7, 3, cpu)                                  # a prefill chunk: its own tensor
    assert longer.tolist() == [7, 8, 9] and shared.positions(8, 1, cpu) is first and first.tolist() == [8]
    shared.close()
