"""Mistakes that used to surface as errors of other types (or as gigabytes reserved) are kvtier errors that
name the value and what is allowed; raw OS resource failures are `CapacityError`s."""

from __future__ import annotations

import errno
import os
import tempfile
import types

import pytest
import torch


from kvtier import CapacityError, ConfigError, TieredCache, cache_kwargs
from kvtier.config import ModelShape
from kvtier.scoring.keynorm import KeyNormScorer


def config(**changes):
    base = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_size=32,
                _attn_implementation="sdpa")
    base.update(changes)
    return types.SimpleNamespace(**{k: v for k, v in base.items() if v is not ...})




# ------------------------------------------------------------------------------------------------ budgets
def test_a_huge_token_budget_does_not_reserve_it_up_front(model):
    """device_budget=10**7 tokens used to size one device slab to hold it all (about 2.5 GB here, per layer)."""
    cache = TieredCache(model.config, device_budget=10**7, scorer="keynorm")
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 20)), **cache_kwargs(cache))
    reserved = cache.stats()["device"]["reserved_bytes"]
    assert reserved < 8 * 2**20, f"{reserved / 2**20:.0f} MiB reserved for 20 tokens"
    cache.close()


@pytest.mark.parametrize("name", ["device_budget", "host_budget"])
def test_an_absurd_token_budget_is_a_config_error(name):
    with pytest.raises(ConfigError, match=rf"{name}={10**30}.*out of range.*at most"):
        TieredCache(config(), **{name: 10**30})
    TieredCache(config(), **{name: 2**40}).close()   # the largest allowed


# ------------------------------------------------------------------------------------------------ model configs
@pytest.mark.parametrize("changes, words", [
    (dict(num_attention_heads=6, num_key_value_heads=4), "num_attention_heads=6, not a multiple of "
                                                         "num_key_value_heads=4"),
    (dict(head_dim=0), "head_dim=0"),
    (dict(head_dim=..., hidden_size=65), "hidden_size=65, not divisible by num_attention_heads=4"),
    (dict(num_key_value_heads=0), "num_key_value_heads=0"),
    (dict(num_hidden_layers=0), "num_hidden_layers=0"),
    (dict(num_attention_heads="4"), "num_attention_heads='4'"),
    (dict(head_dim=8.5), "head_dim=8.5"),
    (dict(head_dim=..., hidden_size=...), "hidden_size=None"),
])
def test_inconsistent_model_configs_are_config_errors(changes, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")) as err:
        ModelShape.from_config(config(**changes))
    assert "allowed" in str(err.value)
    with pytest.raises(ConfigError):
        TieredCache(config(**changes))


def test_shapes_read_from_good_configs():
    assert ModelShape.from_config(config()) == ModelShape(2, 2, 8)
    assert ModelShape.from_config(config(head_dim=..., num_key_value_heads=...)) == ModelShape(2, 4, 8)
    assert ModelShape.from_config(config(head_dim=None, hidden_size=64)) == ModelShape(2, 2, 16)
    assert ModelShape.from_config(config(head_dim=128, hidden_size=64)) == ModelShape(2, 2, 128)  # explicit wins


# ------------------------------------------------------------------------------------------------ scorer settings
@pytest.mark.parametrize("scorer, kwargs, words", [
    ("random", {"sed": 1}, r"scorer_kwargs key 'sed' is not a setting of scorer 'random'; allowed: 'seed'"),
    ("keynorm", {"seed": 1}, r"key 'seed' is not a setting of scorer 'keynorm'; allowed: 'name'"),
    (None, {"window": 8}, r"key 'window' is not a setting of scorer 'keynorm'"),
    ("kvp", {"weights": "x"}, r"key 'weights' is not a setting of scorer 'kvp'; allowed: 'path', 'model'"),
    (KeyNormScorer(), {"seed": 1}, r"scorer_kwargs=\{'seed': 1\} is given with a scorer object"),
    ("random", ["seed"], r"scorer_kwargs=\['seed'\]; allowed: a dict"),
])
def test_unknown_scorer_settings_are_config_errors(scorer, kwargs, words):
    with pytest.raises(ConfigError, match=words):
        TieredCache(config(), scorer=scorer, scorer_kwargs=kwargs)


def test_known_scorer_settings_still_work():
    cache = TieredCache(config(), scorer="random", scorer_kwargs={"seed": 3})
    assert cache.scorer.seed == 3
    cache.close()


# ------------------------------------------------------------------------------------------------ OS limits
@pytest.mark.parametrize("target, err, words", [
    ("mkdtemp", errno.EMFILE, "too many open files"),
    ("mkdtemp", errno.ENOSPC, "disk full"),
    ("owner file", errno.EMFILE, "too many open files"),
    ("owner file", errno.EDQUOT, "disk quota exceeded"),
    ("owner file", errno.EFBIG, "file-size limit"),
])
def test_resource_limits_while_making_the_folder_are_capacity_errors(tmp_path, monkeypatch, target, err, words):
    """A resource limit (not a bad folder) is a CapacityError naming it, not a ConfigError; nothing is left."""
    def fail(*args, **kwargs):
        raise OSError(err, os.strerror(err))

    if target == "mkdtemp":
        monkeypatch.setattr(tempfile, "mkdtemp", fail)
    else:
        real = os.open
        monkeypatch.setattr(os, "open", lambda path, *a, **k: fail() if str(path).endswith(".kvtier-owner")
                            else real(path, *a, **k))
    with pytest.raises(CapacityError, match=words):
        TieredCache(config(), host_budget=0.1, disk_dir=tmp_path / "d")
    monkeypatch.undo()
    assert not os.path.exists(tmp_path / "d") or os.listdir(tmp_path / "d") == []


def test_a_read_only_folder_is_a_config_error_at_construction(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    with pytest.raises(ConfigError, match="not a writable folder.*read-only folder"):
        TieredCache(config(), host_budget=0.1, disk_dir=tmp_path)


def test_a_raw_os_error_in_a_step_is_a_capacity_error(model, tmp_path, monkeypatch):
    """An OSError escaping a layer (here: no file descriptor left while the first pages go to disk mid-step)
    reaches the caller as a CapacityError naming the limit."""
    cache = TieredCache(model.config, device_budget=24, host_budget=0, disk_dir=tmp_path, scorer="keynorm")

    class NoFiles:
        def __init__(self, *args, **kwargs):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(cache._shared, "disk", NoFiles)
    with pytest.raises(CapacityError, match="layer 0 could not place the step's entries: too many open files"):
        with torch.no_grad():
            model(torch.randint(0, 128, (1, 60)), **cache_kwargs(cache))
    cache.close()
