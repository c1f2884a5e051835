"""Bad settings raise errors that name the value and what is allowed."""

from __future__ import annotations

import types

import pytest
import torch

from kvtier import ConfigError, TieredCache, UnsupportedError
from kvtier.placement import Budget

CONFIG = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               hidden_size=32, _attn_implementation="sdpa")


@pytest.mark.parametrize("value, words", [
    (-1, "out of range"), (0, "out of range"), (0.0, "out of range"), (1.5, "out of range"),
    (-0.1, "out of range"), (float("nan"), "out of range"), ("10%", "not a number"), (None, "not a number"),
    (True, "not a number"),
])
def test_bad_device_budget(value, words):
    with pytest.raises(ConfigError, match="device_budget") as err:
        TieredCache(CONFIG, device_budget=value)
    assert words in str(err.value)
    assert "allowed" in str(err.value)


def test_token_budget_must_leave_room_for_sinks_and_window():
    with pytest.raises(ConfigError, match=r"device_budget=10 tokens leaves no room .* 4 sink .* 16-token"):
        TieredCache(CONFIG, device_budget=10, recent_tokens=16)
    TieredCache(CONFIG, device_budget=20, recent_tokens=16).close()


@pytest.mark.parametrize("kwargs, name", [
    ({"host_budget": -3}, "host_budget"), ({"host_budget": 2.0}, "host_budget"),
    ({"recall_pages": -1}, "recall_pages"), ({"recall_pages": 1.5}, "recall_pages"),
    ({"page_size": 0}, "page_size"), ({"page_size": 1025}, "page_size"),
    ({"page_size": 2 ** 20}, "page_size"), ({"mode": "drop"}, "mode"), ({"scorer": "oracle"}, "scorer"),
    ({"scorer": 42}, "scorer"), ({"sink_tokens": -1}, "sink_tokens"), ({"demote_pages": 0}, "demote_pages"),
    ({"demote_pages": 2.0}, "demote_pages"), ({"demote_pages": True}, "demote_pages"),
])
def test_other_bad_settings(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        TieredCache(CONFIG, **kwargs)


def test_largest_page_size_is_allowed():
    with pytest.raises(ConfigError, match=r"page_size=1025 .* from 1 to 1024"):
        TieredCache(CONFIG, page_size=1025)
    TieredCache(CONFIG, page_size=1024).close()


def test_evict_mode_rejects_lower_tiers():
    with pytest.raises(ConfigError, match="mode='evict'"):
        TieredCache(CONFIG, mode="evict", host_budget=0.5)


def test_unwritable_disk_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match="disk_dir=.*not a writable folder"):
        TieredCache(CONFIG, host_budget=0.1, disk_dir=str(blocker / "sub"))


def test_recurrent_layers_are_refused_by_name():
    cfg = types.SimpleNamespace(**vars(CONFIG), layer_types=["full_attention", "linear_attention"])
    with pytest.raises(UnsupportedError, match="linear_attention"):
        TieredCache(cfg)


def test_sliding_layers_are_kept_and_full_layers_tiered():
    cfg = types.SimpleNamespace(**vars(CONFIG), layer_types=["full_attention", "sliding_attention"],
                                sliding_window=64)
    with TieredCache(cfg) as cache:
        assert [type(layer).__name__ for layer in cache.layers] == ["TieredLayer", "GuardedWindow"]
        assert cache.stats()["layers"] == 1 and cache.stats()["window"]["layers"] == 1


def test_value_heads_of_another_size_than_head_dim_are_refused_when_the_cache_is_made():
    """MiMo-V2-Flash names its key heads' size head_dim (DeepSeek's name, qk_head_dim, was the only one read): the
    cache was made, and its first step failed on a shape inside the engine."""
    from kvtier.integrations.support import support

    cfg = types.SimpleNamespace(**vars(CONFIG), v_head_dim=4)
    with pytest.raises(UnsupportedError, match="key heads of 8 and value heads of 4"):
        TieredCache(cfg)
    assert not support(cfg)["supported"]


def test_a_model_that_reads_its_attentions_name_is_refused_with_eager_attention():
    """GPT-2 with reorder_and_upcast_attn takes its upcast path where its attention is named 'eager': routed
    under kvtier's name, every cache of the model, DynamicCache too and after close(), gave other logits."""
    from transformers import AutoModelForCausalLM, DynamicCache, GPT2Config

    from kvtier import cache_kwargs

    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, reorder_and_upcast_attn=True,
                     eos_token_id=None)
    ids = torch.randint(3, 256, (1, 32), generator=torch.Generator().manual_seed(1))
    for attn in ("eager", "sdpa"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.bfloat16).eval()
        with torch.no_grad():
            before = model(ids, **cache_kwargs(DynamicCache(config=model.config))).logits
            if attn == "eager":
                with pytest.raises(UnsupportedError, match="reorder_and_upcast_attn=True with eager attention"):
                    TieredCache(model.config, device_budget=1.0)
            else:
                with TieredCache(model.config, device_budget=1.0, scorer="keynorm") as cache:
                    assert torch.equal(model(ids, **cache_kwargs(cache)).logits, before)
            assert torch.equal(model(ids, **cache_kwargs(DynamicCache(config=model.config))).logits, before)


