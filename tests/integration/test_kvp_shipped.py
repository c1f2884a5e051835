"""The KVP weights shipped for the default model: they load, fit the model, and rank a prefill quickly."""

from __future__ import annotations

import time

import pytest
import torch

from kvtier import ConfigError, TieredCache
from kvtier.scoring.kvp import KVPScorer, shipped_path
from kvtier.tasks import make_needle_task

pytestmark = pytest.mark.slow


def test_shipped_weights_fit_the_default_model(default_model):
    model, _ = default_model
    assert shipped_path("SmolLM2-135M-Instruct").stat().st_size <= 10 * 2**20  # the whole scorer <= 10 MB
    scorer = KVPScorer()
    cfg = model.config
    scorer.check_model(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    assert scorer.meta["objective"] in ("reinforce", "listwise") and scorer.meta["training_data"]
    cache = TieredCache(cfg)  # no scorer given: the shipped KVP scorer is the default for this model
    assert cache.settings.scorer_name == "kvp"
    cache.close()


def test_other_model_shape_is_refused():
    import types

    cfg = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                hidden_size=32, vocab_size=100, _attn_implementation="sdpa")
    with pytest.raises(ConfigError, match="trained for 30 layers x 3 KV heads"):
        TieredCache(cfg, scorer="kvp")
    assert TieredCache(cfg).settings.scorer_name == "keynorm"  # no KVP weights for this model: the heuristic


@pytest.mark.parametrize("sizes, words", [({"hidden_size": 192}, "hidden_size=576, but this model has hidden_size=192"),
                                          ({"vocab_size": 512}, "vocab_size=49152, but this model has vocab_size=512")])
def test_another_model_of_the_same_kv_shape_is_refused(sizes, words):
    """30 layers x 3 KV heads x head size 64, as the default model, but another model: the shipped weights had
    scored it without a word."""
    import types

    fields = dict(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_size=576,
                  vocab_size=49152, _attn_implementation="sdpa")
    cfg = types.SimpleNamespace(**{**fields, **sizes})
    with pytest.raises(ConfigError, match=words):
        TieredCache(cfg, scorer="kvp")
    TieredCache(types.SimpleNamespace(**fields), scorer="kvp").close()   # the default model's own sizes


def test_the_shipped_weights_are_found_by_the_model_s_sizes_whatever_its_name():
    from kvtier.scoring.kvp import MODEL_SIGNATURE, shipped_matching

    signature = dict(zip(MODEL_SIGNATURE, (30, 3, 64, 576, 49152)))
    assert shipped_matching(signature) == "SmolLM2-135M-Instruct"
    assert shipped_matching({**signature, "hidden_size": 192}) is None


def test_the_default_scorer_is_keynorm_for_a_model_of_another_head_size():
    """The default model's sizes with 6 query heads (head size 96): the shipped weights had been picked, and the
    cache then refused to be made, where `scorer=None` falls back to keynorm."""
    from transformers import LlamaConfig

    from kvtier.config import ModelShape
    from kvtier.models import load_config
    from kvtier.scoring.kvp import shipped_for

    default = load_config()
    assert shipped_for(default, ModelShape.from_config(default).head_dim) == "SmolLM2-135M-Instruct"
    cfg = LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=6, num_key_value_heads=3,
                      intermediate_size=64, vocab_size=49152)
    assert shipped_for(cfg, ModelShape.from_config(cfg).head_dim) is None
    with TieredCache(cfg) as cache:
        assert cache.scorer.name == "keynorm"


@torch.no_grad()
def test_scoring_a_real_prefill_is_cheap(default_model):
    model, tok = default_model
    task = make_needle_task(tok, context_tokens=2000, seed=3)
    from kvtier.training.traces import record_trace

    trace = record_trace(model, task.input_ids[:, :-8], task.input_ids[:, -8:])
    start = time.perf_counter()
    model(task.input_ids)
    prefill = time.perf_counter() - start
    scorer = KVPScorer()
    k, v, pos = trace["keys"].float(), trace["values"].float(), trace["positions"]
    start = time.perf_counter()
    scores = [scorer.score(k[l][None], v[l][None], pos, l) for l in range(k.shape[0])]
    scoring = time.perf_counter() - start
    assert all(s.shape == (1, 3, pos.shape[0]) and torch.isfinite(s).all() for s in scores)
    assert scoring < 0.05 * prefill, (scoring, prefill)  # the budget is 2%; this leaves room for noisy machines
