"""The environment's on/off switches: one spelling for all, and a misspelt value refused when a cache is made."""

from __future__ import annotations

import pytest
import torch

from kvtier import ConfigError, TieredCache, cache_kwargs
from kvtier.native.loader import switched_off
from kvtier.switches import env_switch
from tiny_models import tiny_llama


@pytest.mark.parametrize("value, on", [("1", True), ("on", True), (" Yes ", True), ("TRUE", True), ("", True),
                                       ("0", False), ("off", False), ("False", False), ("no", False)])
@pytest.mark.parametrize("name", ["KVTIER_NATIVE", "KVTIER_SIGTERM"])
def test_every_switch_reads_one_spelling(name, value, on, monkeypatch):
    monkeypatch.setenv(name, value)
    assert env_switch(name) is on
    if name == "KVTIER_NATIVE":
        assert switched_off(value) is not on


@pytest.mark.parametrize("name", ["KVTIER_NATIVE", "KVTIER_SIGTERM"])
def test_a_misspelt_switch_is_refused_when_a_cache_is_made(name, monkeypatch):
    """``disable`` or ``of`` had left the kernels on and the SIGTERM handler installed, with no word."""
    monkeypatch.setenv(name, "disable")
    with pytest.raises(ConfigError, match=f"{name}='disable' in the environment; allowed: 1, on, true, yes \\(on\\), "
                                          "0, off, false, no \\(off\\), or unset"):
        TieredCache(tiny_llama().config, device_budget=0.5)


def test_a_misspelt_launcher_is_refused_when_a_cache_is_made(monkeypatch):
    """KVTIER_LAUNCH was read at a GPU's first kernel launch only, in the middle of a step."""
    monkeypatch.setenv("KVTIER_LAUNCH", "ctypes")
    with pytest.raises(ConfigError, match="KVTIER_LAUNCH='ctypes' in the environment; allowed: driver, cupy, or unset"):
        TieredCache(tiny_llama().config, device_budget=0.5)


def test_a_switch_misspelt_after_the_cache_was_made_refuses_the_step_and_breaks_nothing(monkeypatch):
    """Read by the kernels at each launch (a GPU's step), a misspelt value met one mid-step, after earlier layers
    had taken it, and broke the cache: it is refused at the first layer, and the next step goes through."""
    model = tiny_llama()
    prompt = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with TieredCache(model.config, device_budget=16, recall_pages=1000) as cache, \
            TieredCache(model.config, device_budget=16, recall_pages=1000) as twin:
        logits = [model(prompt, **cache_kwargs(c)).logits for c in (cache, twin)]
        for name in ("KVTIER_NATIVE", "KVTIER_LAUNCH"):
            monkeypatch.setenv(name, "disable")
            with pytest.raises(ConfigError, match=f"{name}='disable'"):
                model(logits[0][:, -1:].argmax(-1), **cache_kwargs(cache))
            assert cache.broken is None and cache.get_seq_length() == 40
            monkeypatch.delenv(name)
        nxt = logits[1][:, -1:].argmax(-1)
        assert torch.equal(model(nxt, **cache_kwargs(cache)).logits, model(nxt, **cache_kwargs(twin)).logits)
