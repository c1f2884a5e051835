"""Every registered scorer through the same checks: the contract of `kvtier.scoring.base`.

A `Scorer` gets key, value and position; a `QueryScorer` also the query keywords, as the cache gives them
after attention. KVP runs with the weights shipped for the default model, so the shapes are that model's:
3 KV heads of size 64, 3 query heads per KV head, 30 layers.
"""

from __future__ import annotations

import pytest
import torch

from kvtier import ConfigError, ScorerError
from kvtier.eval.shared_prefill import PromptScores
from kvtier.scoring import (BASELINES_ATTENTION_BASED, BASELINES_ATTENTION_FREE, AgeAware, ModelBound, QueryScorer,
                            Scorer, available_scorers, check_scorer_model, checked_scores, make_scorer, needs_query,
                            ranking_scores)

KV_HEADS, GROUP, DIM, LAYERS = 3, 3, 64, 30
LAYER = LAYERS - 1          # the last layer: a scorer with per-layer state must reach it
NAMES = available_scorers()


def _step(tokens: int, dtype: torch.dtype = torch.float32, old: int = 5, seed: int = 0):
    """One write of `tokens` entries after `old` stored ones: keys, values, positions, query keywords."""
    g = torch.Generator().manual_seed(seed)
    context = torch.randn(1, KV_HEADS, old + tokens, DIM, generator=g).to(dtype)
    values = torch.randn(1, KV_HEADS, tokens, DIM, generator=g).to(dtype)
    query = torch.randn(1, KV_HEADS * GROUP, tokens, DIM, generator=g).to(dtype)
    query_kwargs = {"query": query, "context_keys": context, "scaling": DIM ** -0.5}
    return context[:, :, old:], values, torch.arange(old, old + tokens), query_kwargs


def _raw(scorer, keys, values, positions, query_kwargs):
    """The scorer's own output, called as its kind requires (no checks, no conversion)."""
    if needs_query(scorer):
        return scorer.score(keys, values, positions, LAYER, **query_kwargs)
    return scorer.score(keys, values, positions, LAYER)