def test_latent_attention_is_refused_with_the_reason():
    cfg = types.SimpleNamespace(**vars(CONFIG), kv_lora_rank=512)
    with pytest.raises(UnsupportedError, match="latent attention"):
        TieredCache(cfg)


def test_budget_resolution():
    assert Budget(0.1).tokens(1000) == 100
    assert Budget(0.1).tokens(5) == 1
    assert Budget(64).tokens(10) == 64
    assert Budget(0, allow_zero=True).tokens(100) == 0


def test_a_share_far_below_or_far_above_one_token_is_rounded_up():
    """A margin of 1e-9 of the product had rounded half of an odd count above 10^9 tokens down and a fraction below
    1e-9 of a few tokens to none (a device budget of 0 tokens, which a count of 0 is refused for)."""
    from kvtier.config import ModelShape, TieredCacheConfig

    assert Budget(0.5).tokens(1_000_000_001) == 500_000_001 and Budget(0.5).tokens(2**40 - 1) == 2**39
    assert Budget(1e-12).tokens(1000) == Budget(1e-9).tokens(1) == 1 and Budget(0.1).tokens(0) == 0
    cfg = TieredCacheConfig(shape=ModelShape(1, 1, 8), device_budget=Budget(1e-12, "device_budget"), sink_tokens=0,
                            recent_tokens=0)
    assert cfg.device_tokens(1000) == 1


def test_kept_mass_keeps_what_the_cache_keeps():
    """The training metric sized its kept set by `ceil(budget * n)`: 8 of 100 entries at 7%, where the cache
    keeps 7."""
    from kvtier.training.evaluate import kept_mass

    importance = torch.zeros(100)
    importance[50] = 1.0   # the 8th-best entry by score
    scores = torch.zeros(100)
    scores[40:47], scores[50] = 2.0, 1.0
    assert kept_mass(scores, importance, 0.07, sink_tokens=0, recent_tokens=0) == 0


def test_a_share_is_rounded_up_from_its_exact_value():
    """Percent budgets and windows over 1..2,000 tokens: the exact share rounded up; the float product had been
    rounded up from a rounding error's height (7% of 100 tokens gave 8, for 141 pairs in 0.01..0.99 x 1..1000)."""
    from kvtier.placement.planner import recent_window

    for percent in range(1, 100):
        for seen in range(1, 2001):
            exact = -(-percent * seen // 100)
            assert Budget(percent / 100).tokens(seen) == exact, (percent, seen)
            assert recent_window(percent / 100, seen) == exact, (percent, seen)
    assert Budget(1 / 3).tokens(300) == 100 and Budget(1 / 3).tokens(301) == 101


def test_private_disk_folder_is_removed_on_close(tmp_path):
    cache = TieredCache(CONFIG, host_budget=0.1, disk_dir=tmp_path)
    path = cache.disk_path
    assert path.startswith(str(tmp_path))
    cache.close()
    assert cache.closed
    assert not (tmp_path / path).exists()
    assert tmp_path.exists()  # the user's folder stays


@pytest.mark.parametrize("impl, why", [("flex_attention", "padding"), ("paged|sdpa", "continuous-batching"),
                                       ("sdpa_paged", "continuous-batching")])
def test_attention_implementations_that_cannot_work_are_refused_by_name(impl, why):
    cfg = types.SimpleNamespace(**{**vars(CONFIG), "_attn_implementation": impl})
    with pytest.raises(UnsupportedError, match=rf"attn_implementation={impl!r}.*{why}"):
        TieredCache(cfg)


@pytest.mark.parametrize("disk_dir", [123, True, b"/tmp"])
def test_a_disk_dir_that_is_no_folder_path_is_refused_by_name(disk_dir):
    with pytest.raises(ConfigError, match=r"disk_dir=.*; allowed: a folder path \(str or os.PathLike of str\)"):
        TieredCache(CONFIG, host_budget=8, disk_dir=disk_dir)


def test_a_model_or_nothing_in_place_of_the_config_is_refused_by_name():
    from tiny_models import tiny_llama

    with pytest.raises(ConfigError, match=r"config is a model \(LlamaForCausalLM\); allowed: the model's config"):
        TieredCache(tiny_llama())
    with pytest.raises(ConfigError, match="config of type NoneType has no num_hidden_layers; allowed"):
        TieredCache(None)


@pytest.mark.parametrize("allow_zero, words", [(True, "a whole number of tokens >= 0"),
                                               (False, "a whole number of tokens >= 1")])
def test_the_budgets_allowed_values_read_plainly(allow_zero, words):
    with pytest.raises(ConfigError, match=words):
        Budget(-1, "host_budget" if allow_zero else "device_budget", allow_zero=allow_zero)


def test_the_tier_lines_of_a_cache_that_tiers_no_layer():
    """`kvtier demo` and `chat` print them for every model, one whose layers all keep a sliding window too."""
    from kvtier.cli.format import tier_lines

    stats = {"layers": 0, "kv_heads": 2, "tokens_seen": 40, "bytes_moved": {}, "pages_recalled": 0,
             "pages_recalled_from": {"host": 0, "disk": 0}, "recall_steps": 0, "transfer_wait_seconds": 0.0,
             **{t: {"tokens": 0, "bytes": 0} for t in ("device", "host", "disk")}}
    assert tier_lines(stats)[0].split()[:2] == ["device", "0"]