def test_every_builtin_is_registered():
    assert set(BASELINES_ATTENTION_FREE) | set(BASELINES_ATTENTION_BASED) | {"kvp"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_kind_matches_what_the_engine_does(name, make_engine):
    scorer = make_scorer(name)
    is_query = name in BASELINES_ATTENTION_BASED
    assert needs_query(scorer) is is_query
    assert isinstance(scorer, QueryScorer) is is_query and isinstance(scorer, Scorer) is not is_query
    engine = make_engine(heads=KV_HEADS, head_dim=DIM, scorer=name, device_budget=8, sink_tokens=1,
                         recent_tokens=2)
    k = torch.randn(1, KV_HEADS, 20, DIM)
    engine.write(k, k)
    if is_query:  # scored only after attention: without the query the step stays pending
        with pytest.raises(ScorerError, match="needs the attention query"):
            engine.commit()
        assert engine.pending is not None
        engine.commit(query=torch.randn(1, KV_HEADS * GROUP, 20, DIM))
    else:         # scored at write time: the query is never needed
        assert engine.pending.score is not None
        engine.commit()
    assert engine.pending is None and engine.pool.count <= 8


@pytest.mark.parametrize("tokens", [1, 7, 600])
@pytest.mark.parametrize("name", NAMES)
def test_output_shape_dtype_and_no_nan(name, tokens):
    keys, values, positions, query_kwargs = _step(tokens)
    scorer = make_scorer(name)
    out = _raw(scorer, keys, values, positions, query_kwargs)
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (1, KV_HEADS, tokens)
    assert out.is_floating_point() and not torch.isnan(out).any()
    assert torch.isfinite(out).any()  # +-inf marks protected entries; a scorer ranks the rest
    checked = checked_scores(make_scorer(name), keys, values, positions, LAYER, **query_kwargs)
    assert checked.dtype == torch.float32 and torch.equal(checked, out.float())


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_for_the_same_input(name):
    keys, values, positions, query_kwargs = _step(50, seed=3)
    a = _raw(make_scorer(name), keys, values, positions, query_kwargs)
    b = _raw(make_scorer(name), keys.clone(), values.clone(), positions.clone(),
             {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in query_kwargs.items()})
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_inputs_score_like_the_same_values_in_float32(name):
    """Scorers compute in float32, so a bfloat16 cache ranks its entries as a float32 cache of them would."""
    keys, values, positions, query_kwargs = _step(40, dtype=torch.bfloat16, seed=5)
    as_f32 = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in query_kwargs.items()}
    low = _raw(make_scorer(name), keys, values, positions, query_kwargs)
    full = _raw(make_scorer(name), keys.float(), values.float(), positions, as_f32)
    assert low.is_floating_point() and not torch.isnan(low).any()
    torch.testing.assert_close(low.float(), full.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_query_keywords_are_required_by_query_scorers_only(name):
    keys, values, positions, query_kwargs = _step(12, seed=7)
    scorer = make_scorer(name)
    if not needs_query(scorer):  # callers may always pass the query; a `Scorer` never sees it
        torch.testing.assert_close(checked_scores(scorer, keys, values, positions, LAYER, **query_kwargs),
                                   checked_scores(make_scorer(name), keys, values, positions, LAYER))
        return
    with pytest.raises(ScorerError, match=rf"scorer '{name}' needs the attention query.*missing: query, "
                                          "context_keys, scaling"):
        checked_scores(scorer, keys, values, positions, LAYER)
    with pytest.raises(ScorerError, match="missing: scaling"):
        checked_scores(scorer, keys, values, positions, LAYER, query=query_kwargs["query"],
                       context_keys=query_kwargs["context_keys"])
    with pytest.raises(TypeError, match="query"):   # called directly, Python names the missing keywords
        scorer.score(keys, values, positions, LAYER)
    wrong = dict(query_kwargs, query=query_kwargs["query"][:, :, :5])
    with pytest.raises(ScorerError, match=r"query shape \[1, 9, 5, 64\].*expected \[1, q_heads, 12, 64\]"):
        checked_scores(scorer, keys, values, positions, LAYER, **wrong)
    short = dict(query_kwargs, context_keys=query_kwargs["context_keys"][:, :, :4])
    with pytest.raises(ScorerError, match=r"context_keys shape \[1, 3, 4, 64\].*n >= 12"):
        checked_scores(scorer, keys, values, positions, LAYER, **short)


@pytest.mark.parametrize("name", NAMES)
def test_model_check(name):
    scorer = make_scorer(name)
    check_scorer_model(scorer, LAYERS, KV_HEADS, DIM)  # the default model fits every built-in
    if isinstance(scorer, ModelBound):
        with pytest.raises(ConfigError, match=f"trained for {LAYERS} layers x {KV_HEADS} KV heads"):
            check_scorer_model(scorer, 2, KV_HEADS, DIM)
    else:
        check_scorer_model(scorer, 2, 1, 8)


@pytest.mark.parametrize("name", NAMES)
def test_prompt_scores_wrapper_keeps_the_kind_and_the_model_check(name):
    """The evaluation harness wraps every scorer; the cache must treat the wrapper as the scorer itself."""
    inner = make_scorer(name)
    wrapped = PromptScores(inner, prompt_tokens=9)
    assert needs_query(wrapped) is needs_query(inner) and wrapped.name == inner.name
    assert isinstance(wrapped, QueryScorer) is isinstance(inner, QueryScorer)
    if isinstance(inner, ModelBound):
        with pytest.raises(ConfigError, match="trained for"):
            check_scorer_model(wrapped, 2, KV_HEADS, DIM)
    keys, values, positions, query_kwargs = _step(9, old=0)
    first = checked_scores(wrapped, keys, values, positions, LAYER, **query_kwargs)
    again = checked_scores(wrapped, keys, values, positions, LAYER, **query_kwargs)
    assert torch.equal(first, again)


@pytest.mark.parametrize("name", NAMES)
def test_ranking_adds_a_well_formed_age_term(name):
    """What placement ranks by: the write-time scores, plus an `AgeAware` scorer's term (shape, dtype, no NaN,
    the same for the same ages), passed on unchanged by the evaluation harness's wrapper."""
    scorer = make_scorer(name)
    keys, values, positions, query_kwargs = _step(12)
    scores = checked_scores(scorer, keys, values, positions, LAYER, **query_kwargs)[0]
    pos = positions.expand(KV_HEADS, -1)
    ranked = ranking_scores(scorer, scores, pos, int(positions[-1]) + 1, LAYER)
    assert ranked.shape == scores.shape and ranked.dtype == torch.float32 and not torch.isnan(ranked).any()
    wrapped = ranking_scores(PromptScores(scorer, prompt_tokens=9), scores, pos, int(positions[-1]) + 1, LAYER)
    assert torch.equal(wrapped, ranked)
    if isinstance(scorer, AgeAware):
        ages = torch.tensor([[0, 1, 10, 10**6]] * KV_HEADS)
        bias = scorer.age_bias(ages, LAYER)
        assert bias.shape == ages.shape and bias.is_floating_point() and torch.equal(bias, scorer.age_bias(ages, LAYER))
    else:
        assert torch.equal(ranked, scores)
